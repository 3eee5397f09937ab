# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Triton dequantizer of the float paths (gguf_dequant.py: Q8_0, the
K-quants, IQ4_XS, IQ3_XXS, IQ2_XXS; gguf_dispatch.dequantize takes it for
those types).

CPU (TRITON_INTERPRET=1): every value gguf-py's, exact in fp32 and rounded
once in fp16, into a NaN-poisoned output, over programs that end
inside the last one; leading dims kept; bad blocks, dtypes and outputs
refused; the kernel compiles for SM120 and SM90 within SM120's shared
memory; the GPU test's bar for ggml fails misread blocks. GPU (`-m gpu`):
gguf-py's values rounded once, and vLLM's ggml_dequantize within that bar.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from support.gguf_moe_ref import dequantize, random_blocks

Q = gguf.GGMLQuantizationType
TYPES = ["Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_XXS", "IQ2_XXS"]


def _module():
    from vllm.model_executor.layers.quantization import gguf_dequant

    return gguf_dequant


# not bf16: the interpreter's fp32 -> bf16 conversion is not round-to-nearest
# (half its values a unit off); bf16 runs on the GPU below
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_writes_gguf_py_values(qtype, dtype):
    """30 blocks a row set over programs of 4 blocks: the last program
    partial; every value written (NaN-poisoned output)."""
    raw, values = random_blocks(qtype, (3, 5, 512), torch.Generator().manual_seed(7))
    out = torch.full(values.shape, float("nan"), dtype=dtype)
    got = _module().dequantize(raw, int(Q[qtype]), dtype, out=out, blocks=4)
    assert got is out and out.dtype == dtype
    assert torch.isfinite(out).all()
    expected = values.to(dtype).double()  # one rounding of ggml's fp32 value
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("qtype", TYPES)
def test_a_row_set_of_any_leading_shape(qtype):
    raw, values = random_blocks(qtype, (2, 3, 4, 256), torch.Generator().manual_seed(3))
    out = _module().dequantize(raw, int(Q[qtype]), torch.float32)
    assert out.shape == values.shape and torch.equal(out.double(), values)
    # a non-contiguous view of the blocks reads the same values
    rows = raw[:, :, ::2]
    assert torch.equal(_module().dequantize(rows, int(Q[qtype]), torch.float32).double(),
                       values[:, :, ::2])


def test_bad_input_is_refused():
    mod = _module()
    q4k = int(Q.Q4_K)
    with pytest.raises(ValueError, match="Q4_K: rows of whole 144-byte blocks expected"):
        mod.dequantize(torch.zeros(2, 150, dtype=torch.uint8), q4k, torch.float16)
    with pytest.raises(ValueError, match="blocks expected, found .* torch.int8"):
        mod.dequantize(torch.zeros(2, 144, dtype=torch.int8), q4k, torch.float16)
    with pytest.raises(ValueError, match=r"out: contiguous \(2, 256\) torch.float16"):
        mod.dequantize(torch.zeros(2, 144, dtype=torch.uint8), q4k, torch.float16,
                       out=torch.empty(2, 256, dtype=torch.float32))
    # IQ3_S stays with ggml's grid (prefill and decode the same), Q5_0 with ggml
    assert not mod.supported(int(Q.IQ3_S)) and not mod.supported(int(Q.Q5_0))
    assert mod.supported(q4k)
    with pytest.raises(ValueError, match="Q5_0: no Triton dequantizer"):
        mod.dequantize(torch.zeros(2, 22, dtype=torch.uint8), int(Q.Q5_0), torch.float16)


_AOT_SCRIPT = r"""
import json
import gguf
from vllm.model_executor.layers.quantization import gguf_dequant as mod
from support.aot import AotKernel, compile_for
out = {}
kernels = []
for qtype in mod.TYPES:
    qk, size = gguf.GGML_QUANT_SIZES[qtype]
    for ptr in ("*fp16", "*bf16"):
        kernels.append(AotKernel(
            name=f"{qtype.name}-{ptr[1:]}", fn=mod._dequantize_kernel,
            signature={"src": "*u8", "dst": ptr, "n_blocks": "i32", "QTYPE": "constexpr",
                       "QK": "constexpr", "BYTES": "constexpr", "BLOCKS": "constexpr"},
            constexprs={"QTYPE": int(qtype), "QK": qk, "BYTES": size,
                        "BLOCKS": mod._VALUES_PER_PROGRAM // qk},
            options={"num_warps": 4, "num_stages": 1}))
for qtype in mod.IQ_TYPES:
    qk, size = gguf.GGML_QUANT_SIZES[qtype]
    for ptr in ("*fp16", "*bf16"):
        kernels.append(AotKernel(
            name=f"{qtype.name}-{ptr[1:]}", fn=mod._dequantize_iq_kernel,
            signature={"src": "*u8", "dst": ptr, "n_blocks": "i32", "grid_ptr": "*fp32",
                       "signs_ptr": "*u8", "QTYPE": "constexpr", "BYTES": "constexpr",
                       "BLOCKS": "constexpr"},
            constexprs={"QTYPE": int(qtype), "BYTES": size,
                        "BLOCKS": mod._VALUES_PER_PROGRAM // qk},
            options={"num_warps": 4, "num_stages": 1}))
for kernel in kernels:
    for cap in ((12, 0), (9, 0)):
        out[f"sm{cap[0]}{cap[1]}-{kernel.name}"] = compile_for(kernel, cap).metadata.shared
print(json.dumps(out))
"""


def test_dequantize_compiles_for_sm120_and_sm90(tmp_path):
    """Every type and output dtype compiles for SM120 (and SM90) within
    SM120's shared memory. A fresh process: the interpreter patches
    triton.language in this one."""
    from support.aot import SM120_MAX_SHARED_BYTES, run_aot_script

    shared = run_aot_script(_AOT_SCRIPT, tmp_path)
    assert len(shared) == 4 * len(TYPES)  # fp16, bf16 on sm_120, sm_90
    assert all(0 <= v <= SM120_MAX_SHARED_BYTES for v in shared.values()), shared


def ggml_decodes(got: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where ``got`` (ggml_dequantize's output, fp64) is the decode of the
    blocks whose exact values are ``values``, as ggml computes it: in half
    precision, so within 2^-8 of each group of 32 values' largest magnitude
    (a unit in the last place of ``dtype`` more)."""
    exact = values.to(dtype).double()
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
    group = exact.abs().view(-1, 32).amax(dim=1, keepdim=True).expand(-1, 32)
    return (got - exact).abs() <= 2.0**-8 * group.reshape(exact.shape) + ulp


# (type, bytes of its quants, bytes of its sub-block scales or None, offset of d)
_LAYOUT = [("Q8_0", (2, 34), None, 0), ("Q4_K", (16, 144), (4, 16), 0),
           ("Q6_K", (0, 128), (192, 208), 208)]


@pytest.mark.parametrize("qtype, quants, subscales, d", _LAYOUT, ids=[t[0] for t in _LAYOUT])
def test_the_ggml_bar_fails_misread_blocks(qtype, quants, subscales, d):
    """The GPU test's bar for ggml holds the exact values and fails blocks
    read wrong (quants in the other nibble or byte order, another block's
    scale, sub-block scales shifted by one) at most of their values."""
    raw, values = random_blocks(qtype, (2, 64, 512), torch.Generator().manual_seed(3))
    per_row = 512 // gguf.GGML_QUANT_SIZES[Q[qtype]][0]
    blocks = raw.view(2, 64, per_row, -1)
    misread = []
    b = blocks.clone()
    lo, hi = quants
    b[..., lo:hi] = (b[..., lo:hi].flip(-1) if qtype == "Q8_0"
                     else (b[..., lo:hi] >> 4) | (b[..., lo:hi] << 4))
    misread.append(b)
    b = blocks.clone()
    b[..., d:d + 2] = blocks.roll(1, dims=2)[..., d:d + 2]
    misread.append(b)
    if subscales:
        b = blocks.clone()
        b[..., subscales[0]:subscales[1]] = blocks[..., subscales[0]:subscales[1]].roll(1, -1)
        misread.append(b)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert ggml_decodes(values.to(dtype).double(), values, dtype).all()
        for b in misread:
            got = dequantize(b.reshape(raw.shape), qtype).to(dtype).double()
            assert (~ggml_decodes(got, values, dtype)).float().mean() > 0.5


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_equals_ggml_on_the_gpu(qtype, dtype):
    """At a TP-8 rank's expert shape: gguf-py's values, rounded once. vLLM's
    ggml_dequantize decodes the same values, but multiplies in half
    precision (in any output dtype; Q4_K's d * q - dmin * m cancels): it is
    held to 2^-8 of the largest magnitude in each group of 32 values, which
    a misread scale or nibble is far outside."""
    from vllm import _custom_ops as ops

    raw, values = random_blocks(qtype, (4, 512, 6144), torch.Generator().manual_seed(11))
    raw = raw.cuda()
    out = torch.full(values.shape, float("nan"), dtype=dtype, device="cuda")
    _module().dequantize(raw, int(Q[qtype]), dtype, out=out)
    ggml = ops.ggml_dequantize(raw.view(4 * 512, -1), int(Q[qtype]), 4 * 512, 6144,
                               dtype).view(values.shape)
    torch.cuda.synchronize()
    out, ggml = out.cpu().double(), ggml.cpu().double()
    assert torch.isfinite(out).all()
    exact = values.to(dtype).double()
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((out - exact).abs() <= ulp).all()
    assert torch.isfinite(ggml).all()
    assert ggml_decodes(ggml, values, dtype).all()
