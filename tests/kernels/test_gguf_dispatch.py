# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which kernels a GGUF batch runs (gguf_dispatch.py): routed experts take
ggml's MMQ kernel from a few tokens where the type has one; from a batch
size on, a GGUF linear layer dequantizes its weight and runs torch.matmul,
and the routed experts dequantize (a group of experts at a time when they
are large) and run vLLM's Triton fused MoE.

CPU: which path a batch takes (thresholds, types, a linear's size,
VLLM_GGUF_KERNELS=upstream,
and =fused: gguf_fused_moe's kernel where it decodes the types; which
linears a CUDA graph being captured dequantizes; which routed experts of
decode batches take gguf_moe_vec's Triton vector kernel, in a graph too),
and the expert groups: CPU stand-ins for ggml_dequantize (gguf-py) and
fused_experts (fp64, honouring expert_map), with gguf_dequant's Triton
kernel for Q8_0, Q4_K and Q6_K in the interpreter, show that every expert is
dequantized once, its tokens computed by its own group only, and the sum
equal to the fp64 reference, for one group, several and one expert a group.
GPU (`-m gpu`): the real kernels through the registered ops, in fp16 and
bf16, against the fp64 reference of the same blocks: tighter than ggml's
kernels (which quantize the activations to 8 bits); a linear op captured in
a CUDA graph, with and without a run outside one first, replayed; a fused
linear layer's shards of one type as one weight against shard by shard.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from support.gguf_layers import gguf_layer
from support.gguf_moe_ref import (
    VEC_FLOAT_ACTIVATIONS,
    CpuGgufMoeOps,
    dequantize,
    moe_reference,
    moe_vec_reference,
    q8_activations,
    random_blocks,
)

E, HIDDEN, INTER, TOP_K = 8, 512, 256, 3

# the types gguf_dequant's Triton kernel writes (ggml_dequantize the others)
TRITON_DEQUANT_TYPES = ("Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_XXS",
                        "IQ2_XXS")


def _module():
    from vllm.model_executor.layers.quantization import gguf_dispatch

    return gguf_dispatch


def experts(types, seed=0, device="cpu"):
    """(raw [w1, w3, w2], fp64 values [gate, up, down]) of random experts."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(E, INTER, HIDDEN), (E, INTER, HIDDEN), (E, HIDDEN, INTER)]
    blocks = [random_blocks(t, s, g) for t, s in zip(types, shapes, strict=True)]
    return [r.to(device) for r, _ in blocks], [v.to(device) for _, v in blocks]


def batch(tokens, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    topk_ids = torch.rand(tokens, E, generator=g).argsort(-1)[:, :TOP_K]
    topk_weights = torch.rand(tokens, TOP_K, generator=g) + 0.1
    return x.to(device), topk_weights.to(device), topk_ids.to(torch.int32).to(device)


def assert_close_to(out, ref, tol, what):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}"
    assert torch.isfinite(out).all(), f"{what}: NaN or Inf in the output"
    err = (out.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= tol * scale, f"{what}: max |err| {err:.3g} > {tol} * {scale:.3g}"


# ---------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------


class CpuFloatKernels:
    """ggml_dequantize (gguf-py, rounded to the asked dtype) and
    fused_experts (fp64 from its float weights, honouring expert_map and
    global_num_experts, rounded to x's dtype) on the CPU; records the rows
    gguf_dispatch dequantizes (``dequantized``, whichever kernel does it),
    those ggml_dequantize writes (``ggml``) and each fused_experts call's
    local experts. Q8_0, Q4_K and Q6_K run gguf_dequant's Triton kernel in
    the interpreter."""

    def __init__(self):
        self.dequantized: list[tuple[str, int]] = []
        self.ggml: list[tuple[str, int]] = []
        self.groups: list[list[int]] = []

    def install(self, monkeypatch):
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers import fused_moe
        from vllm.model_executor.layers.quantization import gguf_dispatch

        real = gguf_dispatch.dequantize

        def recorded(qweight, qtype, dtype):
            self.dequantized.append((QType(qtype).name, qweight.numel() // qweight.shape[-1]))
            return real(qweight, qtype, dtype)

        monkeypatch.setattr(gguf_dispatch, "dequantize", recorded)
        monkeypatch.setattr(ops, "ggml_dequantize", self.ggml_dequantize)
        monkeypatch.setattr(fused_moe, "fused_experts", self.fused_experts)
        return self

    def ggml_dequantize(self, w, qtype, m, n, dtype):
        assert w.dtype == torch.uint8 and w.dim() == 2 and w.shape[0] == m
        name = QType(qtype).name
        self.ggml.append((name, m))
        out = dequantize(w, name)
        assert out.shape == (m, n)
        return out.to(dtype)

    def fused_experts(self, x, w1, w2, topk_weights, topk_ids, activation=None,
                      global_num_experts=-1, expert_map=None, **kwargs):
        assert not kwargs, kwargs
        assert w1.dtype == w2.dtype == x.dtype
        local = topk_ids.long()
        if expert_map is not None:
            assert global_num_experts == expert_map.numel()
            local = expert_map.long()[local]
        self.groups.append(sorted(set(local[local >= 0].tolist())))
        keep = local >= 0
        # tokens of other groups: weight 0, any valid local expert
        ids = torch.where(keep, local, 0)
        weights = torch.where(keep, topk_weights, 0)
        inter = w1.shape[1] // 2
        out = moe_reference(x, w1[:, :inter], w1[:, inter:], w2, weights, ids)
        return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("group", [E, 3, 1], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "IQ4_XS", "IQ3_S")],
                         ids="-".join)
def test_grouped_experts_match_the_fp64_reference(types, group, dtype, monkeypatch):
    """Every expert dequantized once; each group's fused MoE sees only its
    experts; gate and up of different types concatenate into [gate | up];
    the groups sum to the reference."""
    mod = _module()
    kernels = CpuFloatKernels().install(monkeypatch)
    per_expert = (2 * INTER + INTER) * HIDDEN * torch.finfo(dtype).bits // 8
    monkeypatch.setattr(mod, "MOE_DEQUANT_BYTES", group * per_expert)
    raw, values = experts(types)
    x, topk_weights, topk_ids = batch(40, dtype, seed=group)
    halves = ([(raw[0], int(QType[types[0]])), (raw[1], int(QType[types[1]]))]
              if types[0] != types[1] else
              [(torch.cat(raw[:2], dim=1), int(QType[types[0]]))])
    out = mod.moe_dequant(x, halves, raw[2], int(QType[types[2]]), topk_weights, topk_ids,
                          "silu")
    assert out.dtype == dtype
    ref = moe_reference(x, *values, topk_weights, topk_ids)
    assert_close_to(out, ref, {torch.float32: 1e-6, torch.float16: 4e-3}[dtype],
                    f"{types} group {group}")
    # one fused MoE per group, the groups disjoint and together all experts
    # that have tokens
    assert len(kernels.groups) == -(-E // group)
    covered = [lo + e for lo, g in zip(range(0, E, group), kernels.groups) for e in g]
    assert sorted(covered) == sorted(set(topk_ids.flatten().tolist()))
    rows = sum(m for _, m in kernels.dequantized)
    assert rows == E * (2 * INTER + HIDDEN)
    # gguf_dequant's types through it, the other types through ggml
    assert {t for t, _ in kernels.ggml} == set(types) - set(TRITON_DEQUANT_TYPES)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q3_K", "Q5_K", "IQ2_XXS", "IQ3_S", "Q5_0"])
def test_dequantize_takes_the_triton_kernel_for_its_types(qtype, monkeypatch):
    """gguf_dispatch.dequantize: gguf_dequant's kernel for the types it
    writes, ggml_dequantize for the rest; gguf-py's values either way."""
    from vllm.model_executor.layers.quantization import gguf_dequant

    mod = _module()
    kernels = CpuFloatKernels().install(monkeypatch)
    triton_calls = []
    real = gguf_dequant.dequantize
    monkeypatch.setattr(gguf_dequant, "dequantize",
                        lambda *a, **k: triton_calls.append(1) or real(*a, **k))
    raw, values = random_blocks(qtype, (2, 3, 512), torch.Generator().manual_seed(2))
    out = mod.dequantize(raw, int(QType[qtype]), torch.float32)
    assert torch.equal(out.double(), values)
    takes_triton = qtype in TRITON_DEQUANT_TYPES
    assert bool(triton_calls) == takes_triton and bool(kernels.ggml) != takes_triton


def test_a_fused_moe_ignoring_the_groups_is_caught(monkeypatch):
    """The check above can fail: a fused MoE that reads global expert ids
    as its group's local ones computes the wrong experts."""
    mod = _module()
    kernels = CpuFloatKernels().install(monkeypatch)
    real = kernels.fused_experts

    def ignores_map(x, w1, w2, topk_weights, topk_ids, global_num_experts=-1,
                    expert_map=None, **kwargs):
        return real(x, w1, w2, topk_weights, topk_ids % w1.shape[0], **kwargs)

    from vllm.model_executor.layers import fused_moe

    monkeypatch.setattr(fused_moe, "fused_experts", ignores_map)
    monkeypatch.setattr(mod, "MOE_DEQUANT_BYTES", 4 * 3 * INTER * HIDDEN * 4)
    raw, values = experts(("Q4_K", "Q4_K", "Q6_K"))
    x, topk_weights, topk_ids = batch(40, torch.float32, seed=1)
    out = mod.moe_dequant(x, [(torch.cat(raw[:2], dim=1), int(QType.Q4_K))], raw[2],
                          int(QType.Q6_K), topk_weights, topk_ids, "silu")
    ref = moe_reference(x, *values, topk_weights, topk_ids)
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err > 0.1, f"a fused MoE ignoring the groups within {err:.3g} of the reference"


def test_which_batches_dequantize(monkeypatch):
    mod = _module()
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    dense, moe = mod.DENSE_DEQUANT_MIN_TOKENS, mod.MOE_DEQUANT_MIN_TOKENS
    vec = mod.MOE_DEQUANT_MIN_TOKENS_VEC
    assert vec < moe
    q4k, q6k, iq2, f16 = (int(QType.Q4_K), int(QType.Q6_K), int(QType.IQ2_XXS),
                          int(QType.F16))
    assert mod.use_dense_dequant(dense, q4k) and mod.use_dense_dequant(dense, iq2)
    assert not mod.use_dense_dequant(dense - 1, q4k)
    assert not mod.use_dense_dequant(dense, f16)  # float weights need no dequantize
    # types with ggml's MMQ kernel keep it up to MOE_DEQUANT_MIN_TOKENS
    assert mod.use_moe_dequant(moe, q4k, q6k) and not mod.use_moe_dequant(moe - 1, q4k, q6k)
    # a type with only the vector kernel (in any half) dequantizes from the lower bound
    assert mod.use_moe_dequant(vec, iq2, iq2) and mod.use_moe_dequant(vec, q4k, iq2, q6k)
    assert not mod.use_moe_dequant(vec - 1, iq2, iq2)
    assert not mod.use_moe_dequant(moe, q4k, int(QType.MXFP4))  # no dequantize kernel
    assert mod.moe_mmq_min_tokens() == mod.MOE_MMQ_MIN_TOKENS < 65
    monkeypatch.setenv("VLLM_GGUF_KERNELS", "upstream")
    assert not mod.use_dense_dequant(10**6, q4k)
    assert not mod.use_moe_dequant(10**6, q4k, q4k)
    assert mod.moe_mmq_min_tokens() == 65  # vLLM 0.23: MMQ above 64 tokens


def _weight(qtype: QType, rows: int, cols: int) -> torch.Tensor:
    """A GGUF weight's blocks as the linear layer holds them, without data."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return torch.empty(rows, cols // block_size * type_size, dtype=torch.uint8, device="meta")


def test_linears_of_gguf_dequant_types_take_the_float_path_from_8_or_9_tokens(monkeypatch):
    """On GPUs where that was measured faster (SM90), weights of
    gguf_dequant's types from DENSE_DEQUANT_SMALL_MIN_TOKENS where ggml's
    MMQ runs few blocks (up to DENSE_SMALL_ROWS rows, however long the
    rows) and for types without MMQ at any size; larger weights of MMQ
    types (an lm_head) from DENSE_DEQUANT_WIDE_MIN_TOKENS, past MMQ's first
    8 tokens; ggml_dequantize's types, calls without the weight and every
    weight on other GPUs (SM120) from DENSE_DEQUANT_MIN_TOKENS; one token
    never."""
    mod = _module()
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    monkeypatch.setattr(mod, "float_measured_faster", lambda: True)
    small, wide = mod.DENSE_DEQUANT_SMALL_MIN_TOKENS, mod.DENSE_DEQUANT_WIDE_MIN_TOKENS
    n = mod.DENSE_DEQUANT_MIN_TOKENS
    assert 1 < small < wide < n
    edge = mod.DENSE_SMALL_ROWS
    for qtype, mmq in ((QType.Q4_K, True), (QType.Q6_K, True), (QType.Q8_0, True),
                       (QType.IQ4_XS, False), (QType.IQ2_XXS, False)):
        for rows, cols, first in ((2048, 6144, small), (edge, 16384, small),
                                  (edge + 1, 2048, wide if mmq else small),
                                  (19360, 6144, wide if mmq else small)):
            w = _weight(qtype, rows, cols)
            assert mod.dense_dequant_min_tokens(int(qtype), w) == first, (qtype, rows)
            assert mod.use_dense_dequant(first, int(qtype), w, torch.float16), (qtype, rows)
            assert not mod.use_dense_dequant(first - 1, int(qtype), w, torch.float16)
        assert mod.dense_dequant_min_tokens(int(qtype)) == n  # no weight to size
    for qtype in (QType.Q5_0, QType.Q4_0):  # ggml_dequantize's types
        for rows in (2048, 19360):
            assert mod.dense_dequant_min_tokens(int(qtype), _weight(qtype, rows, 6144)) == n
    assert not mod.use_dense_dequant(small, int(QType.F16), _weight(QType.F16, 64, 6144))
    monkeypatch.setattr(mod, "float_measured_faster", lambda: False)
    for qtype in (QType.Q4_K, QType.Q8_0, QType.IQ4_XS):
        for rows in (2048, 19360):
            w = _weight(qtype, rows, 6144)
            assert mod.dense_dequant_min_tokens(int(qtype), w) == n, (qtype, rows)
            assert not mod.use_dense_dequant(n - 1, int(qtype), w, torch.float16)
    monkeypatch.setenv("VLLM_GGUF_KERNELS", "upstream")
    assert not mod.use_dense_dequant(n, int(QType.Q4_K), _weight(QType.Q4_K, 64, 6144))


@pytest.mark.parametrize("capability, measured", [((9, 0), True), ((12, 0), False),
                                                  ((8, 9), False), ((10, 0), False),
                                                  (None, False)])
def test_float_paths_lower_thresholds_only_where_measured(capability, measured,
                                                            monkeypatch):
    """SM90 (the H200 measured); SM120 and the others keep the kernels the
    lower thresholds would replace, as does a host without a GPU."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    mod = _module()
    monkeypatch.setattr(current_platform, "get_device_capability", lambda *a: (
        None if capability is None else DeviceCapability(*capability)))
    assert mod.float_measured_faster() is measured


class RecordedGgufMatmul:
    """gguf.py's op on the GGUF blocks, on the CPU: the fp64 product of
    gguf-py's values in x's dtype; records each call's tokens."""

    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, x, qweight, qweight_type):
        self.calls.append(x.shape[0])
        values = dequantize(qweight, QType(qweight_type).name)
        return (x.double() @ values.T).to(x.dtype)


@pytest.mark.parametrize("qtype", ["Q6_K", "Q4_K", "Q8_0", "IQ4_XS", "Q5_0"])
@pytest.mark.parametrize("measured", [True, False], ids=["sm90", "elsewhere"])
def test_a_quantized_lm_head_runs_its_float_weight_where_the_float_path_would(
        qtype, measured, monkeypatch):
    """0037: kept from load, the values the float path dequantized (gguf-py's,
    rounded once to the model's dtype), run from DENSE_DEQUANT_SMALL_MIN_TOKENS
    on SM90 and DENSE_DEQUANT_MIN_TOKENS elsewhere; below, the GGUF blocks
    on gguf.py's kernels; the bias added either way."""
    from vllm.model_executor.layers.quantization import gguf as gguf_quant
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    mod = _module()
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    monkeypatch.delenv("VLLM_GGUF_LM_HEAD_FLOAT", raising=False)
    monkeypatch.setattr(mod, "float_measured_faster", lambda: measured)
    g = torch.Generator().manual_seed(37)
    raw, values = random_blocks(qtype, (96, HIDDEN), g)
    CpuFloatKernels().install(monkeypatch)  # ggml_dequantize's types (Q5_0)
    head = gguf_layer([(qtype, raw)], cls=ParallelLMHead, embedding=True)
    kept = head.gguf_float_weight
    assert kept.dtype == torch.float16 and kept.shape == (96, HIDDEN)
    torch.testing.assert_close(kept.double(), values.half().double(), rtol=1e-3, atol=1e-6)
    first = mod.DENSE_DEQUANT_SMALL_MIN_TOKENS if measured else mod.DENSE_DEQUANT_MIN_TOKENS
    assert head.gguf_float_min_tokens == first
    blocks = RecordedGgufMatmul()
    monkeypatch.setattr(gguf_quant, "fused_mul_mat_gguf", blocks)
    bias = torch.randn(96, generator=g).half()
    for tokens in (1, first - 1, first, 40):
        blocks.calls.clear()
        x = torch.randn(tokens, HIDDEN, generator=g).half()
        out = head.quant_method.apply(head, x, bias=bias)
        assert blocks.calls == ([] if tokens >= first else [tokens]), tokens
        want = x.double() @ values.T + bias.double()
        assert_close_to(out, want, 2e-3, f"{qtype} at {tokens} tokens")


@pytest.mark.parametrize("case", ["token embedding", "F16 lm_head", "upstream's choice",
                                  "switched off"])
def test_what_keeps_no_float_weight(case, monkeypatch):
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    g = torch.Generator().manual_seed(3)
    raw, _ = random_blocks("Q4_K", (64, HIDDEN), g)
    shards, cls = [("Q4_K", raw)], ParallelLMHead
    if case == "token embedding":
        cls = VocabParallelEmbedding
    elif case == "F16 lm_head":
        shards = [("F16", torch.randn(64, HIDDEN, generator=g).half())]
    elif case == "switched off":
        monkeypatch.setenv("VLLM_GGUF_LM_HEAD_FLOAT", "0")
    else:
        monkeypatch.setenv("VLLM_GGUF_KERNELS", "upstream")
    layer = gguf_layer(shards, cls=cls, embedding=True)
    assert not hasattr(layer, "gguf_float_weight")
    if case == "switched off":
        # the switch is the lm_head's: every GGUF linear still takes the float path
        mod = _module()
        assert mod.use_dense_dequant(mod.DENSE_DEQUANT_MIN_TOKENS, int(QType.Q4_K))


def test_linears_in_a_graph_being_captured_need_a_run_outside_one(monkeypatch):
    """Capturing a CUDA graph, a linear layer takes the float path only for a
    weight (type, shape, dtype) that ran it outside a graph before, its
    Triton kernel compiled and its tables on the device; the types
    ggml_dequantize writes always (compiled ahead); routed experts never."""
    mod = _module()
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    monkeypatch.setattr(mod, "_DENSE_READY", set())
    capturing = [False]
    monkeypatch.setattr(mod, "_capturing", lambda: capturing[0])
    CpuFloatKernels().install(monkeypatch)
    n, q4k, iq3s = mod.DENSE_DEQUANT_MIN_TOKENS, int(QType.Q4_K), int(QType.IQ3_S)
    raw, values = random_blocks("Q4_K", (64, HIDDEN), torch.Generator().manual_seed(7))
    other, _ = random_blocks("Q4_K", (32, HIDDEN), torch.Generator().manual_seed(8))
    x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(9))
    capturing[0] = True
    assert not mod.use_dense_dequant(n, q4k, raw, torch.float32)
    assert not mod.use_dense_dequant(n, q4k)  # no weight to look up
    assert mod.use_dense_dequant(n, iq3s, other, torch.float32)
    capturing[0] = False
    assert mod.use_dense_dequant(n, q4k, raw, torch.float32)
    assert_close_to(mod.dense_dequant(x, raw, q4k), x.double() @ values.T, 1e-5, "Q4_K")
    capturing[0] = True
    assert mod.use_dense_dequant(n, q4k, raw, torch.float32)
    below = mod.dense_dequant_min_tokens(q4k, raw) - 1
    assert not mod.use_dense_dequant(below, q4k, raw, torch.float32)
    assert not mod.use_dense_dequant(n, q4k, raw, torch.float16)  # another kernel
    assert not mod.use_dense_dequant(n, q4k, other, torch.float32)  # another weight
    mod.dense_dequant(x, other, q4k)  # in a graph: compiles nothing, readies nothing
    assert not mod.use_dense_dequant(n, q4k, other, torch.float32)
    assert not mod.use_moe_dequant(10**6, q4k, q4k)
    capturing[0] = False
    assert mod.use_moe_dequant(10**6, q4k, q4k)


@pytest.mark.parametrize("switch,qtype,k,tokens,kernel", [
    ("series", "IQ2_XXS", 512, 3, "vec_triton"), ("fused", "IQ3_XXS", 256, 3, "vec_triton"),
    ("series", "IQ2_XXS", 768, 3, "vec"), ("ggml", "IQ2_XXS", 256, 3, "vec"),
    ("upstream", "IQ3_XXS", 256, 3, "vec"), ("series", "IQ4_XS", 256, 3, "vec_triton"),
    ("fused", "IQ1_M", 512, 3, "vec_triton"), ("series", "IQ2_S", 768, 3, "vec"),
    ("ggml", "IQ1_S", 256, 3, "vec"), ("series", "Q2_K", 256, 3, "vec"),
    # long rows (LONG_MIN_K, here 1024) of IQ2_XXS and IQ2_XS from 2 tokens
    ("series", "IQ2_XXS", 1024, 2, "vec_triton"), ("fused", "IQ2_XS", 1024, 8, "vec_triton"),
    ("series", "IQ2_XXS", 1024, 1, "vec"), ("series", "IQ2_XXS", 768, 8, "vec"),
    ("series", "IQ1_M", 1024, 8, "vec"), ("ggml", "IQ2_XXS", 1024, 8, "vec")], ids=str)
def test_moe_vec_takes_the_triton_kernel_for_its_types(switch, qtype, k, tokens, kernel,
                                                       monkeypatch):
    """Decode batches of routed experts without MMQ: gguf_moe_vec's kernel
    for the imatrix types' rows of at most its MAX_K (512) values and for
    IQ2_XXS's and IQ2_XS's rows of at least LONG_MIN_K from LONG_MIN_TOKENS
    (VLLM_GGUF_KERNELS series, fused), ggml's vector kernel for other rows,
    the other types and with ggml, upstream; the same product either way."""
    from vllm.model_executor.layers.quantization import gguf_moe_vec

    mod = _module()
    monkeypatch.setenv("VLLM_GGUF_KERNELS", switch)
    monkeypatch.setattr(mod, "_VEC_READY", set())
    monkeypatch.setattr(gguf_moe_vec, "LONG_MIN_K", 1024)  # small rows for the interpreter
    kernels = CpuGgufMoeOps().install(monkeypatch)
    raw, values = random_blocks(qtype, (E, INTER, k), torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, k, generator=g).half()
    topk_ids = torch.rand(tokens, E, generator=g).argsort(-1)[:, :TOP_K].to(torch.int32)
    out = mod.moe_vec(x, raw, topk_ids, TOP_K, int(QType[qtype]), INTER)
    assert kernels.calls == [(kernel, qtype)]
    # the Triton kernel reads q8 activations (IQ4_XS: its own); the CPU
    # stand-in of ggml's, the activations as they are
    xr = q8_activations(x) if kernel == "vec_triton" and qtype not in VEC_FLOAT_ACTIVATIONS else x
    assert_close_to(out, moe_vec_reference(xr, values, topk_ids, TOP_K), 2e-3, qtype)


@pytest.mark.parametrize("types", [("IQ2_XXS", "IQ2_XXS", "IQ2_XXS"),
                                   ("IQ2_XXS", "IQ3_XXS", "IQ1_M")], ids=str)
def test_a_float_path_run_readies_the_vector_kernel_for_graphs_of_its_size(types,
                                                                          monkeypatch):
    """vLLM warms a batch size up outside the graph, then captures it, the
    largest first. A warm-up from MOE_DEQUANT_MIN_TOKENS_VEC takes the float
    path; it readies gguf_moe_vec's kernel for the capture of the same size
    (each projection it takes), so the graph does not keep ggml's."""
    from vllm.model_executor.layers.quantization import gguf_split_moe
    from vllm.model_executor.layers.quantization.gguf import _fused_moe_gguf

    mod = _module()
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    monkeypatch.setattr(mod, "_VEC_READY", set())
    monkeypatch.setattr(mod, "MOE_DEQUANT_MIN_TOKENS_VEC", 12)
    capturing = [False]
    monkeypatch.setattr(mod, "_capturing", lambda: capturing[0])
    kernels = CpuGgufMoeOps().install(monkeypatch)
    floats = CpuFloatKernels().install(monkeypatch)
    raw, _ = experts(types)
    qt = [int(QType[t]) for t in types]
    x, topk_weights, topk_ids = batch(12, torch.float16, seed=3)

    def layer():
        if types[0] == types[1]:
            return _fused_moe_gguf(x, torch.cat(raw[:2], dim=1), raw[2], topk_weights,
                                   topk_ids, qt[0], qt[2], "silu")
        return gguf_split_moe._fused_moe_gguf_split(x, *raw, topk_weights, topk_ids, *qt,
                                                    "silu")

    layer()  # the warm-up: the float path
    assert floats.groups
    kernels.calls.clear()
    capturing[0] = True
    layer()  # the capture: every projection on gguf_moe_vec's kernel
    halves = types if types[0] != types[1] else types[1:]
    assert kernels.calls == [("vec_triton", t) for t in halves]


def test_moe_vec_in_a_graph_being_captured_needs_a_run_outside_one(monkeypatch):
    """Capturing a CUDA graph, the Triton vector kernel runs only for
    calls like one that ran it outside a graph before (experts' type and
    shape, top-k, the activations' dtype, row stride and alignment), its
    kernel compiled and its tables on the device; else ggml's."""
    mod = _module()
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    monkeypatch.setattr(mod, "_VEC_READY", set())
    capturing = [False]
    monkeypatch.setattr(mod, "_capturing", lambda: capturing[0])
    kernels = CpuGgufMoeOps().install(monkeypatch)
    iq2 = int(QType.IQ2_XXS)
    raw, _ = random_blocks("IQ2_XXS", (E, INTER, HIDDEN), torch.Generator().manual_seed(6))
    x, _, topk_ids = batch(2, torch.float16, seed=7)
    capturing[0] = True
    mod.moe_vec(x, raw, topk_ids, TOP_K, iq2, INTER)
    capturing[0] = False
    mod.moe_vec(x, raw, topk_ids, TOP_K, iq2, INTER)
    capturing[0] = True
    mod.moe_vec(x, raw, topk_ids, TOP_K, iq2, INTER)
    mod.moe_vec(x.float(), raw, topk_ids, TOP_K, iq2, INTER)  # another dtype
    mod.moe_vec(x, raw, topk_ids[:, :1].contiguous(), 1, iq2, INTER)  # another top-k
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape)
    shifted.copy_(x)  # another alignment: another compiled kernel
    mod.moe_vec(shifted, raw, topk_ids, TOP_K, iq2, INTER)
    assert [k for k, _ in kernels.calls] == ["vec", "vec_triton", "vec_triton", "vec", "vec",
                                             "vec"]


@pytest.mark.parametrize("switch,types,grouped", [
    ("series", ("IQ2_XXS",) * 3, True), ("fused", ("IQ2_XXS",) * 3, True),
    ("ggml", ("IQ2_XXS",) * 3, False), ("upstream", ("IQ2_XXS",) * 3, False),
    ("series", ("IQ2_XXS", "IQ2_XXS", "IQ3_XXS"), False)], ids=str)
def test_the_moe_op_takes_the_grouped_kernel_between_its_bounds(switch, types, grouped,
                                                                 monkeypatch):
    """_fused_moe_gguf: batches of GEMM_MIN_PAIRS to GEMM_MAX_PAIRS
    token-expert rows (here 12-14 tokens of top-3) of a layer whose experts
    are all of GEMM_TYPES take gguf_moe_vec's grouped kernel for both
    projections, with VLLM_GGUF_KERNELS series and fused; other batches and
    layers the paths they took before. The result is the layer's."""
    from vllm.model_executor.layers.quantization import gguf_moe_vec
    from vllm.model_executor.layers.quantization.gguf import _fused_moe_gguf

    mod = _module()
    monkeypatch.setenv("VLLM_GGUF_KERNELS", switch)
    monkeypatch.setattr(mod, "_VEC_READY", set())
    monkeypatch.setattr(mod, "_GEMM_READY", set())
    monkeypatch.setattr(gguf_moe_vec, "GEMM_MIN_PAIRS", 12 * TOP_K)
    monkeypatch.setattr(gguf_moe_vec, "GEMM_MAX_PAIRS", 14 * TOP_K)
    kernels = CpuGgufMoeOps().install(monkeypatch)
    raw, values = experts(types)
    qt = [int(QType[t]) for t in types]
    for tokens in (11, 12, 14, 15):
        x, topk_weights, topk_ids = batch(tokens, torch.float16, seed=tokens)
        kernels.calls.clear()
        out = _fused_moe_gguf(x, torch.cat(raw[:2], dim=1), raw[2], topk_weights, topk_ids,
                              qt[0], qt[2], "silu")
        took = grouped and 12 <= tokens <= 14
        gemm = [("gemm_triton", types[0]), ("gemm_triton", types[2])]
        assert (kernels.calls == gemm) == took, (tokens, kernels.calls)
        # the grouped kernel and the vector one read q8 activations; ggml's
        # CPU stand-in the activations as they are
        q8 = tuple(took or (switch in ("series", "fused") and gguf_moe_vec.takes(
            QType[t], k, tokens)) for t, k in zip(types, (HIDDEN, HIDDEN, INTER)))
        ref = moe_reference(x, *values, topk_weights, topk_ids, q8=q8)
        # the down projection reads the activation rounded to fp16 and
        # quantized again, the reference its fp64: a byte may round the
        # other way (the vector path on these batches: up to 4.7e-3)
        assert_close_to(out, ref, 6e-3, f"{tokens} tokens")


def test_the_grouped_kernel_in_a_graph_being_captured_needs_a_run_outside_one(monkeypatch):
    """Capturing a CUDA graph, a layer takes the grouped kernel only where
    a batch like it (types, shapes, top-k, dtype, alignment) ran it outside
    a graph before (vLLM warms each size up before capturing it); else the
    vector path, as before."""
    from vllm.model_executor.layers.quantization import gguf_moe_vec
    from vllm.model_executor.layers.quantization.gguf import _fused_moe_gguf

    mod = _module()
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    monkeypatch.setattr(mod, "_VEC_READY", set())
    monkeypatch.setattr(mod, "_GEMM_READY", set())
    monkeypatch.setattr(gguf_moe_vec, "GEMM_MIN_PAIRS", 12 * TOP_K)
    capturing = [False]
    monkeypatch.setattr(mod, "_capturing", lambda: capturing[0])
    kernels = CpuGgufMoeOps().install(monkeypatch)
    raw, _ = experts(("IQ2_XXS",) * 3)
    iq2 = int(QType.IQ2_XXS)
    x, topk_weights, topk_ids = batch(12, torch.float16, seed=3)

    def layer(x=x):
        kernels.calls.clear()
        _fused_moe_gguf(x, torch.cat(raw[:2], dim=1), raw[2], topk_weights, topk_ids, iq2,
                        iq2, "silu")
        return [k for k, _ in kernels.calls]

    capturing[0] = True
    assert "gemm_triton" not in layer()
    capturing[0] = False
    assert layer() == ["gemm_triton"] * 2
    capturing[0] = True
    assert layer() == ["gemm_triton"] * 2
    assert "gemm_triton" not in layer(x.float())  # another dtype: another kernel


@pytest.mark.parametrize("switch", ["series", "ggml", "upstream"])
def test_the_moe_op_takes_the_float_path_from_the_threshold(switch, monkeypatch):
    """_fused_moe_gguf above the threshold: dequantize + fused MoE, no ggml
    GEMM; with VLLM_GGUF_KERNELS=upstream or below it: ggml's kernels.
    VLLM_GGUF_KERNELS=ggml (no Marlin repack) keeps the series' choice."""
    from vllm.model_executor.layers.quantization.gguf import _fused_moe_gguf

    mod = _module()
    monkeypatch.setenv("VLLM_GGUF_KERNELS", switch)
    monkeypatch.setattr(mod, "MOE_DEQUANT_MIN_TOKENS", 20)
    ggml = CpuGgufMoeOps().install(monkeypatch)
    floats = CpuFloatKernels().install(monkeypatch)
    types = ("Q4_K", "Q4_K", "Q6_K")
    raw, values = experts(types)
    w13 = torch.cat(raw[:2], dim=1)
    for tokens in (19, 20):
        x, topk_weights, topk_ids = batch(tokens, torch.float32, seed=tokens)
        ggml.calls.clear()
        floats.groups.clear()
        out = _fused_moe_gguf(x, w13, raw[2], topk_weights, topk_ids, int(QType.Q4_K),
                              int(QType.Q6_K), "silu")
        assert_close_to(out, moe_reference(x, *values, topk_weights, topk_ids), 1e-6,
                        f"{tokens} tokens")
        float_path = switch != "upstream" and tokens >= 20
        assert bool(floats.groups) == float_path and bool(ggml.calls) != float_path


@pytest.mark.parametrize("types,fused", [(("Q4_K", "Q4_K", "Q6_K"), True),
                                         (("IQ2_XXS", "IQ2_XXS", "IQ3_XXS"), True),
                                         (("Q5_K", "Q5_K", "Q6_K"), False),
                                         (("Q4_K", "Q6_K", "Q6_K"), False)], ids=str)
def test_the_fused_switch_runs_it_where_the_float_path_would(types, fused, monkeypatch):
    """VLLM_GGUF_KERNELS=fused: at the float path's threshold the MoE op
    (the split op where gate and up differ) runs the fused kernel where it
    decodes every type and gate and up share one, else the float path; below
    the threshold ggml's kernels as before. The result is the layer's."""
    from vllm.model_executor.layers.quantization import (
        gguf_fused_moe,
        gguf_moe_vec,
        gguf_split_moe,
    )
    from vllm.model_executor.layers.quantization.gguf import _fused_moe_gguf

    gguf_dispatch, module = _module(), gguf_fused_moe
    calls = []
    real = module.fused_moe
    monkeypatch.setattr(module, "fused_moe", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("VLLM_GGUF_KERNELS", "fused")
    monkeypatch.setattr(gguf_dispatch, "MOE_DEQUANT_MIN_TOKENS", 12)
    monkeypatch.setattr(gguf_dispatch, "MOE_DEQUANT_MIN_TOKENS_VEC", 12)
    CpuGgufMoeOps().install(monkeypatch)
    floats = CpuFloatKernels().install(monkeypatch)
    raw, values = experts(types)
    qt = [int(QType[t]) for t in types]
    for tokens in (11, 12):
        x, topk_weights, topk_ids = batch(tokens, torch.float16, seed=tokens)
        calls.clear()
        floats.groups.clear()
        if types[0] == types[1]:
            out = _fused_moe_gguf(x, torch.cat(raw[:2], dim=1), raw[2], topk_weights,
                                  topk_ids, qt[0], qt[2], "silu")
        else:
            out = gguf_split_moe.fused_moe_gguf_split(x, *raw, topk_weights, topk_ids, *qt,
                                                      "silu")
        # below the threshold gguf_moe_vec takes the IQ halves, on q8
        # activations (the reference too)
        q8 = tuple(tokens < 12 and gguf_moe_vec.takes(QType[t], k, tokens)
                   and t not in VEC_FLOAT_ACTIVATIONS
                   for t, k in zip(types, (HIDDEN, HIDDEN, INTER), strict=True))
        ref = moe_reference(x, *values, topk_weights, topk_ids, q8=q8)
        assert torch.isfinite(out).all()
        err = (out.double() - ref).abs().max().item()
        assert err <= 4e-3 * ref.abs().max().item(), (tokens, err)
        assert bool(calls) == (fused and tokens >= 12)
        assert bool(floats.groups) == (not fused and tokens >= 12)


# ---------------------------------------------------------------------------
# GPU: the real kernels
# ---------------------------------------------------------------------------

# fp16 / bf16 weights and activations, fp32 accumulation: a few roundings of
# the dtype (max |err| / max |ref|)
GPU_TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(GPU_TOL), ids=str)
@pytest.mark.parametrize("group", [E, 3], ids=lambda g: f"group{g}")
@pytest.mark.parametrize(
    "types", [("Q4_K", "Q4_K", "Q6_K"), ("IQ2_XXS", "IQ2_XXS", "IQ4_XS"),
              ("Q8_0", "Q8_0", "Q8_0"), ("IQ4_XS", "Q6_K", "Q5_K")], ids="-".join)
def test_moe_float_path_on_the_gpu(types, group, dtype, monkeypatch):
    """The registered op at the threshold: ggml_dequantize and the Triton
    fused MoE (the split op where gate and up differ) against fp64."""
    from vllm.model_executor.layers.quantization import gguf_split_moe
    from vllm.model_executor.layers.quantization.gguf import fused_moe_gguf

    mod = _module()
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    per_expert = 3 * INTER * HIDDEN * 2
    monkeypatch.setattr(mod, "MOE_DEQUANT_BYTES", group * per_expert)
    raw, values = experts(types, device="cuda")
    x, topk_weights, topk_ids = batch(mod.MOE_DEQUANT_MIN_TOKENS, dtype, seed=5, device="cuda")
    qt = [int(QType[t]) for t in types]
    if types[0] == types[1]:
        out = fused_moe_gguf(x, torch.cat(raw[:2], dim=1), raw[2], topk_weights, topk_ids,
                             qt[0], qt[2], "silu")
    else:
        out = gguf_split_moe.fused_moe_gguf_split(x, *raw, topk_weights, topk_ids, *qt, "silu")
    torch.cuda.synchronize()
    ref = moe_reference(x, *values, topk_weights, topk_ids)
    assert_close_to(out, ref, GPU_TOL[dtype], f"{types} {dtype} group {group}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(GPU_TOL), ids=str)
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "IQ4_XS", "IQ2_XXS"])
def test_linear_float_path_on_the_gpu(qtype, dtype, monkeypatch):
    from vllm.model_executor.layers.quantization.gguf import fused_mul_mat_gguf

    mod = _module()
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    raw, values = random_blocks(qtype, (768, HIDDEN), torch.Generator().manual_seed(3))
    x = torch.randn(mod.DENSE_DEQUANT_MIN_TOKENS, HIDDEN,
                    generator=torch.Generator().manual_seed(4)).to(dtype)
    out = fused_mul_mat_gguf(x.cuda(), raw.cuda(), int(QType[qtype]))
    torch.cuda.synchronize()
    assert out.dtype == dtype and out.shape == (x.shape[0], 768)
    assert_close_to(out.cpu(), x.double() @ values.T, GPU_TOL[dtype], f"{qtype} {dtype}")


# ggml's MMQ quantizes the activations to 8 bits per 32 values
GGML_TOL = 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("threshold", ["DENSE_DEQUANT_SMALL_MIN_TOKENS",
                                       "DENSE_DEQUANT_WIDE_MIN_TOKENS",
                                       "DENSE_DEQUANT_MIN_TOKENS"])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
def test_linear_float_path_in_a_cuda_graph(qtype, threshold, monkeypatch):
    """A decode batch of each threshold captured in a CUDA graph (SM90's
    thresholds on any GPU): a weight that never ran outside a graph is
    captured with ggml's MMQ; one that did, with the float path (no MMQ
    launched while capturing). Both graphs' replays on new inputs match
    fp64."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.gguf import fused_mul_mat_gguf

    mod = _module()
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    monkeypatch.setattr(mod, "float_measured_faster", lambda: True)
    monkeypatch.setattr(mod, "_DENSE_READY", set())
    mmq, real_mmq = [], ops.ggml_mul_mat_a8
    monkeypatch.setattr(ops, "ggml_mul_mat_a8", lambda *a: mmq.append(1) or real_mmq(*a))
    raw, values = random_blocks(qtype, (768, HIDDEN), torch.Generator().manual_seed(3))
    w, qt, n = raw.cuda(), int(QType[qtype]), getattr(mod, threshold)
    g = torch.Generator().manual_seed(4)

    def fresh() -> torch.Tensor:
        return torch.randn(n, HIDDEN, generator=g).to(torch.float16).cuda()

    def capture() -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        x = fresh()
        graph = torch.cuda.CUDAGraph()
        mmq.clear()
        with torch.cuda.graph(graph):
            out = fused_mul_mat_gguf(x, w, qt)
        return graph, x, out

    ggml_graph, ggml_x, ggml_out = capture()
    assert mmq, "a weight that never ran outside a graph: ggml's MMQ"
    fused_mul_mat_gguf(fresh(), w, qt)  # outside a graph: the float path
    torch.cuda.synchronize()
    float_graph, float_x, float_out = capture()
    assert not mmq, "MMQ launched in the graph after the float path ran outside one"
    for _ in range(2):
        x = fresh()
        ggml_x.copy_(x)
        float_x.copy_(x)
        ggml_graph.replay()
        float_graph.replay()
        torch.cuda.synchronize()
        ref = x.cpu().double() @ values.T
        assert_close_to(float_out.cpu(), ref, GPU_TOL[torch.float16], f"{qtype} float path")
        assert_close_to(ggml_out.cpu(), ref, GGML_TOL, f"{qtype} MMQ")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 8, 16, 32])
@pytest.mark.parametrize("types", [("Q4_K", "Q4_K"), ("Q6_K", "Q6_K"), ("Q8_0", "Q8_0"),
                                   ("Q5_0", "Q5_0"), ("Q4_K", "Q6_K")], ids="-".join)
def test_fused_linear_on_the_gpu(types, tokens, monkeypatch):
    """0035: a fused layer (640 + 192 rows, as q_a + kv_a) through the
    method's apply on the real kernels: shards of one type as one weight,
    equal to the same kernels shard by shard where ggml's kernels run (each
    row its own weight row's product) and within the float path's rounding
    where it runs; both against fp64."""
    from vllm.model_executor.layers.quantization.gguf import fused_mul_mat_gguf

    mod = _module()
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    g = torch.Generator().manual_seed(35)
    blocks = [random_blocks(t, (r, HIDDEN), g) for t, r in zip(types, (640, 192))]
    layer = gguf_layer([(t, raw) for t, (raw, _) in zip(types, blocks)], device="cuda")
    assert layer.qweight.is_cuda
    one_weight = types[0] == types[1]
    assert layer.qweight.fused_type == (int(QType[types[0]]) if one_weight else None)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.float16).cuda()
    out = layer.quant_method.apply(layer, x)
    shard_by_shard = torch.cat(
        [fused_mul_mat_gguf(x, raw.cuda(), int(QType[t])) for t, (raw, _) in zip(types, blocks)],
        dim=1,
    )
    torch.cuda.synchronize()
    ref = x.cpu().double() @ torch.cat([values for _, values in blocks]).T
    float_path = mod.use_dense_dequant(tokens, int(QType[types[0]]), layer.qweight, x.dtype)
    tol = GPU_TOL[torch.float16] if float_path else GGML_TOL
    assert_close_to(out.cpu(), ref, tol, f"{types} at {tokens} tokens")
    assert_close_to(shard_by_shard.cpu(), ref, tol, f"{types} shard by shard")
    if not (one_weight and float_path):
        assert torch.equal(out, shard_by_shard), f"{types} at {tokens} tokens"


@pytest.mark.gpu
@pytest.mark.xfail(strict=True, reason="vLLM 0.23's compiled IQ3_S grid decodes level 15 "
                   "as 15.5 (the table before llama.cpp's IQ3_S change of March 2024)")
def test_iq3_s_dequantize_matches_gguf_py():
    from vllm import _custom_ops as ops

    raw, values = random_blocks("IQ3_S", (64, HIDDEN), torch.Generator().manual_seed(9))
    out = ops.ggml_dequantize(raw.cuda(), int(QType.IQ3_S), 64, HIDDEN, torch.float32)
    torch.testing.assert_close(out.double().cpu(), values, rtol=0, atol=1e-6)
