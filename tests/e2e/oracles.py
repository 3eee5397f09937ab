"""The independent oracles the engine is checked against.

- transformers in fp32 on the same weights: the model is built from the
  checkpoint's config, and every parameter is replaced by the GGUF file's
  tensor, dequantized by gguf-py (so a Q4_K_M file is compared with a
  model that has exactly its rounded weights);
- llama.cpp on the same GGUF file (llama-cpp-python, CPU).

Both give teacher-forced log-probabilities: row i is the distribution of
the token after tokens[: i + 1].

transformers selects the sparse-attention keys from fp32 index scores;
vLLM's indexer (upstream's and the series') scores fp8 copies of the
indexer's q and k. Where that rounding moves a key that matters across the
top-k boundary, the two selections give different outputs and both are
right. fp8_index_scores() runs transformers with vLLM's rounding of the
index scores' operands.

Likewise the MoE routers: where a token's k-th and (k+1)-th experts score
within ROUTER_TIE of each other in fp32, rounding upstream of the router
(8-bit activations in GGUF kernels, fp16 or bf16) decides which one runs,
and both outputs are right. routed() runs transformers with chosen ones of
those near-ties taken the other way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

# GGUF tensor (within blk.N.) -> transformers parameter (within model.layers.N.)
_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight",
    "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file (of every shard, for a split set's first),
    dequantized to float32, in numpy order (the reverse of GGUF's ne order,
    i.e. the checkpoint's shape)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from models import shards

    out = {}
    for t in (t for f in shards(path) for t in GGUFReader(f).tensors):
        data = dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out[t.name] = np.array(data, dtype=np.float32).reshape(shape)  # writable copy
    return out


def hf_state_from_gguf(path: Path, config) -> dict[str, torch.Tensor]:
    """The transformers model's parameters (in-memory names) from a GGUF file
    written by llama.cpp's converter; the NextN block (blk.<layers>) is left
    out, transformers does not model it."""
    tensors = gguf_tensors(path)
    n_layers = config.num_hidden_layers
    state: dict[str, torch.Tensor] = {}
    pending: dict[int, dict[str, np.ndarray]] = {}
    for name, value in tensors.items():
        if name in _GLOBAL_MAP:
            state[_GLOBAL_MAP[name]] = torch.from_numpy(value)
            continue
        _, layer, rest = name.split(".", 2)
        layer = int(layer)
        if layer >= n_layers:
            continue
        prefix = f"model.layers.{layer}."
        if rest in _LAYER_MAP:
            state[prefix + _LAYER_MAP[rest]] = torch.from_numpy(value)
        elif rest in ("attn_k_b.weight", "attn_v_b.weight",
                      "ffn_gate_exps.weight", "ffn_up_exps.weight"):
            pending.setdefault(layer, {})[rest] = value
        else:
            raise KeyError(f"{path.name}: no transformers parameter for GGUF tensor {name}")
    for layer, parts in pending.items():
        prefix = f"model.layers.{layer}."
        if "attn_k_b.weight" in parts:
            # k_b [H, kv_lora, nope] (transposed nope rows), v_b [H, v, kv_lora]
            k_b = torch.from_numpy(parts["attn_k_b.weight"]).transpose(1, 2)
            v_b = torch.from_numpy(parts["attn_v_b.weight"])
            kv_b = torch.cat([k_b, v_b], dim=1).reshape(-1, k_b.shape[-1])
            state[prefix + "self_attn.kv_b_proj.weight"] = kv_b
        if "ffn_gate_exps.weight" in parts:
            gate = torch.from_numpy(parts["ffn_gate_exps.weight"])
            up = torch.from_numpy(parts["ffn_up_exps.weight"])
            state[prefix + "mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
    return state


def transformers_class(hf_dir: Path):
    """transformers' own model class for a checkpoint, by its architecture
    (not through the Auto registries, where vLLM registers config classes
    of its own for some of these model types)."""
    import json

    import transformers

    architecture = json.loads((hf_dir / "config.json").read_text())["architectures"][0]
    return getattr(transformers, architecture)


def transformers_model(hf_dir: Path, gguf_path: Path, device: str = "cpu"):
    """transformers in fp32 (eager attention) with the GGUF file's weights."""
    model_class = transformers_class(hf_dir)
    config = model_class.config_class.from_pretrained(hf_dir)
    config._attn_implementation = "eager"
    model = model_class(config).to(torch.float32)
    state = hf_state_from_gguf(gguf_path, config)
    expected = model.state_dict()  # parameters and persistent buffers
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise KeyError(
            f"{gguf_path.name}: parameters missing {missing[:8]}, unexpected {extra[:8]}"
        )
    for name, param in expected.items():
        if tuple(param.shape) != tuple(state[name].shape):
            raise ValueError(f"{gguf_path.name}: {name} is {tuple(state[name].shape)}, "
                             f"the model expects {tuple(param.shape)}")
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device).eval()


# vLLM's indexer: q and k in fp8 e4m3 with a power-of-two ("ue8m0") scale per
# 128 elements of each token's vector (of each head's, for q)
FP8_BLOCK = 128
_FP8_MAX = 448.0


def fp8_round(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x as vLLM's indexer stores it: fp8 e4m3 in blocks of FP8_BLOCK along
    dim, each with the power of two >= its amax / 448 as scale; returned
    dequantized, in x's dtype."""
    if x.shape[dim] % FP8_BLOCK:
        raise ValueError(f"fp8_round: dimension {dim} of {tuple(x.shape)} is not a multiple "
                         f"of {FP8_BLOCK}")
    moved = x.movedim(dim, -1).float()
    blocks = moved.reshape(*moved.shape[:-1], -1, FP8_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-10)
    scale = torch.exp2(torch.ceil(torch.log2(amax / _FP8_MAX)))
    rounded = (blocks / scale).to(torch.float8_e4m3fn).float() * scale
    return rounded.reshape(moved.shape).movedim(-1, dim).to(x.dtype)


class _Fp8IndexScores(torch.overrides.TorchFunctionMode):
    """Within one forward of a transformers DSA indexer: its first matmul,
    the index scores q [B, S, H, D] @ k^T [B, 1, D, T], on fp8_round() copies
    of q and k."""

    def __init__(self):
        super().__init__()
        self.done = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.matmul and not self.done:
            self.done = True
            q, kt = args
            if q.ndim != 4 or kt.ndim != 4 or q.shape[-1] != kt.shape[-2]:
                raise RuntimeError(
                    "fp8_index_scores: the indexer's first matmul is not q [B, S, H, D] @ "
                    f"k^T [B, 1, D, T] ({tuple(q.shape)} @ {tuple(kt.shape)}): transformers' "
                    "indexer changed")
            args = (fp8_round(q, -1), fp8_round(kt, -2))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fp8_index_scores(model):
    """While active, every DSA indexer of a transformers model scores keys as
    vLLM's does (fp8_round() q and k; the rest of its arithmetic in fp32)."""
    indexers = [m for m in model.modules() if type(m).__name__.endswith("Indexer")]
    if not indexers:
        raise ValueError(f"{type(model).__name__} has no DSA indexer")

    def scored_in_fp8(forward):
        def run(*args, **kwargs):
            with _Fp8IndexScores():
                return forward(*args, **kwargs)
        return run

    for ix in indexers:
        ix.forward = scored_in_fp8(ix.forward)
    try:
        yield model
    finally:
        for ix in indexers:
            del ix.forward  # the class's own again


# Sigmoid router scores of two experts this close are a near-tie: the
# engine's rounding upstream of the router moves scores by up to ~0.004 (GLM-5
# IQ4_XS, 2026-12-02: upstream's bf16 path and the fp16 one each took the
# other expert at margins of 0.0006-0.0035 in fp32, at different steps).
ROUTER_TIE = 0.005


def moe_routers(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("TopkRouter")]


def route(router, hidden_states: torch.Tensor, flip: torch.Tensor):
    """A DeepSeek-style top-k router's forward (GLM-5, GLM-5.2 and
    DeepSeek-V3.2 share it in transformers: sigmoid scores, correction bias
    for the choice, group-limited top-k), with the k-th and (k+1)-th expert
    of the rows in flip swapped; also each row's margin between them.
    Returns (router logits, top-k weights, top-k experts, margin)."""
    h = hidden_states.reshape(-1, router.hidden_dim).float()
    logits = torch.nn.functional.linear(h, router.weight.float())
    scores = logits.sigmoid()
    choice = scores + router.e_score_correction_bias
    per_group = router.num_experts // router.num_group
    grouped = choice.view(-1, router.num_group, per_group)
    groups = grouped.topk(2, dim=-1).values.sum(-1).topk(router.topk_group, dim=-1).indices
    keep = torch.zeros_like(grouped[..., 0]).scatter_(1, groups, 1).bool()
    choice = choice.masked_fill(~keep.repeat_interleave(per_group, 1), float("-inf"))
    ranked = choice.sort(-1, descending=True)
    k = router.top_k
    margin = ranked.values[:, k - 1] - ranked.values[:, k]
    experts = ranked.indices[:, :k].clone()
    experts[flip, k - 1] = ranked.indices[flip, k]
    weights = scores.gather(1, experts)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return logits, weights * router.routed_scaling_factor, experts, margin


class Routing:
    """While active (routed()): every MoE router of a transformers model
    routes as route() does, taking the other expert at the (router, row)
    pairs in flips (rows: positions in the sequence; a forward over a cache
    starts at row offset); after each forward, margins[i] holds router i's
    margin per row of the sequence (when record is on)."""

    def __init__(self, n: int):
        self.flips: set[tuple[int, int]] = set()
        self.margins: list[torch.Tensor | None] = [None] * n
        self.record = True
        self.offset = 0


@contextlib.contextmanager
def routed(model):
    routers = moe_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE router")
    state = Routing(len(routers))

    def routing(i, router):
        def run(hidden_states):
            rows = hidden_states.reshape(-1, router.hidden_dim).shape[0]
            flip = torch.zeros(rows, dtype=torch.bool, device=hidden_states.device)
            for j, row in state.flips:
                if j == i and 0 <= row - state.offset < rows:
                    flip[row - state.offset] = True
            logits, weights, experts, margin = route(router, hidden_states, flip)
            if state.record:
                before = state.margins[i][: state.offset] if state.offset else margin[:0]
                state.margins[i] = torch.cat([before, margin])
            return logits, weights, experts
        return run

    for i, router in enumerate(routers):
        router.forward = routing(i, router)
    try:
        yield state
    finally:
        for router in routers:
            del router.forward  # the class's own again


@torch.no_grad()
def mtp_reference(hf_dir: Path) -> Callable[[list[int]], torch.Tensor]:
    """fp32 reference of the checkpoint's NextN (MTP) block as vLLM's DeepSeek
    MTP drafter runs it, loaded once: a function of the tokens whose row i is
    its logits for tokens[i + 2], from the target's final (normed) hidden
    state at i and the embedding of tokens[i + 1]. transformers does not
    model the block; the checkpoint stores it as layer num_hidden_layers (an
    ordinary decoder layer) plus eh_proj, enorm, hnorm and shared_head.norm."""
    from safetensors.torch import load_file

    model_class = transformers_class(hf_dir)
    config = model_class.config_class.from_pretrained(hf_dir)
    n = config.num_hidden_layers
    target = model_class.from_pretrained(hf_dir, dtype=torch.float32,
                                         attn_implementation="eager").eval()
    # The block as one more layer (per-layer lists extended), then alone.
    fields = {k: v + v[-1:] if isinstance(v, list) and len(v) == n else v
              for k, v in config.to_dict().items()}
    if fields.get("indexer_types"):
        # GLM-5.2: the block has its own indexer (vLLM: a layer past
        # indexer_types is a full one), whatever the last layer's type
        fields["indexer_types"][n] = "full"
    block = model_class.from_pretrained(
        hf_dir, config=model_class.config_class(**{**fields, "num_hidden_layers": n + 1}),
        dtype=torch.float32, attn_implementation="eager").eval()
    block.model.layers = torch.nn.ModuleList([block.model.layers[n]])
    for key, value in list(vars(block.config).items()):
        if isinstance(value, list) and len(value) == n + 1:
            setattr(block.config, key, value[n:])
    block.config.num_hidden_layers = 1
    state = load_file(hf_dir / "model.safetensors")

    def w(name: str) -> torch.Tensor:
        return state[f"model.layers.{n}.{name}"]

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * weight

    block.model.norm.weight.copy_(w("shared_head.norm.weight"))

    @torch.no_grad()
    def logits(tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens])
        hidden = target.model(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
        embeds = target.model.embed_tokens(ids)[0, 1:]
        x = torch.cat([rms(embeds, w("enorm.weight")), rms(hidden, w("hnorm.weight"))],
                      dim=-1)
        return block(inputs_embeds=(x @ w("eh_proj.weight").T)[None],
                     use_cache=False).logits[0]

    return logits


@torch.no_grad()
def fp32_greedy(hf_dir: Path, prompts: list[list[int]], n: int,
                device: str = "cpu") -> list[list[int]]:
    """The checkpoint's own greedy continuation (n tokens) of each prompt, in
    fp32 (on device where it has a GPU): the text every engine path decodes
    when its decode steps are compared on one text (forced_tokens.py)."""
    if device == "cuda" and not torch.cuda.is_available():
        device = "cpu"
    model_class = transformers_class(hf_dir)
    model = model_class.from_pretrained(hf_dir, dtype=torch.float32,
                                        attn_implementation="eager").to(device).eval()
    return greedy(model, prompts, n)


@torch.no_grad()
def greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """A transformers model's greedy continuation (n tokens) of each prompt."""
    device = next(model.parameters()).device
    out = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(n):
            logits = model(input_ids=torch.tensor([seq], device=device), use_cache=False).logits
            seq.append(int(logits[0, -1].argmax()))
        out.append(seq[len(prompt):])
    return out


@torch.no_grad()
def transformers_logprobs(model, tokens: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    ids = torch.tensor([tokens], device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0].float()
    return torch.log_softmax(logits, dim=-1).cpu()


def generated_logprobs(logprobs: torch.Tensor, prompt_len: int,
                       generated: list[int]) -> torch.Tensor:
    """The oracle's log-probability of each generated token on the engine's own
    prefix; logprobs: the oracle's over prompt + generated."""
    lp = logprobs[prompt_len - 1 : prompt_len - 1 + len(generated)]
    return lp.gather(1, torch.tensor(generated)[:, None])[:, 0]


def greedy_gaps(logprobs: torch.Tensor, prompt_len: int, generated: list[int]) -> torch.Tensor:
    """How far (nats) each generated token is below the oracle's top-1 at its
    position; logprobs: the oracle's over prompt + generated. 0 where the
    engine chose the oracle's top-1."""
    top1 = logprobs[prompt_len - 1 : prompt_len - 1 + len(generated)].max(-1).values
    return top1 - generated_logprobs(logprobs, prompt_len, generated)


def llama_cpp_logprobs(gguf_path: Path, tokens: list[int], threads: int = 4) -> torch.Tensor:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf_path), n_ctx=max(512, len(tokens) + 8), logits_all=True,
                n_threads=threads, n_gpu_layers=0, verbose=False, seed=0)
    llm.eval(tokens)
    scores = torch.from_numpy(np.array(llm.scores[: len(tokens)], dtype=np.float32))
    llm.close()
    return torch.log_softmax(scores, dim=-1)
