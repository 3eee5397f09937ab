# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Triton vector kernel for the imatrix types' routed experts of
decode batches (gguf_moe_vec.py), in ggml_moe_a8_vec's contract: row r is
w[topk_ids.flatten()[r]] @ x[r // top_k].

CPU (TRITON_INTERPRET=1, fp16 and fp32): against the fp64 product of
gguf-py's values, the output poisoned with NaN, partial row blocks, rows of
one and of several blocks, top-k 1 (the down projection) and more (gate and
up), rows longer than MAX_K at their tile, the q8 quantizer's bytes
against the reference's, duplicate experts, ids that are no expert
(zeros); its tables are gguf-py's grids and sign masks; bad
input refused; which batches it takes; the kernel compiles for SM120 and
SM90 within SM120's shared memory (where gguf_dispatch takes it:
tests/kernels/test_gguf_dispatch.py). GPU (`-m gpu`): a GLM-5 TP-8 rank's
expert shapes, fp16 and bf16, against fp64 and against ggml's vector
kernel, captured in a CUDA graph and replayed on new routes; the q8
quantizer's bytes against the reference's.

The grouped kernel (moe_gemm, grouped_moe: rows sorted by expert, each
group of weights decoded once for a tile of rows), CPU: every q8 type
against fp64 at several tiles, blocks of no expert, duplicate experts,
the layer; bad input refused; which layers and batches gguf_dispatch
gives it; compiled for SM120 and SM90 without wgmma. GPU: the layer at a
GLM-5 TP-8 and TP-4 rank's widths against fp64 and the vector path, in a
CUDA graph replayed on new routes.
"""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch

from support.gguf_moe_ref import (
    VEC_FLOAT_ACTIVATIONS,
    moe_reference,
    moe_vec_reference,
    q8_activations,
    random_blocks,
)

Q = gguf.GGMLQuantizationType
TYPES = ("IQ2_XXS", "IQ3_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "IQ4_XS")


def _module():
    from vllm.model_executor.layers.quantization import gguf_moe_vec

    return gguf_moe_vec


@pytest.fixture
def vec(monkeypatch):
    module = _module()
    monkeypatch.setattr(module, "_empty",
                        lambda *a, **k: torch.full(a, float("nan"), **k))
    return module


def reference(x, values, topk_ids, top_k, qtype):
    """fp64 of the product the kernel computes: on q8 activations but for
    IQ4_XS."""
    xr = x if qtype in VEC_FLOAT_ACTIVATIONS else q8_activations(x)
    return moe_vec_reference(xr, values, topk_ids, top_k)


def q8_values(xq: torch.Tensor, xd: torch.Tensor, shape) -> torch.Tensor:
    """fp64 of the values _quantize_q8's bytes and scales stand for."""
    rows, k = shape
    q = xq.view(torch.int8).view(rows, k // 32, 32).double()
    return (q * xd.view(rows, k // 32, 1).double()).view(rows, k)


def assert_close(out, ref, tol, what):
    assert out.shape == ref.shape, what
    assert torch.isfinite(out).all(), f"{what}: NaN or inf in the output"
    err = (out.double() - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item(), f"{what}: max |err| {err:.3g}"


# fp32 output: the fp32 sums; fp16: one rounding of the output
CPU_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", list(CPU_TOL), ids=str)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("tokens,top_k,rows,k,block_n", [
    (1, 1, 40, 256, 16),  # the down projection: one block a row, a partial row block
    (3, 3, 24, 768, 16),  # gate and up: rows of three blocks
    (5, 2, 33, 512, 32),  # odd rows, fewer than one row block
    (4, 2, 20, 768, None),  # rows longer than MAX_K: their own tile
])
def test_moe_vec_matches_fp64(vec, qtype, dtype, tokens, top_k, rows, k, block_n):
    experts = 5
    g = torch.Generator().manual_seed(rows + k)
    raw, values = random_blocks(qtype, (experts, rows, k), g)
    x = torch.randn(tokens, k, generator=g).to(dtype)
    topk_ids = torch.rand(tokens, experts, generator=g).argsort(-1)[:, :top_k]
    topk_ids = topk_ids.to(torch.int32)
    out = vec.moe_vec(x, raw, topk_ids, top_k, int(Q[qtype]), rows, block_n=block_n)
    assert out.dtype == dtype
    assert_close(out, reference(x, values, topk_ids, top_k, qtype), CPU_TOL[dtype], qtype)


@pytest.mark.parametrize("dtype", list(CPU_TOL), ids=str)
def test_q8_quantizer_rounds_as_the_reference(dtype):
    """_quantize_q8's bytes and scales are q8_activations' to the bit: both
    divide in IEEE and round twice (the tests' references read q8 through
    q8_activations)."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(64, 512, generator=g) * 0.3).to(dtype)
    xq, xd = _module()._quantize_q8(x)
    differ = (q8_values(xq, xd, x.shape) != q8_activations(x)).sum().item()
    assert differ == 0, f"{differ} of {x.numel()} q8 values differ from the reference"


@pytest.mark.parametrize("qtype", TYPES)
def test_duplicate_experts_and_ids_that_are_no_expert(vec, qtype):
    """An expert named twice gives its product twice; an id outside [0,
    experts) gives zeros (gguf_dispatch's groups map other experts to -1)."""
    experts, rows, k = 4, 24, 256
    g = torch.Generator().manual_seed(2)
    raw, values = random_blocks(qtype, (experts, rows, k), g)
    x = torch.randn(3, k, generator=g).half()
    topk_ids = torch.tensor([[2, 2], [-1, 1], [4, 0]], dtype=torch.int32)
    out = vec.moe_vec(x, raw, topk_ids, 2, int(Q[qtype]), rows, block_n=16)
    ref = reference(x, values, topk_ids, 2, qtype)
    assert_close(out, ref, CPU_TOL[torch.float16], qtype)
    assert torch.equal(out[0], out[1]) and not out[2].any() and not out[4].any()


@pytest.mark.parametrize("qtype", TYPES)
def test_tables_are_gguf_pys_grids_and_signs(qtype):
    """The packed words unpack to gguf-py's grid values (magnitudes 1-127
    where the kernel's sign trick applies them) and the byte masks to the
    sign bits the type reads: ksigns' for a 7-bit index, a byte's own for a
    sign byte; IQ4_XS's table gives each byte its two nibbles' levels."""
    module = _module()
    grid, masks = module._host_tables(Q[qtype])
    if qtype == "IQ4_XS":  # a word a byte: its low nibble's level, its high one's
        levels = np.array(gguf.quants.IQ4_NL.kvalues)
        byte = np.arange(256)
        words = grid.view(np.int8).reshape(256, 4)
        assert np.array_equal(words[:, 0], levels[byte & 15])
        assert np.array_equal(words[:, 1], levels[byte >> 4])
        return
    cls = getattr(gguf.quants, qtype)
    cls.init_grid()
    values = grid.view(np.int8).reshape(cls.grid_shape)
    assert np.array_equal(values, cls.grid.reshape(cls.grid_shape))
    if qtype in ("IQ1_S", "IQ1_M"):
        return
    assert values.min() > 0 and values.max() < 128
    signs = np.arange(256) if qtype == "IQ2_S" else np.frombuffer(
        gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8)
    bits = masks.view(np.uint8).reshape(len(signs), 8) == 0xFF
    assert np.array_equal(bits, (signs[:, None] >> np.arange(8)) & 1 == 1)
    assert np.isin(masks.view(np.uint8), (0, 0xFF)).all()


def test_bad_input_is_refused():
    module = _module()
    iq2 = int(Q.IQ2_XXS)
    g = torch.Generator().manual_seed(0)
    raw, _ = random_blocks("IQ2_XXS", (2, 8, 256), g)
    x = torch.randn(1, 256).half()
    ids = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="Q4_K rows of 256 values: not decoded here"):
        module.moe_vec(x, raw, ids, 1, int(Q.Q4_K), 8)
    with pytest.raises(ValueError, match="IQ2_XXS rows of 384 values"):
        module.moe_vec(torch.randn(1, 384).half(), raw, ids, 1, iq2, 8)
    with pytest.raises(ValueError, match=r"\[experts, 16, 66\] uint8 expected, found \(2, 8, 66\)"):
        module.moe_vec(x, raw, ids, 1, iq2, 16)
    with pytest.raises(ValueError, match="2 expert ids for 1 rows of top-1"):
        module.moe_vec(x, raw, torch.zeros(1, 2, dtype=torch.int32), 1, iq2, 8)
    # columns of a wider tensor: read as it is
    wide = torch.randn(1, 512).half()
    out = module.moe_vec(wide[:, ::2], raw, ids, 1, iq2, 8)
    assert torch.equal(out, module.moe_vec(wide[:, ::2].contiguous(), raw, ids, 1, iq2, 8))
    assert module.supported(iq2, 6144) and not module.supported(iq2, 6100)
    assert not module.supported(int(Q.IQ4_NL), 6144)
    assert not module.supported(int(Q.IQ3_S), 6144)  # loaded as Q6_K (0027)


def test_takes_short_rows_and_the_long_rows_measured_faster():
    """gguf_dispatch's choice: rows of at most MAX_K values at any count;
    IQ2_XXS's and IQ2_XS's rows of 6,144 values and more (GLM-5's and
    DeepSeek-V3.2's hidden sizes) from 2 tokens; nothing else."""
    module = _module()
    iq2, iq2xs, iq3, iq4 = (int(Q[t]) for t in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ4_XS"))
    assert module.takes(iq3, 256, 1) and module.takes(iq4, 512, 256)
    assert not module.takes(iq3, 768, 1)
    for qtype in (iq2, iq2xs):
        assert module.takes(qtype, 6144, 2) and module.takes(qtype, 7168, 32)
        assert not module.takes(qtype, 6144, 1)
        assert not module.takes(qtype, 2048, 32)  # not measured
    for other in ("IQ3_XXS", "IQ2_S", "IQ1_S", "IQ1_M", "IQ4_XS"):
        assert not module.takes(int(Q[other]), 6144, 32), other
    assert not module.takes(int(Q.Q4_K), 256, 1) and not module.takes(iq2, 6100, 32)


# the types the grouped kernel decodes (q8 activations): every one is held
# to fp64 here, whichever GEMM_TYPES gguf_dispatch gives it
GEMM_TEST_TYPES = tuple(t for t in TYPES if t not in VEC_FLOAT_ACTIVATIONS)


def gemm_reference(x, values, topk_ids, x_rows, weights=None):
    """fp64 of moe_gemm's rows, in topk_ids' order: row r is
    values[topk_ids.flatten()[r]] @ q8(x[r // x_rows]), times weights[r]."""
    ref = moe_vec_reference(q8_activations(x), values, topk_ids, x_rows)
    return ref if weights is None else ref * weights.reshape(-1, 1).double()


@pytest.mark.parametrize("dtype", list(CPU_TOL), ids=str)
@pytest.mark.parametrize("qtype", GEMM_TEST_TYPES)
@pytest.mark.parametrize("tokens,top_k,x_rows,rows,k,tile", [
    # gate and up: row r reads x[r // top_k]; rows of 3 blocks, a partial
    # output tile, an expert's rows over two programs
    (7, 3, 3, 40, 768, (16, 16, 4, 8)),
    # the down projection: a row each, times its weight; rows of one block
    (9, 2, 1, 24, 256, (16, 16, 4, 8)),
    # one sub-block a step, wider tiles
    (5, 4, 4, 33, 512, (32, 32, 4, 1)),
], ids=str)
def test_moe_gemm_matches_fp64(vec, qtype, dtype, tokens, top_k, x_rows, rows, k, tile):
    experts = 4
    g = torch.Generator().manual_seed(rows + k)
    raw, values = random_blocks(qtype, (experts, rows, k), g)
    x = torch.randn(tokens * top_k // x_rows, k, generator=g).to(dtype)
    topk_ids = torch.randint(0, experts, (tokens, top_k), generator=g, dtype=torch.int32)
    weights = torch.rand(tokens, top_k, generator=g) if x_rows == 1 else None
    aligned = vec.align(topk_ids, tile[0], experts)
    out = vec.moe_gemm(x, raw, int(Q[qtype]), rows, *aligned, x_rows, weights, tile=tile)
    assert out.dtype == dtype
    ref = gemm_reference(x, values, topk_ids, x_rows, weights)
    assert_close(out, ref, CPU_TOL[dtype], qtype)


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "IQ1_M"])
def test_moe_gemm_blocks_of_no_expert_and_duplicate_experts(vec, qtype):
    """A token naming an expert twice gets its product twice; a block whose
    expert is no expert (-1 where expert_map leaves it to another rank, or
    past the experts) writes zeros; padding rows write nothing."""
    experts, rows, k = 3, 16, 256
    g = torch.Generator().manual_seed(9)
    raw, values = random_blocks(qtype, (experts, rows, k), g)
    x = torch.randn(4, k, generator=g).half()
    topk_ids = torch.tensor([[1, 1], [0, 2], [2, 2], [1, 0]], dtype=torch.int32)
    sorted_ids, expert_ids, npad = vec.align(topk_ids, 16, experts)
    out = vec.moe_gemm(x, raw, int(Q[qtype]), rows, sorted_ids, expert_ids, npad, 2)
    ref = gemm_reference(x, values, topk_ids, 2)
    assert_close(out, ref, CPU_TOL[torch.float16], qtype)
    assert torch.equal(out[0], out[1]) and torch.equal(out[4], out[5])
    for bad in (-1, experts):
        lost = expert_ids.clone()
        lost[1] = bad  # expert 1's block
        out = vec.moe_gemm(x, raw, int(Q[qtype]), rows, sorted_ids, lost, npad, 2)
        gone = (topk_ids.flatten() == 1).nonzero().flatten()
        kept = (topk_ids.flatten() != 1).nonzero().flatten()
        assert not out[gone].any() and not out[gone].isnan().any(), bad
        assert_close(out[kept], ref[kept], CPU_TOL[torch.float16], f"{qtype} {bad}")


# the down projection reads the activation rounded to the dtype and
# quantized again, the reference its fp64: a byte may round the other way
LAYER_TOL = {torch.float32: 1e-3, torch.float16: 4e-3}


@pytest.mark.parametrize("dtype", list(LAYER_TOL), ids=str)
@pytest.mark.parametrize("qtype", ["IQ2_XXS", "IQ1_S"])
def test_grouped_moe_matches_fp64(vec, qtype, dtype, monkeypatch):
    """The layer on the grouped kernel: both projections, the activation
    between them, the routing weights, the top-k sum; against the fp64
    layer on the same q8 activations."""
    monkeypatch.setattr(vec, "GEMM_BLOCK_N", 128)  # fewer programs for the interpreter
    experts, hidden, inter, tokens, top_k = 6, 512, 256, 11, 3
    g = torch.Generator().manual_seed(13)
    w13, v13 = random_blocks(qtype, (experts, 2 * inter, hidden), g)
    w2, v2 = random_blocks(qtype, (experts, hidden, inter), g)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    topk_ids = torch.rand(tokens, experts, generator=g).argsort(-1)[:, :top_k]
    topk_ids = topk_ids.to(torch.int32)
    topk_weights = torch.rand(tokens, top_k, generator=g)

    def silu_and_mul(h):
        return torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]

    out = vec.grouped_moe(x, w13, int(Q[qtype]), w2, int(Q[qtype]), topk_weights, topk_ids,
                          silu_and_mul)
    assert out.shape == x.shape and out.dtype == dtype
    ref = moe_reference(x, v13[:, :inter], v13[:, inter:], v2, topk_weights, topk_ids,
                        q8=(True, True, True))
    assert_close(out, ref, LAYER_TOL[dtype], qtype)


def test_moe_gemm_refuses_bad_input():
    module = _module()
    iq2 = int(Q.IQ2_XXS)
    g = torch.Generator().manual_seed(0)
    raw, _ = random_blocks("IQ2_XXS", (2, 8, 256), g)
    ids = torch.zeros(1, 1, dtype=torch.int32)
    aligned = module.align(ids, 16, 2)
    x = torch.randn(1, 256).half()
    with pytest.raises(ValueError, match="IQ4_XS rows of 256 values: not decoded here"):
        module.moe_gemm(x, raw, int(Q.IQ4_XS), 8, *aligned, 1)
    with pytest.raises(ValueError, match="IQ2_XXS rows of 384 values"):
        module.moe_gemm(torch.randn(1, 384).half(), raw, iq2, 8, *aligned, 1)
    with pytest.raises(ValueError, match=r"\[experts, 16, 66\] uint8 expected"):
        module.moe_gemm(x, raw, iq2, 16, *aligned, 1)


def test_grouped_takes_iq2_xxs_layers_of_192_to_512_tokens_of_top_8():
    """gguf_dispatch's choice: both projections IQ2_XXS (the type measured),
    1,536 to 4,096 token-expert rows (192-512 tokens of top-8: 1.77x at 256
    and 1.27x at 512 measured, even at 128, 0.42x at 2,048)."""
    module = _module()
    iq2, iq3 = int(Q.IQ2_XXS), int(Q.IQ3_XXS)
    assert module.grouped(iq2, iq2, 6144, 256, 192 * 8)
    assert module.grouped(iq2, iq2, 7168, 512, 512 * 8)
    assert not module.grouped(iq2, iq2, 6144, 256, 191 * 8)
    assert not module.grouped(iq2, iq2, 6144, 256, 128 * 8)
    assert not module.grouped(iq2, iq2, 6144, 256, 513 * 8)
    assert not module.grouped(iq2, iq3, 6144, 256, 256 * 8)
    assert not module.grouped(iq3, iq3, 6144, 256, 256 * 8)
    assert not module.grouped(iq2, iq2, 6100, 256, 256 * 8)


_AOT_SCRIPT = r"""
import json
import gguf
from vllm.model_executor.layers.quantization import gguf_moe_vec as vec
from support.aot import AotKernel, compile_for
out = {}
sig = {"x_ptr": "*fp16", "w_ptr": "*u8", "ids_ptr": "*i32", "out_ptr": "*fp16",
       "N": "i32", "num_experts": "i32",
       "stride_x": "i32", "stride_we": "i64", "stride_wn": "i32", "stride_out": "i32",
       "xq_ptr": "*i64", "xd_ptr": "*fp32"}
for qtype in vec.TYPES:
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    # the tables' entries: int64 or int32 by type, as moe_vec passes them
    grid, masks = vec._host_tables(qtype)
    sig.update(grid_ptr=f"*i{grid.itemsize * 8}", masks_ptr=f"*i{masks.itemsize * 8}")
    for dtype in ("fp16", "bf16"):
        for blocks in (1, 2):  # the down projection of TP-8 and TP-4 ranks
            consts = {"TOP_K": 1, "BLOCKS": blocks, "QTYPE": int(qtype), "BYTES": size,
                      "BLOCK_N": vec.BLOCK_N, "EMULATE": 0}
            kernel = AotKernel(
                name=f"{qtype.name}-{dtype}-k{blocks}", fn=vec._moe_vec_kernel,
                signature={**sig, "x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
                           **{k: "constexpr" for k in consts}},
                constexprs=consts, options={"num_warps": vec.NUM_WARPS, "num_stages": 2})
            for cap in ((12, 0), (9, 0)):
                compiled = compile_for(kernel, cap)
                out[f"sm{cap[0]}{cap[1]}-{kernel.name}"] = compiled.metadata.shared
    if qtype in vec.LONG_TYPES:
        for dtype in ("fp16", "bf16"):
            for blocks in (24, 28):  # gate and up: GLM-5's and DeepSeek-V3.2's hidden
                consts = {"TOP_K": 8, "BLOCKS": blocks, "QTYPE": int(qtype), "BYTES": size,
                          "BLOCK_N": vec.LONG_BLOCK_N, "EMULATE": 0}
                kernel = AotKernel(
                    name=f"{qtype.name}-{dtype}-k{blocks}", fn=vec._moe_vec_kernel,
                    signature={**sig, "x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
                               **{k: "constexpr" for k in consts}},
                    constexprs=consts,
                    options={"num_warps": vec.LONG_NUM_WARPS, "num_stages": 2})
                for cap in ((12, 0), (9, 0)):
                    compiled = compile_for(kernel, cap)
                    out[f"sm{cap[0]}{cap[1]}-{kernel.name}"] = compiled.metadata.shared
for dtype in ("fp16", "bf16"):
    for blocks in (1, 2, 24, 28):
        kernel = AotKernel(
            name=f"q8-{dtype}-k{blocks}", fn=vec._quantize_q8_kernel,
            signature={"x_ptr": f"*{dtype}", "xq_ptr": "*i32", "xd_ptr": "*fp32",
                       "stride_x": "i32", "BLOCKS": "constexpr"},
            constexprs={"BLOCKS": blocks},
            options={"num_warps": 2, "num_stages": 2, "enable_fp_fusion": False})
        for cap in ((12, 0), (9, 0)):
            compiled = compile_for(kernel, cap)
            out[f"sm{cap[0]}{cap[1]}-{kernel.name}"] = compiled.metadata.shared
print(json.dumps(out))
"""


def test_moe_vec_compiles_for_sm120_and_sm90(tmp_path):
    """Every type, fp16 and bf16, rows of one and two blocks, and the long
    rows' types at 24 and 28 blocks with their tile (what gguf_dispatch
    gives it), and the q8 kernel, compile for SM120 (and SM90) within
    SM120's shared memory. A fresh process: the interpreter patches
    triton.language in this one."""
    from support.aot import SM120_MAX_SHARED_BYTES, run_aot_script

    shared = run_aot_script(_AOT_SCRIPT, tmp_path)
    assert len(shared) == 7 * 2 * 2 * 2 + 2 * 2 * 2 * 2 + 2 * 4 * 2
    assert all(0 <= v <= SM120_MAX_SHARED_BYTES for v in shared.values()), shared


_GEMM_AOT_SCRIPT = r"""
import json
import gguf
from vllm.model_executor.layers.quantization import gguf_moe_vec as vec
from support.aot import AotKernel, compile_for
out = {}
sig = {"x_ptr": "*i64", "xd_ptr": "*fp32", "w_ptr": "*u8", "sorted_ptr": "*i32",
       "expert_ptr": "*i32", "npad_ptr": "*i32", "weights_ptr": "*fp32",
       "N": "i32", "num_rows": "i32", "num_experts": "i32",
       "stride_we": "i64", "stride_wn": "i32", "stride_out": "i32"}
tile = dict(BLOCK_M=vec.GEMM_BLOCK_M, BLOCK_N=vec.GEMM_BLOCK_N, SUB=vec.GEMM_SUB)
for qtype in vec.GEMM_TYPES:
    grid, masks = vec._host_tables(qtype)
    sig.update(grid_ptr=f"*i{grid.itemsize * 8}", masks_ptr=f"*i{masks.itemsize * 8}")
    for dtype in ("fp16", "bf16"):
        # gate and up (GLM-5's and DeepSeek-V3.2's hidden, top-8); the down
        # projection of TP-8 and TP-4 ranks, times the routing weights
        for blocks, x_rows in ((24, 8), (28, 8), (1, 1), (2, 1)):
            consts = {"X_ROWS": x_rows, "MUL_WEIGHT": x_rows == 1, "BLOCKS": blocks,
                      "QTYPE": int(qtype), "BYTES": gguf.GGML_QUANT_SIZES[qtype][1],
                      "EMULATE": 0, **tile}
            kernel = AotKernel(
                name=f"{qtype.name}-{dtype}-k{blocks}", fn=vec._moe_gemm_kernel,
                signature={**sig, "out_ptr": f"*{dtype}", **{k: "constexpr" for k in consts}},
                constexprs=consts,
                options={"num_warps": vec.GEMM_NUM_WARPS, "num_stages": 2})
            for cap in ((12, 0), (9, 0)):
                compiled = compile_for(kernel, cap)
                out[f"sm{cap[0]}{cap[1]}-{kernel.name}"] = [
                    compiled.metadata.shared, "wgmma" in compiled.asm["ptx"]]
print(json.dumps(out))
"""


def test_moe_gemm_compiles_for_sm120_and_sm90(tmp_path):
    """The grouped kernel, for each type gguf_dispatch gives it, fp16 and
    bf16, gate/up and down at GLM-5's and DeepSeek-V3.2's widths, at its
    tile: within SM120's shared memory, and no SM90-only instruction (dp4a
    on CUDA cores, no wgmma) on either."""
    from support.aot import SM120_MAX_SHARED_BYTES, run_aot_script

    compiled = run_aot_script(_GEMM_AOT_SCRIPT, tmp_path)
    assert len(compiled) == len(_module().GEMM_TYPES) * 2 * 4 * 2
    for name, (shared, wgmma) in compiled.items():
        assert 0 <= shared <= SM120_MAX_SHARED_BYTES, (name, shared)
        assert not wgmma, name


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------

# against fp64: fp32 sums, one rounding of the output (bf16: 2^-8)
GPU_TOL = {torch.float16: 2e-3, torch.bfloat16: 8e-3}
# against ggml's vector kernel, which quantizes the activations to 8 bits
GGML_TOL = 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(GPU_TOL), ids=str)
def test_q8_quantizer_on_the_gpu_rounds_as_the_reference(dtype):
    """The GPU's q8 bytes and scales are q8_activations' to the bit, on 25
    million values: IEEE divisions and no fused multiply-add on either side
    (a value near a half step otherwise goes to the neighbouring byte)."""
    module = _module()
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(4096, 6144, generator=g) * 0.3).to(dtype)
    xq, xd = module._quantize_q8(x.cuda())
    got = q8_values(xq.cpu(), xd.cpu(), x.shape)
    ref = q8_activations(x)
    differ = (got != ref).sum().item()
    assert differ == 0, f"{differ} of {x.numel()} q8 values differ from the reference"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(GPU_TOL), ids=str)
@pytest.mark.parametrize("qtype", TYPES)
def test_moe_vec_on_the_gpu_in_a_cuda_graph(qtype, dtype):
    """A GLM-5 TP-8 rank's gate/up (512 rows of 6,144) and down (6,144
    rows of 256) experts, 16 of them, at 1, 32 and 64 tokens of top-8:
    against fp64 and ggml's vector kernel; then captured in a CUDA graph
    and replayed on new inputs and routes."""
    from vllm import _custom_ops as ops

    module = _module()
    experts, hidden, inter, top_k = 16, 6144, 256, 8
    g = torch.Generator().manual_seed(7)
    cases = []
    for rows, k in ((2 * inter, hidden), (hidden, inter)):
        raw, values = random_blocks(qtype, (experts, rows, k), g)
        cases.append((raw.cuda(), values, rows, k))
    for tokens in (1, 32, 64):
        for (raw, values, rows, k), kk in zip(cases, (top_k, 1)):
            n = tokens if kk == top_k else tokens * top_k
            x = torch.randn(n, k, generator=g).to(dtype)
            ids = torch.rand(tokens, experts, generator=g).argsort(-1)[:, :top_k]
            ids = ids.to(torch.int32).cuda().contiguous()
            out = module.moe_vec(x.cuda(), raw, ids, kk, int(Q[qtype]), rows)
            ggml = ops.ggml_moe_a8_vec(x.cuda(), raw, ids, kk, int(Q[qtype]), rows, n)
            ref = reference(x, values, ids.cpu(), kk, qtype)
            what = f"{qtype} {rows}x{k} {tokens} tokens"
            assert_close(out.cpu(), ref, GPU_TOL[dtype], what)
            assert_close(ggml.cpu(), ref, GGML_TOL, f"{what} (ggml)")
            assert_close(out.cpu(), ggml.cpu().double(), GGML_TOL, f"{what} against ggml")
    raw, values, rows, k = cases[1]
    x = torch.zeros(32 * top_k, k, dtype=dtype, device="cuda")
    ids = torch.zeros(32, top_k, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module.moe_vec(x, raw, ids, 1, int(Q[qtype]), rows)
    for seed in (1, 2):
        gs = torch.Generator().manual_seed(seed)
        new_x = torch.randn(32 * top_k, k, generator=gs).to(dtype)
        new_ids = torch.rand(32, experts, generator=gs).argsort(-1)[:, :top_k].to(torch.int32)
        x.copy_(new_x)
        ids.copy_(new_ids)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out.cpu(), reference(new_x, values, new_ids, 1, qtype), GPU_TOL[dtype],
                     f"{qtype} graph replay {seed}")


# the layer against fp64: the activation rounded to the dtype and quantized
# again on both projections' way (bf16: 2^-8 a rounding)
GPU_LAYER_TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


@functools.lru_cache(maxsize=1)
def _layer_blocks(qtype, experts, hidden, inter):
    """Random w13 and w2 blocks and their fp64 values (the dtypes share them)."""
    g = torch.Generator().manual_seed(17)
    return (*random_blocks(qtype, (experts, 2 * inter, hidden), g),
            *random_blocks(qtype, (experts, hidden, inter), g))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(GPU_LAYER_TOL), ids=str)
@pytest.mark.parametrize("inter", [256, 512], ids=lambda i: f"inter{i}")
@pytest.mark.parametrize("qtype", GEMM_TEST_TYPES)
def test_grouped_moe_on_the_gpu_in_a_cuda_graph(qtype, inter, dtype):
    """A GLM-5 MoE layer of a TP-8 (moe_intermediate 256) and a TP-4 rank
    (512), 16 experts, 256 tokens of top-8 (128 rows an expert on average):
    the grouped layer against fp64 and against the vector path (moe_vec for
    both projections, the weights applied after); then captured in a CUDA
    graph and replayed on new inputs, routes and weights."""
    module = _module()
    experts, hidden, tokens, top_k = 16, 6144, 256, 8
    t = int(Q[qtype])
    w13, v13, w2, v2 = _layer_blocks(qtype, experts, hidden, inter)
    w13, w2 = w13.cuda(), w2.cuda()

    def silu_and_mul(h):
        return (torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float()).to(
            h.dtype)

    def routes(seed):
        gs = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, hidden, generator=gs).to(dtype)
        ids = torch.rand(tokens, experts, generator=gs).argsort(-1)[:, :top_k].to(torch.int32)
        weights = torch.rand(tokens, top_k, generator=gs)
        ref = moe_reference(x, v13[:, :inter], v13[:, inter:], v2, weights, ids,
                            q8=(True, True, True))
        return x, ids, weights, ref

    x, ids, weights, ref = routes(1)
    xc, idc, wc = x.cuda(), ids.cuda(), weights.cuda()
    out = module.grouped_moe(xc, w13, t, w2, t, wc, idc, silu_and_mul)
    h = module.moe_vec(xc, w13, idc, top_k, t, 2 * inter)
    vec = module.moe_vec(silu_and_mul(h), w2, idc, 1, t, hidden)
    vec = (vec.float().view(tokens, top_k, hidden) * wc[..., None]).sum(1).to(dtype)
    what = f"{qtype} inter {inter}"
    assert_close(out.cpu(), ref, GPU_LAYER_TOL[dtype], what)
    assert_close(vec.cpu(), ref, GPU_LAYER_TOL[dtype], f"{what} (vector path)")
    assert_close(out.cpu(), vec.cpu().double(), GPU_LAYER_TOL[dtype], f"{what} against vector")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module.grouped_moe(xc, w13, t, w2, t, wc, idc, silu_and_mul)
    for seed in (2, 3):
        x, ids, weights, ref = routes(seed)
        xc.copy_(x)
        idc.copy_(ids)
        wc.copy_(weights)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out.cpu(), ref, GPU_LAYER_TOL[dtype], f"{what} graph replay {seed}")
