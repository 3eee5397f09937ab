"""Tiny, well-conditioned DSA checkpoints and their GGUF files, for the
end-to-end engine tests (tests/e2e/test_engine.py, test_serve.py).

    python tests/e2e/models.py build DIR    # `make e2e-models`

(with scripts/ and tests/ on PYTHONPATH, as pytest has them: llama.cpp's
converter, the checkpoint writer shared with the GGUF tests) builds, in DIR
(cached: a model whose recipe is unchanged and whose files are what
manifest.json says is not rebuilt; a model's folder appears only once it is
complete):

- one Hugging Face directory per model (config, safetensors, a word-level
  tokenizer with a chat template): the engine's --hf-config-path and
  --tokenizer, and the transformers oracle's starting point;
- its GGUF files, written by llama.cpp's own converter (F32, F16, BF16,
  Q8_0) and quantized by llama.cpp's own quantizer (llama_model_quantize,
  the code behind llama-quantize) from the F32 file (Q4_K_M, Q5_K_M, Q6_K);
- the files users download, made by llama.cpp's own programs (TOOL_FILES):
  K and IQ mixtures by llama-quantize, the IQ ones with an importance
  matrix llama-imatrix makes of the F32 file, a "dynamic" mixture of
  per-tensor types, and a split set by llama-gguf-split;
- manifest.json: models, files and their tensor types (those of attention
  and routed-expert weights one by one, and the tensors llama-quantize gave
  a fallback type because their rows do not fit the type's blocks).

llama.cpp's converter comes from the llama-cpp-python sdist of
llama-cpp-pin.txt (fetched and cached like the other downloads) or, on a
machine without a package index, from E2E_LLAMA_CPP (the converter archive
`make wheelhouse` writes); the quantizer is the llama_cpp package built from
that same sdist (scripts/patchseries/llama_cpp_sdist.py); llama-imatrix,
llama-quantize and llama-gguf-split are built once from its source (or
LLAMA_CPP_SRC, the archive `make wheelhouse` writes) by
scripts/patchseries/llama_cpp_tools.py.

Why "well-conditioned": random initialisation at the usual 0.02 gives flat
logits and sub-layers that barely move the residual stream, so any rounding
flips greedy tokens and the tests measure noise. Here every projection has
unit gain (std 1/sqrt(fan_in)), the router's scores are spread out (few
expert-choice ties), and the output head gives logits several nats apart.

The published routed_scaling_factor (RECIPE 10): GLM-5 and DeepSeek-V3.2
scale the routed experts' sum by 2.5, and vLLM handles it apart by dtype
(in float16 it scales the shared expert, the attention output and the
residual stream down instead, and the MTP block must follow); a factor of
1, as before, let an engine drop or double it unseen. The routed experts'
down projections carry 1 / routed_scaling_factor of their unit gain, so the
models compute what RECIPE 9's did.

A decisive top-k (RECIPE 9). In a random model the indexer's choice hardly
matters: selected and unselected keys score alike and attention does not
favour the selected ones, so a wrong selection moves the output little, and
fp8 rounding flips the selection at the boundary all the time. A choice that
is merely decisive is not enough either: RECIPE 8's few strongly salient
keys (fewer than index_topk, 4-15x the others' scores) were selected even
from an fp8 indexer K cache with garbage scales (fp16 scales computed from
bit patterns: ~128 whatever the keys hold, so elements below 2 land on a
0.25 grid), which moved the log-probabilities by 0.02 %, as little as a
correct fp8 cache. Here a fixed SALIENT_FRACTION of the text tokens
(salient_tokens(); ~220 of the long prompt's 384, more than index_topk = 128
from about position 220 on) has a salience level (salience(): one of
SALIENCE, 1 to 2.8), and the selection is graded by it:

- every token embedding has a shared component along a direction c, salient
  ones one along u too (EMBED_U x their level); the other weights are
  cleared of c and u (sub-layers never write them, the output head never
  reads them), so every layer sees both, whatever the residual stream holds;
- each indexer: wk maps u onto a zero-mean direction a of the head's non-RoPE
  part and nothing else onto a, so that after k_norm (a LayerNorm: it keeps
  the ratio of a to the other components, not the scale) a key's a
  component rises with its level; q_a_proj maps c onto a query-latent
  direction cq, wq_b maps cq onto a for every head (with a positive gain);
  weights_proj gives every head a positive weight from c. Every salient key
  scores above every non-salient one by over 60 % of the top score (35x
  the largest fp8 score change), and the levels' mean scores rise with the
  level; within and between neighbouring levels the scores are close, so
  where the boundary falls among salient keys fp8 swaps ~2 of the 128
  selected keys, and a cache that loses the keys' small elements (~15)
  many more. k_norm's weight and bias are scaled by INDEX_K_NORM = 0.1, so
  K elements are ~0.1, not ~1: the garbage scales' 0.25 grid erases most
  of them;
- MLA: kv_a_proj_with_mqa maps u onto a key-latent direction b (the values
  do not read b), kv_b_proj maps b and q_b_proj maps cq onto one nope
  direction a_h per head: the salient keys get ~99 % of the attention
  weight, graded by level in the indexer's order (per key, the next lower
  level gets 5-10 % of the weight of the top one, the lowest < 0.1 %: the
  keys fp8 swaps hardly count, those the bad cache drops do), peaked among
  keys of a level (q_b_proj's random part x3), and o_proj has 4x the
  residual gain: attention moves the output. Scale-free errors of the
  next-token log-probabilities where top-k is active (judging.py's
  measure, long prompt, glm5 / glm52 / dsv32): fp8 indexer scores 0.0005 /
  0.0008 / 0.0003; the garbage K scales 0.15 / 0.13 / 0.16; a random
  selection of index_topk keys 0.44 / 0.47 / 0.48;
- the output head reads each text token's own embedding as a logit of a
  "next" token (a permutation, NEXT_TOKEN): the greedy token follows from
  the current token more than from the context, so the NextN block, which
  sees the next token but little context, still drafts the target's greedy
  tokens (test_oracles asks a quarter), while the context moves the whole distribution.
tests/e2e/test_oracles.py checks these properties on the built checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Types written by the converter, then types made by llama.cpp's quantizer.
CONVERTED = ("f32", "f16", "bf16", "q8_0")
QUANTIZED = ("q4_k_m", "q5_k_m", "q6_k")


@dataclass(frozen=True)
class ToolFile:
    """A file made by llama.cpp's command-line tools as published files are
    (tests/support/llama_cpp_quantize.py): llama-quantize's type argument,
    whether an importance matrix of the model goes with it, per-tensor
    types (--tensor-type PATTERN=TYPE, the first pattern in a tensor's name
    wins) and the type its routed gate/up experts must carry; or a split
    set of another file (split_of) in `shards` shards by llama-gguf-split."""
    ftype: str = ""
    experts: str = ""
    imatrix: bool = False
    tensor_types: tuple[tuple[str, str], ...] = ()
    token_embedding_type: str | None = None
    output_tensor_type: str | None = None
    split_of: str | None = None
    shards: int = 0


# A "dynamic" mixture like the published UD files: attention (the indexer
# with it) and the MTP block Q8_0, shared experts Q6_K, routed gate/up
# experts IQ2_XXS, routed down a step higher, the leading dense layers (the
# only plain ffn_gate/up/down tensors) higher still.
DYNAMIC = (
    (r"ffn_(gate|up)_exps", "IQ2_XXS"),
    (r"ffn_down_exps", "IQ3_XXS"),
    (r"ffn_(gate|up|down)_shexp", "Q6_K"),
    (r"ffn_(gate|up|down)\.weight", "Q4_K"),
    (r"attn_|indexer\.|nextn\.", "Q8_0"),
)

# Types made by llama.cpp's tools (the IQ types, and the dynamic mixture,
# with the model's own importance matrix: IQ1/IQ2/IQ3_XXS refuse to
# quantize without one). Every tensor these types quantize has rows of a
# multiple of 256 (the K and IQ blocks) but attn_k_b (qk_nope_head_dim
# columns: 192 in GLM-5, 128 in DeepSeek-V3.2, as in the real models), which
# the quantizer gives a 32-block type instead; the manifest records it.
TOOL_FILES = {
    "q2_k": ToolFile("Q2_K", "Q2_K"),
    "q3_k_m": ToolFile("Q3_K_M", "Q3_K"),
    "iq4_xs": ToolFile("IQ4_XS", "IQ4_XS", imatrix=True),
    "iq3_xxs": ToolFile("IQ3_XXS", "IQ3_XXS", imatrix=True),
    "iq2_xxs": ToolFile("IQ2_XXS", "IQ2_XXS", imatrix=True),
    "iq1_m": ToolFile("IQ1_M", "IQ1_M", imatrix=True),
    "iq2_xxs-dynamic": ToolFile("IQ2_XXS", "IQ2_XXS", imatrix=True, tensor_types=DYNAMIC,
                                token_embedding_type="Q4_K", output_tensor_type="Q6_K"),
    "q4_k_m-split": ToolFile(split_of="q4_k_m", shards=3),
}
LOW_BIT = tuple(TOOL_FILES)

# llama-imatrix runs the model without its NextN (MTP) block, and the
# quantizer refuses IQ1/IQ2/IQ3_XXS tensors without importance data: files
# made with an importance matrix keep that block in NEXTN_TYPE.
NEXTN_TYPE = "Q8_0"

# The importance matrix's calibration text: random text tokens (as the test
# prompts are), in chunks as long as the long prompt.
CALIBRATION = dict(tokens=3072, ctx=384, seed=7)

VOCAB = 512
BOS, EOS = 0, 1
# Reserved tokens of the chat template (never in random prompts).
CHAT_TOKENS = {"user": 2, "assistant": 3, "end": 4}
FIRST_TEXT_TOKEN = 8

# Bump when the recipe below changes, so cached models are rebuilt.
RECIPE = 10


_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    # 512: each of two tensor-parallel ranks still holds whole 256-wide K-quant
    # blocks of the experts' down projection (real models: 2048 and more).
    moe_intermediate_size=512,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    q_lora_rank=256,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    first_k_dense_replace=1,
    max_position_embeddings=2048,
    topk_method="noaux_tc",
    routed_scaling_factor=2.5,  # GLM-5's and DeepSeek-V3.2's published value
    bos_token_id=BOS,
    eos_token_id=EOS,
    tie_word_embeddings=False,
    # GLM-5's indexer geometry (DeepGEMM's logits kernels need 32/64 heads);
    # top-k 128 (vLLM's FLASHMLA_SPARSE path needs a multiple of 128), far
    # below the long prompt's length.
    index_n_heads=32,
    index_head_dim=128,
    index_topk=128,
)


# Keys the published GLM-5.x config.json files carry and transformers'
# GlmMoeDsaConfig does not write (its modelling hard-codes them); vLLM reads
# them, so the test checkpoints carry them like the real ones.
_GLM_KEYS = dict(scoring_func="sigmoid", rope_interleave=True, indexer_rope_interleave=True)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config_class: str
    architecture: str
    layers: int
    mtp_layers: int = 0
    extra: dict = field(default_factory=dict)
    seed: int = 0
    # the file types built for it (None: every type a build asks for)
    types: tuple[str, ...] | None = None

    @property
    def config(self) -> dict:
        return dict(_COMMON, **self.extra)


MODELS = {
    # GLM-5: every layer runs its own indexer; NextN block for MTP.
    "glm5": ModelSpec(
        "glm5", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", layers=3, mtp_layers=1,
        extra=dict(qk_nope_head_dim=192, v_head_dim=256, **_GLM_KEYS), seed=11,
    ),
    # GLM-5.2: shared layers reuse the previous full layer's top-k and carry
    # no indexer tensors; its NextN block runs its own indexer ("full").
    "glm52": ModelSpec(
        "glm52", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", layers=4, mtp_layers=1,
        extra=dict(qk_nope_head_dim=192, v_head_dim=256, **_GLM_KEYS,
                   indexer_types=["full", "shared", "full", "shared"]),
        seed=12,
    ),
    # DeepSeek-V3.2 (llama.cpp arch deepseek32): qk_nope 128, v_head 128.
    "dsv32": ModelSpec(
        "dsv32", "DeepseekV32Config", "DeepseekV32ForCausalLM", layers=3,
        extra=dict(qk_nope_head_dim=128, v_head_dim=128, scoring_func="sigmoid"), seed=13,
    ),
    # GLM-5 with the real index_topk (2048) and a 32k context, for prompts of
    # 8-12k tokens (tests/e2e/test_long_context.py); F16 and Q4_K_M (batches
    # long enough for the Marlin MoE's float path).
    "glm5-long": ModelSpec(
        "glm5-long", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", layers=3,
        extra=dict(qk_nope_head_dim=192, v_head_dim=256, **_GLM_KEYS, index_topk=2048,
                   max_position_embeddings=32768),
        seed=14, types=("f16", "q4_k_m"),
    ),
}


def _recipe_hash(spec: ModelSpec) -> str:
    tool_files = {t: asdict(f) for t, f in TOOL_FILES.items()}
    blob = json.dumps([RECIPE, asdict(spec), _COMMON, tool_files, CALIBRATION, NEXTN_TYPE],
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# The decisive top-k (see the module docstring). Hidden-state norms are ~16
# (256 dims of unit rms); the factors below are in those units.
SALIENT_FRACTION = 0.6  # of the text tokens: ~220 of the long prompt's 384
SALIENCE = (1.0, 1.4, 2.0, 2.8)  # a salient token's level (its u component, x EMBED_U)
EMBED_C, EMBED_U = 8.0, 8.0  # embeddings: c (every token), u (salient ones, x level)
Q_C = 1.5  # q_a_proj: c -> cq, the query latent's shared direction
KV_U = 1.0  # kv_a_proj_with_mqa: u -> b, the key latent's salient direction
MLA_Q, MLA_K = 1.5, 1.5  # q_b_proj: cq -> a_h; kv_b_proj: b -> a_h (graded by level)
MLA_Q_RANDOM = 3.0  # q_b_proj's random part: attention peaked among salient keys
O_PROJ_GAIN = 4.0  # o_proj, over the residual gain: attention moves the output
INDEX_K, INDEX_Q = 4.0, 1.0  # indexer wk: u -> a; wq_b: cq -> a (per head x 0.75..1.25)
INDEX_K_NORM = 0.1  # k_norm's weight and bias, scaled: K elements of ~0.1
INDEX_W, INDEX_W_RANDOM = 0.15, 0.2  # weights_proj: c -> every head (> 0); random part
NEXT_TOKEN = 24.0  # output head: a text token's own embedding -> its next token


def salience(spec: ModelSpec):
    """Each token's salience (see the module docstring), a [VOCAB] tensor: 0
    but for a fixed random SALIENT_FRACTION of the text tokens (from
    spec.seed), each of which has one of the SALIENCE levels."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed + 2000)
    text = torch.arange(FIRST_TEXT_TOKEN, VOCAB)
    n = round(SALIENT_FRACTION * len(text))
    chosen = text[torch.randperm(len(text), generator=gen)[:n]]
    levels = torch.tensor(SALIENCE)
    out = torch.zeros(VOCAB)
    out[chosen] = levels[torch.randint(len(levels), (n,), generator=gen)]
    return out


def salient_tokens(spec: ModelSpec) -> list[int]:
    """The model's salient tokens: those of salience() > 0."""
    return salience(spec).nonzero().flatten().tolist()


def _condition(model, spec: ModelSpec) -> None:
    """Unit-gain weights, then a decisive top-k (see the module docstring)."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    n_layers = spec.layers + spec.mtp_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("lm_head.weight"):
                # Logits a few nats apart: a peaked, not flat, distribution.
                p.copy_(torch.randn(p.shape, generator=gen) * 4.0 / p.shape[1] ** 0.5)
            elif p.ndim == 1:
                # Norm weights and biases: every value counts.
                base = 0.0 if ("bias" in name) else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                gain = 1.0
                if name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")):
                    gain = (2 * n_layers) ** -0.5  # residual branches add up
                if ".experts" in name and "shared_experts" not in name and "down_proj" in name:
                    gain /= spec.config["routed_scaling_factor"]  # RECIPE 10
                if name.endswith("o_proj.weight"):
                    gain *= O_PROJ_GAIN
                if name.endswith("mlp.gate.weight"):
                    gain = 3.0  # router scores spread out: few ties
                p.copy_(torch.randn(p.shape, generator=gen) * gain / fan_in**0.5)
        _decisive_topk(model, spec)


def _drop_in(w, *dirs):
    """w with its input (last) dimension orthogonal to the unit vectors dirs."""
    for d in dirs:
        w = w - (w @ d)[..., None] * d
    return w


def _drop_out(w, *dirs):
    """w ([out, in]) with its outputs orthogonal to the unit vectors dirs."""
    for d in dirs:
        w = w - d[:, None] * (d @ w)[None]
    return w


def _decisive_topk(model, spec: ModelSpec) -> None:
    """Salient keys: on top of every indexer's scores and with most of the
    main attention's weight, both graded by level (see the module
    docstring)."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed + 3000)
    cfg = model.config
    hidden = cfg.hidden_size

    def unit(n: int) -> torch.Tensor:
        v = torch.randn(n, generator=gen)
        return v / v.norm()

    # c (every token) and u (salient tokens): orthonormal hidden directions.
    c, u = torch.linalg.qr(torch.randn(hidden, 2, generator=gen))[0].T
    salient = salience(spec)
    emb = model.model.embed_tokens.weight
    emb.copy_(_drop_in(emb, c, u) + EMBED_C * c + EMBED_U * salient[:, None] * u)
    # Sub-layers write nothing along c and u, the output head reads neither:
    # every layer sees the embedding's c and u components.
    for name, p in model.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")):
            p.copy_(_drop_out(p, c, u) if p.ndim == 2 else
                    torch.stack([_drop_out(e, c, u) for e in p]))
    head = _drop_in(model.lm_head.weight, c, u)
    # A next token per text token (a permutation): the output head reads the
    # current token's own embedding (its random part) as a logit of that token.
    text = torch.arange(FIRST_TEXT_TOKEN, cfg.vocab_size)
    after = text[torch.randperm(len(text), generator=gen)]
    own = _drop_in(emb[text], c, u)
    head[after] += NEXT_TOKEN * own / own.norm(dim=-1, keepdim=True) / hidden**0.5
    model.lm_head.weight.copy_(head)

    nope, rope, v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    heads, kv_lora, q_lora = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.q_lora_rank
    for layer in model.model.layers:
        attn = layer.self_attn
        # The query latent (q_a_layernorm's output: MLA's and the indexer's
        # queries) carries c as cq.
        cq = unit(q_lora)
        w = attn.q_a_proj.weight
        w.copy_(_drop_out(_drop_in(w, c, u), cq) + Q_C * torch.outer(cq, c))
        # The key latent (kv_a_layernorm's output) carries u as b; the values
        # do not read b.
        b = unit(kv_lora)
        w = _drop_in(attn.kv_a_proj_with_mqa.weight, c, u)
        w[:kv_lora] = _drop_out(w[:kv_lora], b) + KV_U * torch.outer(b, u)
        attn.kv_a_proj_with_mqa.weight.copy_(w)
        wq = _drop_in(attn.q_b_proj.weight, cq).view(heads, nope + rope, q_lora)
        wkv = _drop_in(attn.kv_b_proj.weight, b).view(heads, nope + v_dim, kv_lora)
        for h in range(heads):
            # MLA head h: query and salient key meet along a (nope part).
            a = unit(nope)
            wq[h, :nope] = _drop_out(wq[h, :nope] * MLA_Q_RANDOM, a) + MLA_Q * torch.outer(a, cq)
            wq[h, nope:] *= MLA_Q_RANDOM
            wkv[h, :nope] = _drop_out(wkv[h, :nope], a) + MLA_K * torch.outer(a, b)
        attn.q_b_proj.weight.copy_(wq.reshape(attn.q_b_proj.weight.shape))
        attn.kv_b_proj.weight.copy_(wkv.reshape(attn.kv_b_proj.weight.shape))
        ix = getattr(attn, "indexer", None)
        if ix is None:  # GLM-5.2's shared layers
            continue
        dim, n_ix = ix.head_dim, ix.n_heads
        # K elements of ~INDEX_K_NORM (k_norm's output).
        ix.k_norm.weight.mul_(INDEX_K_NORM)
        ix.k_norm.bias.mul_(INDEX_K_NORM)
        # a: a zero-mean direction (k_norm is a LayerNorm) of the non-RoPE part.
        a = torch.zeros(dim)
        a[rope:] = torch.randn(dim - rope, generator=gen)
        a[rope:] -= a[rope:].mean()
        a /= a.norm()
        w = ix.wk.weight
        w.copy_(_drop_out(_drop_in(w, c, u), a) + INDEX_K * torch.outer(a, u))
        wq = _drop_in(ix.wq_b.weight, cq).view(n_ix, dim, q_lora)
        gains = INDEX_Q * (0.75 + 0.5 * torch.rand(n_ix, generator=gen))
        for h in range(n_ix):
            wq[h] = _drop_out(wq[h], a) + gains[h] * torch.outer(a, cq)
        ix.wq_b.weight.copy_(wq.reshape(ix.wq_b.weight.shape))
        # Head weights: positive (from c), a little spread.
        w = ix.weights_proj.weight
        w.copy_(INDEX_W_RANDOM * _drop_in(w, c, u) + INDEX_W * torch.ones(n_ix, 1) * c)


def _tokenizer(path: Path, max_length: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"<t{i}>": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t5>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    user, assistant, end = (f"<t{CHAT_TOKENS[k]}>" for k in ("user", "assistant", "end"))
    template = (
        "{% for m in messages %}"
        f"{{% if m['role'] == 'user' %}}{user} {{% else %}}{assistant} {{% endif %}}"
        f"{{{{ m['content'] }}}} {end} "
        "{% endfor %}"
        f"{{% if add_generation_prompt %}}{assistant} {{% endif %}}"
    )
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": f"<t{BOS}>",
        "eos_token": f"<t{EOS}>",
        "unk_token": "<t5>",
        "add_bos_token": False,
        "chat_template": template,
        "model_max_length": max_length,
    }, indent=1))


def _drafting_nextn(spec: ModelSpec):
    """NextN tensors of one MTP layer at a time. A random NextN block proposes
    tokens the target never takes: no draft is accepted, and the path that
    keeps accepted tokens is not run. This one passes the next token's
    embedding through (and a little of the target's hidden state), so the
    block predicts from the next token much as the target does: in fp32 about
    four in five of its drafts are the target's greedy tokens (the output head
    leans on a fixed next token per token, see _condition)."""
    import torch

    from support.tiny_checkpoints import NEXTN_NORMS

    gen = torch.Generator().manual_seed(spec.seed + 1000)

    def tensors(hidden: int) -> dict:
        eh_proj = torch.cat([torch.eye(hidden), 0.1 * torch.randn(
            hidden, hidden, generator=gen) / hidden**0.5], dim=1)
        return {"eh_proj.weight": eh_proj,
                **{f"{norm}.weight": 1 + 0.1 * torch.randn(hidden, generator=gen)
                   for norm in NEXTN_NORMS}}

    return tensors


def build_checkpoint(spec: ModelSpec, path: Path) -> None:
    from support.tiny_checkpoints import write_checkpoint

    write_checkpoint(path, spec.config_class, spec.architecture, spec.config,
                     spec.layers, spec.mtp_layers, spec.seed,
                     condition=lambda model: _condition(model, spec),
                     nextn_tensors=_drafting_nextn(spec))
    _tokenizer(path, spec.config["max_position_embeddings"])


def quantize(src: Path, dst: Path, qtype: str) -> None:
    """llama.cpp's quantizer (llama_model_quantize: llama-quantize's code)."""
    import ctypes

    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype.upper()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    tmp = dst.with_suffix(".gguf.tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"llama_model_quantize {src.name} -> {qtype} failed (rc {rc})")
    tmp.rename(dst)


_SHARD = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shards(path: Path) -> list[Path]:
    """Every file of the GGUF set that `path` (a single file or the first
    shard, <stem>-00001-of-0000N.gguf, as llama.cpp names them) belongs to."""
    m = _SHARD.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def tensor_types(path: Path) -> dict[str, str]:
    """GGUF tensor -> type name, over every shard of a split set."""
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for f in shards(path) for t in GGUFReader(f).tensors}


# The tensors whose types the manifest lists one by one: the weights of
# attention (the indexer's with it) and of the routed experts.
_LISTED = re.compile(r"blk\.\d+\.(attn_\w+|indexer\.\w+|ffn_\w+_exps)\.weight")


def listed_types(types: dict[str, str]) -> dict[str, str]:
    """The manifest's tensor-by-tensor record of a file's types."""
    return {name: t for name, t in sorted(types.items())
            if _LISTED.fullmatch(name) and not name.endswith("norm.weight")}


def convert(converter: Path, jobs: Path) -> None:
    """llama.cpp's converter (in converter) on jobs.json, shared with the GGUF
    tests (tests/support/llama_cpp_convert.py)."""
    from support import llama_cpp_convert

    llama_cpp_convert.run(converter, jobs, check=True)


def converter_dir(work: Path) -> Path:
    """llama.cpp's converter: E2E_LLAMA_CPP (an archive of it) or the sdist."""
    # Imported here: cases.py (and rejudge.py through it) imports this module
    # without scripts/ on the path.
    from patchseries.llama_cpp_sdist import converter_dir

    return converter_dir(work)


def tools_dir() -> Path:
    """llama.cpp's llama-imatrix, llama-quantize and llama-gguf-split (built
    once, scripts/patchseries/llama_cpp_tools.py)."""
    from patchseries.llama_cpp_tools import cpu_tools

    return cpu_tools()


# Threads llama.cpp's tools run on.
TOOL_THREADS = 4


def calibration_tokens() -> list[int]:
    import random

    rng = random.Random(CALIBRATION["seed"])
    return [rng.randint(FIRST_TEXT_TOKEN, VOCAB - 1) for _ in range(CALIBRATION["tokens"])]


def make_imatrix(tools: Path, model: Path, out: Path) -> None:
    from support import llama_cpp_quantize

    llama_cpp_quantize.imatrix(tools, model, llama_cpp_quantize.token_text(calibration_tokens()),
                               out, CALIBRATION["ctx"], TOOL_THREADS)


def tool_quantize(tools: Path, src: Path, dst: Path, recipe: ToolFile, imatrix: Path | None,
                  nextn_layer: int | None) -> dict[str, dict]:
    """llama-quantize as `recipe` says; returns the tensors it gave another
    type than it meant to (llama_cpp_quantize.quantize)."""
    from support import llama_cpp_quantize

    tensor_types = recipe.tensor_types
    if imatrix is not None and nextn_layer is not None:
        tensor_types = ((rf"blk\.{nextn_layer}\.", NEXTN_TYPE), *tensor_types)
    return llama_cpp_quantize.quantize(
        tools, src, dst, recipe.ftype, TOOL_THREADS, imatrix=imatrix,
        tensor_types=tensor_types, token_embedding_type=recipe.token_embedding_type,
        output_tensor_type=recipe.output_tensor_type)


def split_file(tools: Path, src: Path, prefix: Path, shards: int) -> list[Path]:
    """llama-gguf-split: `src` in `shards` shards of about equal tensor counts."""
    from support import llama_cpp_quantize

    n = len(tensor_types(src))
    return llama_cpp_quantize.split(tools, src, prefix, -(-n // shards))


def _file_names(mdir: Path, name: str) -> list[str]:
    """The files of a type: name, or the shards of the set it is the first of."""
    return [p.name for p in shards(mdir / name)]


def _mismatch(entry: dict | None, mdir: Path, recipe: str, types: tuple[str, ...]) -> str:
    """Why a model folder is not what `build` would make ("" when it is): its
    manifest entry is checked against the files it names."""
    if not entry or entry.get("recipe") != recipe:
        return "new recipe"
    if missing := sorted(set(types) - set(entry["gguf"])):
        return f"no {', '.join(missing)} file"
    if not (mdir / entry["hf"] / "config.json").is_file():
        return f"{entry['hf']}/config.json is missing"
    for t, name in entry["gguf"].items():
        stem = f"{mdir.name}-{t}"
        names = _file_names(mdir, name)
        if name != f"{stem}.gguf" and names != entry.get("shards", {}).get(t):
            return f"{t} names {name}"
        if not all(n.startswith(stem) for n in names):
            return f"{t} names {names}"
        if lacking := [n for n in names if not (mdir / n).is_file()]:
            return f"{', '.join(lacking)} missing"
        types_of = tensor_types(mdir / name)
        if (sorted(set(types_of.values())) != entry["types"].get(t)
                or listed_types(types_of) != entry.get("tensor_types", {}).get(t)):
            return f"{name} holds other tensor types than the manifest says"
    return ""


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def build(out: Path, types: tuple[str, ...] = CONVERTED + QUANTIZED + LOW_BIT,
          names: tuple[str, ...] | None = None) -> dict:
    """The models (those of `names`, default all) with files of `types` in
    `out`; returns the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    old = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    manifest: dict = {"models": {}}
    with tempfile.TemporaryDirectory() as work:
        converter = tools = None
        for spec in MODELS.values():
            recipe = _recipe_hash(spec)
            mdir = out / spec.name
            entry = old.get("models", {}).get(spec.name)
            wanted = types if spec.types is None else tuple(t for t in types if t in spec.types)
            if (names is not None and spec.name not in names) or not wanted:
                if entry:  # another model's entry, left as it is
                    manifest["models"][spec.name] = entry
                continue
            if not (why := _mismatch(entry, mdir, recipe, wanted)):
                print(f"[e2e-models] {spec.name}: up to date", flush=True)
                manifest["models"][spec.name] = entry
                continue
            if entry:
                print(f"[e2e-models] {spec.name}: rebuilt ({why})", flush=True)
            if converter is None:
                converter = converter_dir(Path(work))
            if tools is None and set(wanted) & set(TOOL_FILES):
                tools = tools_dir()
            manifest["models"][spec.name] = _build_model(spec, recipe, mdir, converter, tools,
                                                         wanted)
            _write_json(manifest_path, manifest)
    _write_json(manifest_path, manifest)
    return manifest


def _build_model(spec: ModelSpec, recipe: str, mdir: Path, converter: Path, tools: Path | None,
                 types: tuple[str, ...]) -> dict:
    """Build one model in <mdir>.partial and put it in mdir's place once
    complete: a failed or interrupted build leaves no half-written model.
    Returns its manifest entry."""
    tmp = mdir.with_name(f"{mdir.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        print(f"[e2e-models] {spec.name}: checkpoint", flush=True)
        hf = tmp / "hf"
        hf.mkdir(parents=True)
        build_checkpoint(spec, hf)
        # The file a split set is cut from is made too; F32 is every quantizer's input.
        wanted = set(types) | {TOOL_FILES[t].split_of for t in types
                               if t in TOOL_FILES and TOOL_FILES[t].split_of}
        tool_made = [t for t in TOOL_FILES if t in wanted]
        needs_f32 = bool(wanted & set(QUANTIZED)) or any(TOOL_FILES[t].ftype for t in tool_made)
        converted = [t for t in CONVERTED if t in wanted or (t == "f32" and needs_f32)]
        jobs = [{"model": str(hf), "outtype": t, "outfile": str(tmp / f"{spec.name}-{t}.gguf")}
                for t in converted]
        (tmp / "jobs.json").write_text(json.dumps(jobs))
        print(f"[e2e-models] {spec.name}: llama.cpp converter ({', '.join(converted)})",
              flush=True)
        convert(converter, tmp / "jobs.json")
        files = {t: f"{spec.name}-{t}.gguf" for t in converted}
        for q in (t for t in QUANTIZED if t in wanted):
            print(f"[e2e-models] {spec.name}: llama.cpp quantizer -> {q}", flush=True)
            quantize(tmp / files["f32"], tmp / f"{spec.name}-{q}.gguf", q)
            files[q] = f"{spec.name}-{q}.gguf"
        entry = {
            "recipe": recipe,
            "layers": spec.layers,
            "mtp_layers": spec.mtp_layers,
            "hf": "hf",
        }
        imatrix = None
        if any(TOOL_FILES[t].imatrix for t in tool_made):
            imatrix = tmp / f"{spec.name}-imatrix.gguf"
            print(f"[e2e-models] {spec.name}: llama-imatrix ({CALIBRATION['tokens']} tokens)",
                  flush=True)
            make_imatrix(tools, tmp / files["f32"], imatrix)
            entry["imatrix"] = {"file": imatrix.name, **CALIBRATION}
        fallback, shard_names = {}, {}
        for t in tool_made:
            recipe_t = TOOL_FILES[t]
            out = tmp / f"{spec.name}-{t}.gguf"
            if recipe_t.split_of:
                print(f"[e2e-models] {spec.name}: llama-gguf-split {recipe_t.split_of} -> {t}",
                      flush=True)
                made = split_file(tools, tmp / files[recipe_t.split_of], out.with_suffix(""),
                                  recipe_t.shards)
                files[t] = made[0].name
                shard_names[t] = [p.name for p in made]
                continue
            print(f"[e2e-models] {spec.name}: llama-quantize -> {t}", flush=True)
            fallback[t] = tool_quantize(tools, tmp / files["f32"], out, recipe_t,
                                        imatrix if recipe_t.imatrix else None,
                                        spec.layers if spec.mtp_layers else None)
            files[t] = out.name
        types_of = {t: tensor_types(tmp / f) for t, f in files.items()}
        entry.update({
            "gguf": files,
            "types": {t: sorted(set(v.values())) for t, v in types_of.items()},
            # what llama.cpp gave attention and routed experts, tensor by tensor
            "tensor_types": {t: listed_types(v) for t, v in types_of.items()},
        })
        if shard_names:
            entry["shards"] = shard_names
        if fallback:
            # llama-quantize's files: the type their routed gate/up experts
            # are named for, and the tensors whose rows did not fit the type
            # the quantizer meant to give them, with the type they got instead
            entry["named"] = {t: TOOL_FILES[t].experts for t in fallback}
            entry["fallback"] = fallback
        shutil.rmtree(mdir, ignore_errors=True)
        os.rename(tmp, mdir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return entry


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] != "build":
        raise SystemExit(__doc__)
    build(Path(sys.argv[2]))


if __name__ == "__main__":
    main()
