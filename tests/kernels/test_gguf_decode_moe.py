# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The decode-batch MoE that reads GGUF blocks (gguf_decode_moe.py): the
routed experts of batches below gguf_dispatch.MOE_DECODE_MAX_TOKENS, CUDA
graphs included.

CPU (TRITON_INTERPRET=1, fp16): against the fp64 reference of the layer
from gguf-py's values per type pair, intermediates poisoned with NaN; an
expert with more rows than one row block, a token naming an expert twice,
idle experts; expert ids out of range add nothing; the kernel compiles for
SM120 and SM90 within SM120's shared memory at its tiles. Where the MoE op
takes it: tests/kernels/test_gguf_dispatch.py. GPU (`-m gpu`): the
registered MoE op against fp64 in fp16 and bf16 up to the threshold, and
captured in a CUDA graph, replayed on new inputs and routes.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from support.gguf_moe_ref import CpuGgufMoeOps, moe_reference, random_blocks

Q = gguf.GGMLQuantizationType
TYPE_PAIRS = [("Q4_K", "Q6_K"), ("Q8_0", "Q8_0"), ("Q6_K", "Q4_K"), ("IQ2_XXS", "IQ3_XXS"),
              ("IQ4_XS", "IQ2_XXS"), ("IQ3_XXS", "IQ4_XS")]


def _module():
    from vllm.model_executor.layers.quantization import gguf_decode_moe

    return gguf_decode_moe


@pytest.fixture
def dmoe(monkeypatch):
    module = _module()
    CpuGgufMoeOps().install(monkeypatch)  # silu_and_mul on the CPU
    monkeypatch.setattr(module, "_empty", lambda *a, **k: torch.full(*a, float("nan"), **k))
    return module


def layer(w13_type, w2_type, experts, hidden, inter, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    raw_gate, gate = random_blocks(w13_type, (experts, inter, hidden), g)
    raw_up, up = random_blocks(w13_type, (experts, inter, hidden), g)
    raw_down, down = random_blocks(w2_type, (experts, hidden, inter), g)
    w13 = torch.cat([raw_gate, raw_up], 1).to(device)
    return w13, raw_down.to(device), (gate, up, down)


def routes(tokens, experts, top_k, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=g).argsort(-1)[:, :top_k].to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return ids.to(device), weights.to(device)


def assert_close_to(out, ref, tol, what=""):
    out = out.cpu()
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}"
    assert torch.isfinite(out).all(), f"{what}: NaN or Inf in the output"
    err = (out.double() - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item(), f"{what}: max |err| {err:.3g}"


# fp16 output of fp32 sums: about one rounding of the output
CPU_TOL = 2e-3


@pytest.mark.parametrize("w13_type,w2_type", TYPE_PAIRS)
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (7, 3)])
def test_decode_moe_matches_fp64(dmoe, w13_type, w2_type, tokens, top_k):
    experts, hidden, inter = 5, 512, 256
    w13, w2, values = layer(w13_type, w2_type, experts, hidden, inter, tokens)
    topk_ids, topk_weights = routes(tokens, experts, top_k, 100 + tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).half()
    out = dmoe.fused_moe(x, [(w13, int(Q[w13_type]))], w2, int(Q[w2_type]), topk_weights,
                         topk_ids)
    assert out.dtype == torch.float16
    assert_close_to(out, moe_reference(x, *values, topk_weights, topk_ids), CPU_TOL)


@pytest.mark.parametrize("types", [("Q4_K", "Q6_K", "Q8_0"), ("IQ2_XXS", "Q4_K", "IQ4_XS")],
                         ids="-".join)
def test_gate_and_up_of_different_types(dmoe, types):
    """Gate and up apart (the split op's halves), each its own type."""
    experts, hidden, inter, tokens = 5, 256, 256, 4
    g = torch.Generator().manual_seed(2)
    shapes = [(experts, inter, hidden), (experts, inter, hidden), (experts, hidden, inter)]
    raw, values = zip(*(random_blocks(t, s, g) for t, s in zip(types, shapes, strict=True)))
    topk_ids, topk_weights = routes(tokens, experts, 2, 4)
    x = torch.randn(tokens, hidden, generator=g).half()
    qt = [int(Q[t]) for t in types]
    out = dmoe.fused_moe(x, [(raw[0], qt[0]), (raw[1], qt[1])], raw[2], qt[2], topk_weights,
                         topk_ids)
    assert_close_to(out, moe_reference(x, *values, topk_weights, topk_ids), CPU_TOL)


def test_many_rows_an_expert_duplicates_and_idle_experts(dmoe):
    """An expert chosen by 19 rows (two row blocks), a token naming an
    expert twice, experts nobody chose: every row computed once."""
    experts, hidden, inter, tokens = 6, 256, 256, 18
    w13, w2, values = layer("Q4_K", "Q6_K", experts, hidden, inter, 3)
    g = torch.Generator().manual_seed(5)
    topk_ids = torch.stack([torch.full((tokens,), 4), torch.randint(0, 3, (tokens,), generator=g)],
                           dim=1).to(torch.int32)
    topk_ids[7] = torch.tensor([4, 4])
    topk_weights = torch.rand(tokens, 2, generator=g) + 0.1
    x = torch.randn(tokens, hidden, generator=g).half()
    out = dmoe.fused_moe(x, [(w13, int(Q.Q4_K))], w2, int(Q.Q6_K), topk_weights, topk_ids)
    assert_close_to(out, moe_reference(x, *values, topk_weights, topk_ids), CPU_TOL)


def test_expert_ids_out_of_range_add_nothing(dmoe):
    experts, hidden, inter = 4, 256, 256
    w13, w2, values = layer("Q8_0", "Q4_K", experts, hidden, inter, 8)
    topk_ids = torch.tensor([[0, -1], [4, 2], [3, 1000]], dtype=torch.int32)
    topk_weights = torch.rand(3, 2, generator=torch.Generator().manual_seed(2)) + 0.1
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(9)).half()
    out = dmoe.fused_moe(x, [(w13, int(Q.Q8_0))], w2, int(Q.Q4_K), topk_weights, topk_ids)
    valid = (topk_ids >= 0) & (topk_ids < experts)
    ref = moe_reference(x, *values, torch.where(valid, topk_weights, 0.0),
                        torch.where(valid, topk_ids, 0))
    assert_close_to(out, ref, CPU_TOL)


def test_supported_types_and_tables():
    dmoe = _module()
    q4k, q6k, iq4, q5k = (int(Q[t]) for t in ("Q4_K", "Q6_K", "IQ4_XS", "Q5_K"))
    assert dmoe.supported(6144, 256, q4k, q6k) and dmoe.supported(7168, 2048, iq4, q4k, q6k)
    assert not dmoe.supported(6144, 256, q4k, q5k, q6k)  # no decoder here
    assert not dmoe.supported(6144, 96, q4k, q6k)  # K of the down GEMM not whole superblocks
    # types without a table never wait for one
    assert dmoe.tables_ready(torch.device("meta"), q4k, q6k)
    assert not dmoe.tables_ready(torch.device("meta"), q4k, iq4)


_AOT_SCRIPT = r"""
import json
import gguf
from vllm.model_executor.layers.quantization import gguf_decode_moe as dmoe
from support.aot import AotKernel, compile_for
out = {}
sig = {"a_ptr": "*fp16", "b_ptr": "*u8", "c_ptr": "*fp16", "ids_ptr": "*i32",
       "weights_ptr": "*fp32", "grid_ptr": "*fp32", "signs_ptr": "*u8", "num_pairs": "i32",
       "num_experts": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_be": "i64",
       "stride_bn": "i32", "stride_cm": "i32"}
for qtype in dmoe.TYPES:
    qk, size = gguf.GGML_QUANT_SIZES[qtype]
    for gemm, (block_n, warps, stages) in (("up", dmoe._TILE_UP), ("down", dmoe._TILE_DOWN)):
        stages = dmoe.stages(qtype, stages)
        consts = {"A_ROWS_PER_TOKEN": 8, "MUL_WEIGHT": gemm == "down", "QTYPE": int(qtype),
                  "SUPER_BYTES": 256 // qk * size, "BLOCK_M": dmoe.BLOCK_M,
                  "BLOCK_N": block_n, "BLOCK_P": dmoe.BLOCK_P}
        kernel = AotKernel(
            name=f"{qtype.name}-{gemm}", fn=dmoe._gguf_decode_moe_kernel,
            signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts,
            options={"num_warps": warps, "num_stages": stages})
        for cap in ((12, 0), (9, 0)):
            out[f"sm{cap[0]}{cap[1]}-{kernel.name}"] = compile_for(kernel, cap).metadata.shared
print(json.dumps(out))
"""


def test_decode_moe_compiles_for_sm120_and_sm90(tmp_path):
    """Every type at both GEMMs' tiles compiles for SM120 (and SM90) within
    SM120's shared memory. A fresh process: the interpreter patches
    triton.language in this one."""
    from support.aot import SM120_MAX_SHARED_BYTES, run_aot_script

    shared = run_aot_script(_AOT_SCRIPT, tmp_path)
    assert len(shared) == 2 * 2 * len(_module().TYPES)
    assert all(0 <= v <= SM120_MAX_SHARED_BYTES for v in shared.values()), shared


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------

GPU_TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}
GPU_EXPERTS, GPU_HIDDEN, GPU_INTER, GPU_TOP_K = 16, 1024, 512, 4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(GPU_TOL), ids=str)
@pytest.mark.parametrize("types", TYPE_PAIRS, ids="-".join)
def test_the_moe_op_below_the_threshold_on_the_gpu(types, dtype, monkeypatch):
    """The registered MoE op at 1 token and just below the threshold runs
    the kernel (ggml's kernels not launched) and matches fp64."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization import gguf_dispatch
    from vllm.model_executor.layers.quantization.gguf import fused_moe_gguf

    module = _module()
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    monkeypatch.setattr(module, "_empty", lambda *a, **k: torch.full(*a, float("nan"), **k))
    ggml = []
    for name in ("ggml_moe_a8", "ggml_moe_a8_vec"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, real=real: ggml.append(1) or real(*a))
    w13, w2, values = layer(*types, GPU_EXPERTS, GPU_HIDDEN, GPU_INTER, 9, "cuda")
    for tokens in (1, gguf_dispatch.MOE_DECODE_MAX_TOKENS - 1):
        topk_ids, topk_weights = routes(tokens, GPU_EXPERTS, GPU_TOP_K, tokens, "cuda")
        x = torch.randn(tokens, GPU_HIDDEN, generator=torch.Generator().manual_seed(1))
        x = x.to(dtype).cuda()
        out = fused_moe_gguf(x, w13, w2, topk_weights, topk_ids, int(Q[types[0]]),
                             int(Q[types[1]]), "silu")
        torch.cuda.synchronize()
        ref = moe_reference(x.cpu(), *values, topk_weights.cpu(), topk_ids.cpu())
        assert_close_to(out, ref, GPU_TOL[dtype], f"{types} {dtype} {tokens} tokens")
    assert not ggml, "ggml's MoE kernels ran below the threshold"


@pytest.mark.gpu
@pytest.mark.parametrize("types", [("Q4_K", "Q6_K"), ("IQ4_XS", "IQ2_XXS")], ids="-".join)
def test_the_moe_op_in_a_cuda_graph(types, monkeypatch):
    """Captured at 8 tokens (the tables made outside the graph, as vLLM's
    memory profiling run makes them), replayed on new inputs and new
    routes: each replay matches fp64."""
    from vllm.model_executor.layers.quantization.gguf import fused_moe_gguf

    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    w13, w2, values = layer(*types, GPU_EXPERTS, GPU_HIDDEN, GPU_INTER, 4, "cuda")
    qt = [int(Q[t]) for t in types]
    tokens, g = 8, torch.Generator().manual_seed(6)
    x = torch.randn(tokens, GPU_HIDDEN, generator=g).half().cuda()
    topk_ids, topk_weights = routes(tokens, GPU_EXPERTS, GPU_TOP_K, 0, "cuda")
    fused_moe_gguf(x, w13, w2, topk_weights, topk_ids, *qt, "silu")  # compiles, makes tables
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_gguf(x, w13, w2, topk_weights, topk_ids, *qt, "silu")
    for seed in (1, 2, 3):
        new_ids, new_weights = routes(tokens, GPU_EXPERTS, GPU_TOP_K, seed, "cuda")
        if seed == 3:
            new_ids[:, 0] = 5  # every token to one expert: 8 rows of one block
        x.copy_(torch.randn(tokens, GPU_HIDDEN, generator=g).half())
        topk_ids.copy_(new_ids)
        topk_weights.copy_(new_weights)
        graph.replay()
        torch.cuda.synchronize()
        ref = moe_reference(x.cpu(), *values, new_weights.cpu(), new_ids.cpu())
        assert_close_to(out, ref, GPU_TOL[torch.float16], f"{types} replay {seed}")
