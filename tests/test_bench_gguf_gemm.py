"""bench/bench_gguf_gemm.py on CPU: its random GGUF blocks decode (llama.cpp's
own numpy dequantizer, gguf-py) to finite weights whose size follows the
block scale it sets, for every type it times."""

from __future__ import annotations

import bench_gguf_gemm as bench
import gguf
import numpy as np
import pytest
import torch

from support.gguf_moe_ref import F16_FIELDS

TYPES = sorted({t for _, a, b in bench.EXPERT_TYPES for t in (a, b) if t is not None}
               | set(bench.DENSE_TYPES), key=lambda t: t.name)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks_have_finite_scaled_weights(qtype):
    gen = torch.Generator().manual_seed(int(qtype))
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    q = bench.random_blocks(qtype, 4, 2 * block, gen, (3,), device="cpu")
    assert q.shape == (3, 4, 2 * gguf.GGML_QUANT_SIZES[qtype][1])
    w = gguf.quants.dequantize(q.numpy().reshape(-1), qtype)
    assert w.size == 3 * 4 * 2 * block
    assert np.isfinite(w).all() and np.abs(w).max() > 0
    # every fp16 block scale is one the bench set: doubling them doubles the weights
    raw = q.numpy().reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1]).copy()
    for off in F16_FIELDS[qtype.name]:
        assert (raw[:, off:off + 2].view(np.float16) == np.float16(0.001)).all()
        raw[:, off:off + 2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    w2 = gguf.quants.dequantize(raw.reshape(-1), qtype)
    np.testing.assert_allclose(w2, 2 * w, rtol=1e-2, atol=1e-7)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks_take_the_rms_asked_for(qtype):
    """With rms=1/sqrt(K) the fp16 reference of a K-long dot product stays
    near 1 (the MoE's fp16 path overflowed with the fixed scale)."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    cols = 24 * block if block == 32 else 3 * block
    q = bench.random_blocks(qtype, 64, cols, torch.Generator().manual_seed(3), device="cpu",
                            rms=cols**-0.5)
    w = gguf.quants.dequantize(q.numpy().reshape(-1), qtype).astype(np.float64)
    assert np.isfinite(w).all()
    assert np.sqrt(np.mean(w * w)) == pytest.approx(cols**-0.5, rel=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_triton_dequantizer_writes_gguf_py_values(qtype, dtype, monkeypatch):
    """The candidate Triton dequantizer (TRITON_INTERPRET=1 on the CPU):
    every value gguf-py's, exact in fp32, rounded once in fp16; 30 blocks
    over programs of 4, so the last program is partial."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import gguf_triton_dequant as tdq

    from support.gguf_moe_ref import random_blocks

    raw, values = random_blocks(qtype, (3, 5, 512), torch.Generator().manual_seed(7))
    out = tdq.dequantize(raw, int(gguf.GGMLQuantizationType[qtype]), dtype, blocks=4)
    assert out.shape == values.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    if dtype == torch.float32:
        assert torch.equal(out.double(), values)
    else:
        torch.testing.assert_close(out.double(), values.half().double(), rtol=0, atol=0)


def test_triton_dequantizer_refuses_partial_blocks():
    import gguf_triton_dequant as tdq

    with pytest.raises(ValueError, match="Q4_K: rows of whole 144-byte blocks expected"):
        tdq.dequantize(torch.zeros(2, 150, dtype=torch.uint8),
                       int(gguf.GGMLQuantizationType.Q4_K), torch.float16)


_AOT_SCRIPT = r"""
import json
import gguf_triton_dequant as tdq
from support.aot import AotKernel, compile_for
out = {}
for qtype, (qk, size) in tdq.LAYOUT.items():
    for ptr in ("*fp16", "*bf16"):
        kernel = AotKernel(
            name=f"{qtype.name}-{ptr[1:]}", fn=tdq._dequant_kernel,
            signature={"src": "*u8", "dst": ptr, "n_blocks": "i32", "QTYPE": "constexpr",
                       "QK": "constexpr", "BYTES": "constexpr", "BLOCKS": "constexpr"},
            constexprs={"QTYPE": int(qtype), "QK": qk, "BYTES": size, "BLOCKS": 4096 // qk},
            options={"num_warps": 4, "num_stages": 1})
        for cap in ((12, 0), (9, 0)):
            out[f"sm{cap[0]}{cap[1]}-{kernel.name}"] = compile_for(kernel, cap).metadata.shared
print(json.dumps(out))
"""


def test_triton_dequantizer_compiles_for_sm120_and_sm90(tmp_path):
    """Every type and output dtype compiles for SM120 (and SM90) within
    SM120's shared memory. A fresh process: the interpreter patches
    triton.language in this one."""
    import os

    from support.aot import SM120_MAX_SHARED_BYTES, run_aot_script

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    shared = run_aot_script(_AOT_SCRIPT, tmp_path, (bench,))
    assert len(shared) == 12
    assert all(0 <= v <= SM120_MAX_SHARED_BYTES for v in shared.values()), shared
