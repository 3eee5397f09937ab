# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The benchmark checkpoints: what one GPU runs of the real models.

Under tensor parallelism (no expert parallelism) each rank of vLLM holds
1/TP of the attention heads, of every expert's and the dense MLP's
intermediate width, and the whole of the replicated parts (q_a / kv_a
projections, the DSA indexer, norms, the router). A checkpoint here has one
rank's shapes and the real layer kinds (3 dense layers, then MoE layers),
but only a few layers: its timings are the slice's, not the model's.

The vocabulary stays whole (154,880 / 129,280): vLLM splits embedding and
output head by vocabulary under TP, so the slice's output head reads TP
times the bytes of one rank's (open question in the report; ``vocab=``
overrides it).

No torch here: the specs, the tensor list, the HF config keys, the GGUF
shapes and types the files must have are plain data, shared by the builder,
the tests and the driver.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

# GLM-5.x publish these keys, which vLLM reads (tests/e2e/models.py).
GLM_KEYS = dict(scoring_func="sigmoid", rope_interleave=True, indexer_rope_interleave=True)


@dataclass(frozen=True)
class Spec:
    name: str
    title: str
    config_class: str  # transformers config class
    architecture: str  # HF architectures[0]
    gguf_arch: str  # llama.cpp's general.architecture
    hidden: int
    heads: int
    q_lora: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    experts: int
    experts_used: int
    shared_experts: int
    moe_intermediate: int
    intermediate: int
    index_heads: int
    index_dim: int
    index_topk: int
    vocab: int
    dense_layers: int
    moe_layers: int
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 2.5
    max_position: int = 202752
    rope_theta: float = 1_000_000.0
    # GLM-5.2's IndexShare schedule (None: every layer has an indexer)
    index_topk_freq: int | None = None
    index_skip_topk_offset: int | None = None
    tp: int = 1  # the tensor-parallel degree whose one rank this is
    extra: dict = field(default_factory=dict)
    seed: int = 0

    @property
    def layers(self) -> int:
        return self.dense_layers + self.moe_layers

    def indexer_types(self) -> list[str] | None:
        """GLM-5.2: which layers run their own indexer ("full") and which
        reuse the previous full layer's top-k ("shared"), as the published
        config derives it (freq 4, offset 3: 21 of 78 layers full), for
        this slice's first ``layers`` layers."""
        if self.index_topk_freq is None:
            return None
        off, freq = self.index_skip_topk_offset or 0, self.index_topk_freq
        return ["shared" if max(i - off + 1, 0) % freq else "full" for i in range(self.layers)]

    def has_indexer(self, layer: int) -> bool:
        types = self.indexer_types()
        return types is None or types[layer] == "full"

    def with_(self, **changes) -> Spec:
        return dataclasses.replace(self, **changes)


_GLM5 = dict(
    config_class="GlmMoeDsaConfig", architecture="GlmMoeDsaForCausalLM", gguf_arch="glm-dsa",
    hidden=6144, q_lora=2048, kv_lora=512, qk_nope=192, qk_rope=64, v_head=256,
    experts=256, experts_used=8, shared_experts=1, index_heads=32, index_dim=128,
    index_topk=2048, vocab=154880, dense_layers=3, max_position=202752, extra=GLM_KEYS,
)

SPECS: dict[str, Spec] = {
    s.name: s
    for s in [
        # GLM-5 on 8 GPUs: one rank (64/8 heads, 2048/8 expert width, 12288/8 dense)
        Spec("glm5-tp8", "GLM-5, one rank of TP 8", heads=8, moe_intermediate=256,
             intermediate=1536, moe_layers=3, tp=8, seed=501, **_GLM5),
        # GLM-5 on 4 GPUs
        Spec("glm5-tp4", "GLM-5, one rank of TP 4", heads=16, moe_intermediate=512,
             intermediate=3072, moe_layers=3, tp=4, seed=502, **_GLM5),
        # GLM-5.2: GLM-5's shapes, IndexShare (layers 0-2 full, then 1 in 4)
        Spec("glm52-tp8", "GLM-5.2, one rank of TP 8", heads=8, moe_intermediate=256,
             intermediate=1536, moe_layers=3, tp=8, index_topk_freq=4,
             index_skip_topk_offset=3, seed=503, **_GLM5),
        # GLM-5 at full width (what one GPU of TP 1 would hold), one MoE layer
        Spec("glm5-full", "GLM-5, full width (TP 1)", heads=64, moe_intermediate=2048,
             intermediate=12288, moe_layers=1, tp=1, seed=504, **_GLM5),
        # DeepSeek-V3.2 on 8 GPUs (128/8 heads, 18432/8 dense)
        Spec("dsv32-tp8", "DeepSeek-V3.2, one rank of TP 8", config_class="DeepseekV32Config",
             architecture="DeepseekV32ForCausalLM", gguf_arch="deepseek32", hidden=7168,
             heads=16, q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128,
             experts=256, experts_used=8, shared_experts=1, moe_intermediate=256,
             intermediate=2304, index_heads=64, index_dim=128, index_topk=2048,
             vocab=129280, dense_layers=3, moe_layers=3, n_group=8, topk_group=4,
             max_position=163840, rope_theta=10000.0, tp=8,
             extra=dict(scoring_func="sigmoid"), seed=505),
    ]
}


def tiny(spec: Spec, **over) -> Spec:
    """The same layer kinds at a width a CPU test builds in seconds (the
    real expert count and top-k: the routing check needs them)."""
    small = dict(hidden=256, heads=2, q_lora=128, kv_lora=512, index_heads=spec.index_heads,
                 index_dim=128, moe_intermediate=256, intermediate=256,
                 dense_layers=min(spec.dense_layers, 1), moe_layers=min(spec.moe_layers, 2),
                 index_topk=64, max_position=4096, vocab=8192, name=f"{spec.name}-tiny")
    if spec.index_topk_freq:  # keep a shared layer in the slice
        small.update(dense_layers=3, moe_layers=1)
    small.update(over)
    return spec.with_(**small)


# ---------------------------------------------------------------------------
# HF side: config and the tensors of the original checkpoint format
# ---------------------------------------------------------------------------


def hf_config(spec: Spec) -> dict:
    """The keyword arguments of the transformers config class (plus the
    published keys vLLM reads)."""
    cfg = dict(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        moe_intermediate_size=spec.moe_intermediate, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
        n_routed_experts=spec.experts, n_shared_experts=spec.shared_experts,
        num_experts_per_tok=spec.experts_used, n_group=spec.n_group, topk_group=spec.topk_group,
        q_lora_rank=spec.q_lora, kv_lora_rank=spec.kv_lora, qk_nope_head_dim=spec.qk_nope,
        qk_rope_head_dim=spec.qk_rope, v_head_dim=spec.v_head,
        first_k_dense_replace=spec.dense_layers, max_position_embeddings=spec.max_position,
        topk_method="noaux_tc", routed_scaling_factor=spec.routed_scaling, norm_topk_prob=True,
        index_n_heads=spec.index_heads, index_head_dim=spec.index_dim,
        index_topk=spec.index_topk, tie_word_embeddings=False, rope_theta=spec.rope_theta,
        bos_token_id=None, eos_token_id=spec.vocab - 1, pad_token_id=spec.vocab - 1,
        num_nextn_predict_layers=0,
        **spec.extra,
    )
    if spec.index_topk_freq is not None:
        cfg.update(indexer_types=spec.indexer_types(), index_topk_freq=spec.index_topk_freq,
                   index_skip_topk_offset=spec.index_skip_topk_offset)
    return cfg


@dataclass(frozen=True)
class Tensor:
    name: str  # HF name (original checkpoint format: one tensor per expert)
    shape: tuple[int, ...]
    std: float  # random normal; 0.0: the constant ``mean``
    mean: float = 0.0
    # "router_bias": the e_score_correction_bias that balances this layer's
    # random router (weights.router_bias), as aux-loss-free training does
    kind: str = "random"


def hf_tensors(spec: Spec) -> list[Tensor]:
    """Every tensor of the checkpoint with its initialisation: unit-gain
    projections (std 1/sqrt(fan_in)), residual outputs damped by
    (2 layers)^-1/2 (activations stay O(1): no fp16 overflow), norms 1, a
    random router (logits ~N(0, 1)) whose correction bias balances the
    expert load, as the bias of a model trained aux-loss-free does
    (weights.router_bias)."""
    s = spec
    damp = (2 * s.layers) ** -0.5

    def lin(name: str, out: int, inp: int, gain: float = 1.0) -> Tensor:
        return Tensor(name, (out, inp), gain / inp**0.5)

    def const(name: str, n: int, value: float) -> Tensor:
        return Tensor(name, (n,), 0.0, value)

    out = [Tensor("model.embed_tokens.weight", (s.vocab, s.hidden), 1.0)]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out += [
            const(p + "input_layernorm.weight", s.hidden, 1.0),
            const(p + "post_attention_layernorm.weight", s.hidden, 1.0),
            lin(a + "q_a_proj.weight", s.q_lora, s.hidden),
            const(a + "q_a_layernorm.weight", s.q_lora, 1.0),
            lin(a + "q_b_proj.weight", s.heads * (s.qk_nope + s.qk_rope), s.q_lora),
            lin(a + "kv_a_proj_with_mqa.weight", s.kv_lora + s.qk_rope, s.hidden),
            const(a + "kv_a_layernorm.weight", s.kv_lora, 1.0),
            lin(a + "kv_b_proj.weight", s.heads * (s.qk_nope + s.v_head), s.kv_lora),
            lin(a + "o_proj.weight", s.hidden, s.heads * s.v_head, damp),
        ]
        if s.has_indexer(i):
            x = a + "indexer."
            out += [
                lin(x + "wq_b.weight", s.index_heads * s.index_dim, s.q_lora),
                lin(x + "wk.weight", s.index_dim, s.hidden),
                const(x + "k_norm.weight", s.index_dim, 1.0),
                const(x + "k_norm.bias", s.index_dim, 0.0),
                lin(x + "weights_proj.weight", s.index_heads, s.hidden),
            ]
        m = p + "mlp."
        if i < s.dense_layers:
            out += [
                lin(m + "gate_proj.weight", s.intermediate, s.hidden),
                lin(m + "up_proj.weight", s.intermediate, s.hidden),
                lin(m + "down_proj.weight", s.hidden, s.intermediate, damp),
            ]
            continue
        out += [
            lin(m + "gate.weight", s.experts, s.hidden),
            Tensor(m + "gate.e_score_correction_bias", (s.experts,), 0.0, kind="router_bias"),
        ]
        for e in range(s.experts):
            ep = f"{m}experts.{e}."
            out += [
                lin(ep + "gate_proj.weight", s.moe_intermediate, s.hidden),
                lin(ep + "up_proj.weight", s.moe_intermediate, s.hidden),
                lin(ep + "down_proj.weight", s.hidden, s.moe_intermediate, damp),
            ]
        sh = s.moe_intermediate * s.shared_experts
        out += [
            lin(m + "shared_experts.gate_proj.weight", sh, s.hidden),
            lin(m + "shared_experts.up_proj.weight", sh, s.hidden),
            lin(m + "shared_experts.down_proj.weight", s.hidden, sh, damp),
        ]
    out += [
        const("model.norm.weight", s.hidden, 1.0),
        # logits a few nats apart (not flat)
        Tensor("lm_head.weight", (s.vocab, s.hidden), 4.0 / s.hidden**0.5),
    ]
    return out


def parameter_count(spec: Spec) -> int:
    n = 0
    for t in hf_tensors(spec):
        k = 1
        for d in t.shape:
            k *= d
        n += k
    return n


# ---------------------------------------------------------------------------
# GGUF side: what llama.cpp's converter must write (ggml order: ne0 first)
# ---------------------------------------------------------------------------


def gguf_shapes(spec: Spec) -> dict[str, tuple[int, ...]]:
    s = spec
    sh = s.moe_intermediate * s.shared_experts
    out = {
        "token_embd.weight": (s.hidden, s.vocab),
        "output_norm.weight": (s.hidden,),
        "output.weight": (s.hidden, s.vocab),
    }
    for i in range(s.layers):
        b = f"blk.{i}."
        out.update({
            b + "attn_norm.weight": (s.hidden,),
            b + "ffn_norm.weight": (s.hidden,),
            b + "attn_q_a.weight": (s.hidden, s.q_lora),
            b + "attn_q_a_norm.weight": (s.q_lora,),
            b + "attn_q_b.weight": (s.q_lora, s.heads * (s.qk_nope + s.qk_rope)),
            b + "attn_kv_a_mqa.weight": (s.hidden, s.kv_lora + s.qk_rope),
            b + "attn_kv_a_norm.weight": (s.kv_lora,),
            # kv_b_proj split per head; k_b transposed (MLA absorption)
            b + "attn_k_b.weight": (s.qk_nope, s.kv_lora, s.heads),
            b + "attn_v_b.weight": (s.kv_lora, s.v_head, s.heads),
            b + "attn_output.weight": (s.heads * s.v_head, s.hidden),
        })
        if s.has_indexer(i):
            out.update({
                b + "indexer.attn_q_b.weight": (s.q_lora, s.index_heads * s.index_dim),
                b + "indexer.attn_k.weight": (s.hidden, s.index_dim),
                b + "indexer.k_norm.weight": (s.index_dim,),
                b + "indexer.k_norm.bias": (s.index_dim,),
                b + "indexer.proj.weight": (s.hidden, s.index_heads),
            })
        if i < s.dense_layers:
            out.update({
                b + "ffn_gate.weight": (s.hidden, s.intermediate),
                b + "ffn_up.weight": (s.hidden, s.intermediate),
                b + "ffn_down.weight": (s.intermediate, s.hidden),
            })
        else:
            out.update({
                b + "ffn_gate_inp.weight": (s.hidden, s.experts),
                b + "exp_probs_b.bias": (s.experts,),
                b + "ffn_gate_exps.weight": (s.hidden, s.moe_intermediate, s.experts),
                b + "ffn_up_exps.weight": (s.hidden, s.moe_intermediate, s.experts),
                b + "ffn_down_exps.weight": (s.moe_intermediate, s.hidden, s.experts),
                b + "ffn_gate_shexp.weight": (s.hidden, sh),
                b + "ffn_up_shexp.weight": (s.hidden, sh),
                b + "ffn_down_shexp.weight": (sh, s.hidden),
            })
    return out


def gguf_metadata(spec: Spec) -> dict[str, object]:
    """Metadata keys the converter must write, with their values."""
    a, s = spec.gguf_arch, spec
    md = {
        "general.architecture": a,
        f"{a}.block_count": s.layers,
        f"{a}.embedding_length": s.hidden,
        f"{a}.feed_forward_length": s.intermediate,
        f"{a}.expert_feed_forward_length": s.moe_intermediate,
        f"{a}.attention.head_count": s.heads,
        f"{a}.attention.q_lora_rank": s.q_lora,
        f"{a}.attention.kv_lora_rank": s.kv_lora,
        f"{a}.expert_count": s.experts,
        f"{a}.expert_used_count": s.experts_used,
        f"{a}.expert_shared_count": s.shared_experts,
        f"{a}.leading_dense_block_count": s.dense_layers,
        f"{a}.attention.indexer.head_count": s.index_heads,
        f"{a}.attention.indexer.key_length": s.index_dim,
        f"{a}.attention.indexer.top_k": s.index_topk,
        f"{a}.vocab_size": s.vocab,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.eos_token_id": s.vocab - 1,
    }
    return md


# ---------------------------------------------------------------------------
# GGUF types: what users serve
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GgufType:
    name: str
    # "convert": written by the converter; else the quantizer's ftype
    # (llama_cpp.LLAMA_FTYPE_MOSTLY_<ftype>) from the F16 file
    ftype: str
    # per-tensor overrides (llama-quantize --tensor-type PATTERN=TYPE):
    # (regex searched in the tensor name, ggml type), first match wins
    overrides: tuple[tuple[str, str], ...] = ()
    about: str = ""

    @property
    def needs_imatrix(self) -> bool:
        return any(t.upper().startswith(("IQ1", "IQ2", "IQ3_XXS")) for _, t in self.overrides)


# Attention (MLA, indexer) and the shared expert at Q8_0/Q6_K, routed
# experts at 2 bits: the shape of the popular "dynamic" low-bit files.
_MIX_REST = (
    (r"\.attn_", "Q8_0"),
    (r"\.indexer\.", "Q8_0"),
    (r"_shexp\.", "Q6_K"),
    (r"\.ffn_(gate|up|down)\.", "Q6_K"),
)

TYPES: dict[str, GgufType] = {
    t.name: t
    for t in [
        GgufType("f16", "convert", about="converter --outtype f16"),
        GgufType("q8_0", "Q8_0", about="llama-quantize Q8_0"),
        GgufType("q4_k_m", "Q4_K_M", about="llama-quantize Q4_K_M"),
        GgufType(
            "mix-iq2_xxs", "Q6_K",
            overrides=((r"\.ffn_(gate|up|down)_exps\.", "IQ2_XXS"), *_MIX_REST),
            about="routed experts IQ2_XXS (uniform importance matrix), attention and "
                  "indexer Q8_0, shared expert and dense MLP Q6_K, rest Q6_K",
        ),
        GgufType(
            "mix-q2_k", "Q6_K",
            overrides=((r"\.ffn_(gate|up|down)_exps\.", "Q2_K"), *_MIX_REST),
            about="routed experts Q2_K, attention and indexer Q8_0, shared expert and "
                  "dense MLP Q6_K, rest Q6_K",
        ),
    ]
}


def expected_type(gtype: GgufType, tensor: str) -> str | None:
    """The ggml type an override names for ``tensor`` (None: the
    quantizer's own choice for the ftype)."""
    for pattern, t in gtype.overrides:
        if re.search(pattern, tensor):
            return t
    return None
