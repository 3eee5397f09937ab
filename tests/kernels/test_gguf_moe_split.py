# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GGUF routed experts whose gate and up experts have different GGUF types
(the split path, gguf_split_moe.py): the gate and up GEMMs run once per
half, each with its type, then SiLU(gate) * up and the down projection with
its own type; judged against the fp64 reference of the dequantized weights.

CPU: vLLM's own _fused_moe_gguf_split with CPU stand-ins for the CUDA ops
(tests/support/gguf_moe_ref.py: exact in fp64 from gguf-py's dequantize,
poisoned rows, recorded kernel choice), against the reference and against
upstream's fused path where gate and up share a type; the method's load-time
checks.
GPU (`-m gpu`): the real ggml_moe_a8 (MMQ) and ggml_moe_a8_vec kernels and
the series' Triton vector kernel (imatrix types), in float16 and
bfloat16, for one token (vector kernels) and a prefill-sized batch (MMQ
where the type has it, a vector kernel for IQ types).
"""

from __future__ import annotations

import functools
import re
from types import SimpleNamespace

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from support.gguf_moe_ref import (
    MMQ_TYPES,
    VEC_FLOAT_ACTIVATIONS,
    CpuGgufMoeOps,
    dequantize,
    moe_reference,
    random_blocks,
)

E, HIDDEN, INTER, TOP_K = 8, 512, 256, 3
# (gate, up, down) GGUF types: K-quants, IQ types (no MMQ kernel) and the
# legacy types on each side.
SPLIT_TYPES = [
    ("Q4_K", "Q6_K", "Q8_0"),
    ("IQ4_XS", "Q5_K", "Q4_K"),
    ("Q8_0", "IQ3_S", "Q6_K"),
    ("Q2_K", "Q3_K", "IQ4_XS"),
    ("Q4_0", "IQ2_XXS", "Q5_0"),
]
# 1 and 5 tokens: vector kernels; 8 and 100: MMQ for the types that have it
# (gguf_dispatch.moe_mmq_min_tokens()).
TOKENS = [1, 5, 8, 100]
# The stand-ins compute in fp64 and round where a kernel writes (gate, up,
# activation, down, router weight, sum): a few roundings of the dtype.
CPU_TOL = {torch.float32: 1e-6, torch.float16: 4e-3, torch.bfloat16: 3e-2}
Q8_STEP_TOL = 4e-3


@functools.cache
def experts(types: tuple[str, str, str]) -> tuple[list, list]:
    """Random experts of the given (gate, up, down) types, on the CPU: raw
    [w1, w3, w2] and their fp64 values [gate, up, down]."""
    g = torch.Generator().manual_seed(sum(map(ord, "".join(types))))
    shapes = [(E, INTER, HIDDEN), (E, INTER, HIDDEN), (E, HIDDEN, INTER)]
    blocks = [random_blocks(t, s, g) for t, s in zip(types, shapes, strict=True)]
    return [r for r, _ in blocks], [v for _, v in blocks]


def batch(tokens, dtype, seed, device="cpu"):
    """x, topk_weights, topk_ids of a routed batch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)])
    topk_weights = torch.rand(tokens, TOP_K, generator=g) + 0.1
    return x.to(device), topk_weights.to(device), topk_ids.to(torch.int32).to(device)


def layer_case(types, tokens, dtype, seed, device="cpu"):
    raw, values = experts(types)
    return ([r.to(device) for r in raw], [v.to(device) for v in values],
            *batch(tokens, dtype, seed, device))


def cpu_kernels(monkeypatch, raw, types):
    """The CPU stand-ins, told the values of the given blocks (the rest
    they dequantize as they come)."""
    kernels = CpuGgufMoeOps().install(monkeypatch)
    for r, v, t in zip(raw, experts(types)[1], types, strict=True):
        kernels.known[(r.data_ptr(), int(QType[t]))] = v
    return kernels


def qtypes(types):
    return [int(QType[t]) for t in types]


def expected_kernels(types, tokens):
    """MMQ from its threshold where the type has it, else a vector kernel:
    the series' Triton one where gguf_moe_vec.takes the batch, else
    ggml's."""
    from vllm.model_executor.layers.quantization import gguf_moe_vec
    from vllm.model_executor.layers.quantization.gguf_dispatch import moe_mmq_min_tokens

    def kernel(t, k):
        if tokens >= moe_mmq_min_tokens() and t in MMQ_TYPES:
            return "mmq"
        if gguf_moe_vec.takes(QType[t], k, tokens):
            return "vec_triton"
        return "vec"

    return [(kernel(t, k), t) for t, k in zip(types, (HIDDEN, HIDDEN, INTER), strict=True)]


def split(raw, x, topk_weights, topk_ids, types, op=False):
    """The split path; `op`: through its registered custom op (the way
    GGUFSplitMoEMethod.apply calls it: on CUDA, where it is registered)."""
    from vllm.model_executor.layers.quantization import gguf_split_moe

    fn = gguf_split_moe.fused_moe_gguf_split if op else gguf_split_moe._fused_moe_gguf_split
    return fn(x, *raw, topk_weights, topk_ids, *qtypes(types), "silu")


def assert_close_to(out, ref, tol, what):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in the output"
    err = (out.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= tol * scale, f"{what}: max |err| {err:.3g} > {tol} * {scale:.3g}"


def test_reference_values_come_from_the_blocks():
    """random_blocks' values are gguf-py's dequantization of its bytes."""
    raw, values = random_blocks("Q6_K", (2, 4, 512), torch.Generator().manual_seed(0))
    assert torch.equal(dequantize(raw, "Q6_K"), values)
    assert 0.5 < values.square().mean().sqrt().item() * 512**0.5 < 2


@pytest.mark.parametrize("dtype", list(CPU_TOL), ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("types", SPLIT_TYPES, ids="-".join)
def test_split_path_matches_the_fp64_reference(types, tokens, dtype, monkeypatch):
    """Each half with its own type and kernel; SiLU of the gate times the
    up; the down projection with its type; router weights and the sum."""
    raw, values, x, topk_weights, topk_ids = layer_case(types, tokens, dtype, seed=tokens)
    kernels = cpu_kernels(monkeypatch, raw, types)
    out = split(raw, x, topk_weights, topk_ids, types)
    assert out.dtype == dtype
    expected = expected_kernels(types, tokens)
    assert kernels.calls == expected
    # gguf_moe_vec reads q8 activations (IQ4_XS its own): the reference
    # too; the down projection's input, computed here in fp64, can round
    # to a neighbouring q8 step: a step of one value, within Q8_STEP_TOL
    q8 = tuple(k == "vec_triton" and t not in VEC_FLOAT_ACTIVATIONS for k, t in expected)
    ref = moe_reference(x, *values, topk_weights, topk_ids, q8=q8)
    tol = max(CPU_TOL[dtype], Q8_STEP_TOL) if q8[2] else CPU_TOL[dtype]
    assert_close_to(out, ref, tol, f"{types} x {tokens} {dtype}")


def test_swapped_halves_are_caught(monkeypatch):
    """The reference tells gate from up: the same layer with the two
    halves exchanged is far off it (what the split path must not do)."""
    types = ("Q4_K", "Q6_K", "Q8_0")
    raw, values, x, topk_weights, topk_ids = layer_case(types, 5, torch.float32, seed=7)
    cpu_kernels(monkeypatch, raw, types)
    swapped = split([raw[1], raw[0], raw[2]], x, topk_weights, topk_ids,
                    (types[1], types[0], types[2]))
    ref = moe_reference(x, *values, topk_weights, topk_ids)
    err = (swapped.double() - ref).abs().max() / ref.abs().max()
    assert err > 0.1, f"swapped halves within {err:.3g} of the reference"


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize(
    "types", [("Q4_K", "Q4_K", "Q6_K"), ("IQ4_XS", "IQ4_XS", "Q8_0"), ("Q5_K", "Q5_K", "IQ3_S")],
    ids="-".join,
)
def test_split_path_of_one_type_equals_upstreams_fused_path(types, tokens, monkeypatch):
    """Where gate and up share a type the split path computes what
    upstream's _fused_moe_gguf computes from the fused w13 (those layers
    keep GGUFMoEMethod; this holds the split path to its semantics)."""
    from vllm.model_executor.layers.quantization.gguf import _fused_moe_gguf

    raw, _, x, topk_weights, topk_ids = layer_case(types, tokens, torch.float16, seed=11)
    cpu_kernels(monkeypatch, raw, types)
    out = split(raw, x, topk_weights, topk_ids, types)
    w13 = torch.cat(raw[:2], dim=1)
    gate_up_type, _, down_type = qtypes(types)
    fused = _fused_moe_gguf(x, w13, raw[2], topk_weights, topk_ids, gate_up_type, down_type,
                            "silu")
    assert not torch.isnan(out).any()
    assert torch.equal(out, fused)


def _loaded_layer(types, rows_bytes=None):
    """A RoutedExperts stand-in holding loaded halves of the given types
    (w1, w3) as GGUFSplitMoEMethod.process_weights_after_loading sees it."""
    from torch.nn import Parameter

    layer = SimpleNamespace(layer_name="model.layers.1.mlp.experts")
    for half, type_name in zip(("w1", "w3"), types, strict=True):
        block, size = gguf.GGML_QUANT_SIZES[QType[type_name]]
        width = (rows_bytes or {}).get(half, HIDDEN // block * size)
        qweight = Parameter(torch.zeros(E, INTER, width, dtype=torch.uint8), requires_grad=False)
        qweight.tensor_shape = (E, INTER, HIDDEN)
        qweight_type = SimpleNamespace(weight_type=int(QType[type_name]))
        setattr(layer, f"{half}_qweight", qweight)
        setattr(layer, f"{half}_qweight_type", qweight_type)
    return layer


def _method():
    from vllm.model_executor.layers.quantization.gguf import GGUFConfig
    from vllm.model_executor.layers.quantization.gguf_split_moe import GGUFSplitMoEMethod

    return GGUFSplitMoEMethod(GGUFConfig(), SimpleNamespace(is_act_and_mul=True))


def test_loaded_halves_pass_the_checks():
    _method().process_weights_after_loading(_loaded_layer(("Q4_K", "Q6_K")))


@pytest.mark.parametrize(
    "types, rows_bytes, message",
    [
        (("Q4_K", "Q6_K"), {"w3": 288},
         "up experts of GGUF type Q6_K hold 288 bytes per row, Q6_K rows of 512 values take 420"),
        (("MXFP4", "Q6_K"), {"w1": 272},
         "gate experts of GGUF type MXFP4 have no GGUF MoE kernel"),
    ],
    ids=["bytes", "no-kernel"],
)
def test_loaded_halves_that_cannot_run_are_named(types, rows_bytes, message):
    """A half whose bytes do not fit its type (a type applied to the other
    half's data) or of a type without a kernel fails before any forward,
    naming the layer, the half and the type."""
    message = re.escape(f"model.layers.1.mlp.experts: {message}")
    with pytest.raises(ValueError, match=message):
        _method().process_weights_after_loading(_loaded_layer(types, rows_bytes))


# ---------------------------------------------------------------------------
# GPU: the real kernels
# ---------------------------------------------------------------------------

GPU_TYPES = [("Q4_K", "Q6_K", "Q8_0"), ("IQ4_XS", "Q6_K", "Q8_0"), ("Q6_K", "IQ4_XS", "Q8_0"),
             ("IQ2_XXS", "IQ3_XXS", "Q4_K")]
# (max |err| / max |ref|, relative norm of the error). The kernels quantize
# their inputs (x, then the activation) to q8_1: 32-value blocks scaled by
# amax/127. Emulating that (and the dtype's rounding of each stage) on the
# CPU for these cases gave at most 0.018 and 0.014 in either dtype.
GPU_TOL = (5e-2, 3e-2)


class _KernelSpy:
    """Records which real kernel ran for which type."""

    def __init__(self, monkeypatch):
        from vllm import _custom_ops as ops

        self.calls: list[tuple[str, str]] = []
        from vllm.model_executor.layers.quantization import gguf_moe_vec

        for module, name, kind, type_arg in (
            (ops, "ggml_moe_a8", "mmq", 5),
            (ops, "ggml_moe_a8_vec", "vec", 4),
            (gguf_moe_vec, "moe_vec", "vec_triton", 4),
        ):
            real = getattr(module, name)
            monkeypatch.setattr(module, name, self._wrap(real, kind, type_arg))

    def _wrap(self, real, kind, type_arg):
        def kernel(*args):
            self.calls.append((kind, QType(args[type_arg]).name))
            return real(*args)

        return kernel


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 32, 100])
@pytest.mark.parametrize("types", GPU_TYPES, ids="-".join)
def test_split_path_on_the_gpu(types, tokens, dtype, monkeypatch):
    """The real kernels: vector ones for one token, MMQ for a prefill-sized
    batch where the type has it (the IQ half keeps the vector kernel)."""
    spy = _KernelSpy(monkeypatch)
    raw, values, x, topk_weights, topk_ids = layer_case(
        types, tokens, dtype, seed=tokens, device="cuda"
    )
    out = split(raw, x, topk_weights, topk_ids, types, op=True)
    torch.cuda.synchronize()
    assert spy.calls == expected_kernels(types, tokens)
    ref = moe_reference(x, *values, topk_weights, topk_ids)
    max_tol, rel_tol = GPU_TOL
    assert_close_to(out, ref, max_tol, f"{types} x {tokens} {dtype}")
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < rel_tol, f"{types} x {tokens} {dtype}: relative error {rel:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 32, 100])
@pytest.mark.parametrize(
    "types", [("Q4_K", "Q4_K", "Q8_0"), ("IQ4_XS", "IQ4_XS", "IQ4_XS")], ids="-".join
)
def test_split_path_of_one_type_equals_upstreams_fused_path_on_the_gpu(types, tokens, dtype):
    """Gate and up of one type: the split path runs, row for row, the
    kernels upstream's fused w13 GEMM runs (the types keep both paths on
    the same kernels), so the results agree to within two ulps of the
    largest output (equal bits expected)."""
    from vllm.model_executor.layers.quantization.gguf import _fused_moe_gguf

    raw, _, x, topk_weights, topk_ids = layer_case(types, tokens, dtype, seed=3, device="cuda")
    out = split(raw, x, topk_weights, topk_ids, types, op=True)
    gate_up_type, _, down_type = qtypes(types)
    fused = _fused_moe_gguf(x, torch.cat(raw[:2], dim=1), raw[2], topk_weights, topk_ids,
                            gate_up_type, down_type, "silu")
    assert not torch.isnan(out).any()
    scale = fused.double().abs().max().item()
    torch.testing.assert_close(out.double(), fused.double(), rtol=0,
                               atol=2 * torch.finfo(dtype).eps * scale)

