# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fused MoE that reads GGUF blocks (gguf_fused_moe.py,
VLLM_GGUF_KERNELS=fused): K-quants, Q8_0 and the IQ types of the low-bit
files.

CPU (TRITON_INTERPRET=1, fp16): against the fp64 reference of the layer
from gguf-py's values, every row written (intermediates poisoned with NaN),
experts without tokens, a partial last row block, duplicate experts in a
token's top-k; expert ids out of range refused; the kernel compiles for
SM120 and SM90 within SM120's shared memory (where gguf_dispatch takes it:
tests/kernels/test_gguf_dispatch.py). GPU (`-m gpu`): the registered MoE op
with the switch against fp64, fp16 and bf16.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from support.gguf_moe_ref import CpuGgufMoeOps, moe_reference, random_blocks

Q = gguf.GGMLQuantizationType


def _module():
    from vllm.model_executor.layers.quantization import gguf_fused_moe

    return gguf_fused_moe


@pytest.fixture
def fmoe(monkeypatch):
    module = _module()
    CpuGgufMoeOps().install(monkeypatch)  # silu_and_mul on the CPU

    def poisoned(*args, **kwargs):
        return torch.full(*args, float("nan"), **kwargs)

    monkeypatch.setattr(module, "_empty", poisoned)
    return module


def layer(w13_type, w2_type, experts, hidden, inter, seed):
    g = torch.Generator().manual_seed(seed)
    raw_gate, gate = random_blocks(w13_type, (experts, inter, hidden), g)
    raw_up, up = random_blocks(w13_type, (experts, inter, hidden), g)
    raw_down, down = random_blocks(w2_type, (experts, hidden, inter), g)
    return torch.cat([raw_gate, raw_up], 1), raw_down, (gate, up, down)


@pytest.mark.parametrize("w13_type,w2_type", [("Q4_K", "Q6_K"), ("Q8_0", "Q8_0"),
                                               ("Q6_K", "Q4_K"), ("IQ2_XXS", "IQ3_XXS"),
                                               ("IQ4_XS", "IQ2_XXS"), ("IQ3_XXS", "IQ4_XS")])
@pytest.mark.parametrize("tokens,top_k,block_m", [(1, 1, 16), (7, 3, 16), (21, 2, 32)])
def test_fused_moe_matches_fp64(fmoe, w13_type, w2_type, tokens, top_k, block_m):
    experts, hidden, inter = 5, 512, 256
    w13, w2, values = layer(w13_type, w2_type, experts, hidden, inter, tokens)
    g = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, hidden, generator=g).half()
    topk_ids = torch.rand(tokens, experts, generator=g).argsort(-1)[:, :top_k].to(torch.int32)
    topk_weights = torch.rand(tokens, top_k, generator=g) + 0.1
    out = fmoe.fused_moe(x, w13, int(Q[w13_type]), w2, int(Q[w2_type]), topk_weights,
                         topk_ids, tile=(block_m, 32, 4))
    ref = moe_reference(x, *values, topk_weights, topk_ids)
    assert out.shape == ref.shape and out.dtype == torch.float16
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    assert err <= 4e-3 * ref.abs().max().item(), err


def test_duplicate_experts_and_idle_experts(fmoe):
    """A token whose top-k names one expert twice gets it twice; experts
    no token chose are skipped, the rest still computed."""
    experts, hidden, inter = 6, 256, 256
    w13, w2, values = layer("Q4_K", "Q6_K", experts, hidden, inter, 3)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, hidden, generator=g).half()
    topk_ids = torch.tensor([[4, 4], [1, 4], [1, 1]], dtype=torch.int32)
    topk_weights = torch.rand(3, 2, generator=g) + 0.1
    out = fmoe.fused_moe(x, w13, int(Q.Q4_K), w2, int(Q.Q6_K), topk_weights, topk_ids,
                         tile=(16, 32, 4))
    ref = moe_reference(x, *values, topk_weights, topk_ids)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() <= 4e-3 * ref.abs().max().item()


def test_align_pads_each_expert_and_keeps_every_row():
    fmoe = _module()
    ids = torch.tensor([[2, 0], [2, 2], [0, 3]])
    sorted_ids, expert_ids, total = fmoe.align(ids, 4, 5)
    assert total == 12 and expert_ids.tolist() == [0, 2, 3]
    assert sorted_ids.tolist() == [1, 4, 6, 6, 0, 2, 3, 6, 5, 6, 6, 6]


@pytest.mark.parametrize("ids,match", [([[0, 5]], r"topk_ids must lie in \[0, 5\)"),
                                       ([[-1, 0]], r"topk_ids must lie in \[0, 5\)")])
def test_align_refuses_experts_out_of_range(ids, match):
    fmoe = _module()
    with pytest.raises(ValueError, match=match):
        fmoe.align(torch.tensor(ids), 16, 5)


def test_supported_types_and_shapes():
    fmoe = _module()
    q4k, q6k, q8, iq4, iq2, q5k, iq3s = (int(Q[t]) for t in (
        "Q4_K", "Q6_K", "Q8_0", "IQ4_XS", "IQ2_XXS", "Q5_K", "IQ3_S"))
    assert fmoe.supported(q4k, q6k, 6144, 256) and fmoe.supported(q8, q8, 7168, 2048)
    assert fmoe.supported(iq2, iq4, 6144, 256)
    assert not fmoe.supported(q5k, q6k, 6144, 256)  # no decoder here
    assert not fmoe.supported(q4k, iq3s, 6144, 256)
    assert not fmoe.supported(q8, q8, 6144, 96)  # K of the down GEMM not whole superblocks


_AOT_SCRIPT = r"""
import json
import gguf
from vllm.model_executor.layers.quantization import gguf_fused_moe as fmoe
from support.aot import AotKernel, compile_for
out = {}
sig = {"a_ptr": "*fp16", "b_ptr": "*u8", "c_ptr": "*fp16", "weights_ptr": "*fp32",
       "grid_ptr": "*fp32", "signs_ptr": "*u8", "sorted_ids_ptr": "*i32",
       "expert_ids_ptr": "*i32", "num_padded": "i32",
       "num_rows": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_be": "i64",
       "stride_bn": "i32", "stride_cm": "i32"}
for qtype in fmoe.TYPES:
    qk, size = gguf.GGML_QUANT_SIZES[qtype]
    for block_m in (16, 64):
        consts = {"A_ROWS_PER_TOKEN": 8, "MUL_WEIGHT": True, "QTYPE": int(qtype),
                  "SUPER_BYTES": 256 // qk * size, "BLOCK_M": block_m, "BLOCK_N": 64,
                  "GROUP_M": 8}
        kernel = AotKernel(
            name=f"{qtype.name}-m{block_m}", fn=fmoe._gguf_moe_gemm_kernel,
            signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts,
            options={"num_warps": 4, "num_stages": 2})
        for cap in ((12, 0), (9, 0)):
            out[f"sm{cap[0]}{cap[1]}-{kernel.name}"] = compile_for(kernel, cap).metadata.shared
print(json.dumps(out))
"""


def test_fused_moe_compiles_for_sm120_and_sm90(tmp_path):
    """Every type compiles for SM120 (and SM90) within SM120's shared
    memory. A fresh process: the interpreter patches triton.language in
    this one."""
    from support.aot import SM120_MAX_SHARED_BYTES, run_aot_script

    shared = run_aot_script(_AOT_SCRIPT, tmp_path)
    assert len(shared) == 24
    assert all(0 <= v <= SM120_MAX_SHARED_BYTES for v in shared.values()), shared


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------

GPU_TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(GPU_TOL), ids=str)
@pytest.mark.parametrize("types", [("Q4_K", "Q6_K"), ("Q8_0", "Q8_0"), ("Q6_K", "Q4_K"),
                                   ("IQ2_XXS", "IQ3_XXS"), ("IQ4_XS", "IQ4_XS")],
                         ids="-".join)
def test_the_moe_op_with_the_switch_on_the_gpu(types, dtype, monkeypatch):
    """The registered MoE op with VLLM_GGUF_KERNELS=fused at the float
    path's threshold: the fused kernel against fp64, poisoned buffers."""
    from vllm.model_executor.layers.quantization import gguf_dispatch
    from vllm.model_executor.layers.quantization.gguf import fused_moe_gguf

    module = _module()
    monkeypatch.setattr(module, "_empty",
                        lambda *a, **k: torch.full(*a, float("nan"), **k))
    monkeypatch.setenv("VLLM_GGUF_KERNELS", "fused")
    experts, hidden, inter, top_k = 16, 1024, 512, 4
    w13, w2, values = layer(*types, experts, hidden, inter, 9)
    tokens = gguf_dispatch.MOE_DEQUANT_MIN_TOKENS
    g = torch.Generator().manual_seed(10)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    topk_ids = torch.rand(tokens, experts, generator=g).argsort(-1)[:, :top_k].to(torch.int32)
    topk_weights = torch.rand(tokens, top_k, generator=g) + 0.1
    out = fused_moe_gguf(x.cuda(), w13.cuda(), w2.cuda(), topk_weights.cuda(),
                         topk_ids.cuda(), int(Q[types[0]]), int(Q[types[1]]), "silu")
    torch.cuda.synchronize()
    ref = moe_reference(x, *values, topk_weights, topk_ids)
    out = out.cpu()
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    assert err <= GPU_TOL[dtype] * ref.abs().max().item(), err
