# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GGUF routed experts repacked for vLLM's Marlin MoE (gguf_marlin_moe.py).

CPU: the integer weights and group scales of each type, with the
activations as the Marlin weight reads them (Q4_K's min-term columns, from
the Triton kernel in the interpreter), give x @ W.T of gguf-py's values,
for Q4_K also where a group's inputs sum past 8,192 in fp16;
the input kernel writes every column (poisoned output); which layers run
Marlin (types, shapes, dtype, VLLM_GGUF_KERNELS); down experts left in
GGUF blocks take ggml's kernels by batch size (CPU stand-ins of the ops);
dequantize() reads back from the Marlin layout (vLLM's Python reference
of gptq_marlin_repack standing in for the op) the values the operand
holds, and the float path gets them for prefill batches on SM90 only.
GPU (`-m gpu`): a layer repacked by repack_layer and run through the
registered op (the engine's path), in fp16 and bf16, down experts on
Marlin or on ggml's kernels and the float path (in groups of experts too),
the whole layer on the float path, against the fp64 reference of the
same blocks, also replayed in a CUDA graph.
"""

from __future__ import annotations

import types

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from support.gguf_moe_ref import (
    CpuGgufMoeOps,
    gguf_moe_layer,
    large_group_sums,
    moe_reference,
    random_blocks,
)
from support.marlin_ref import marlin_repack

E, HIDDEN, INTER, TOP_K = 8, 512, 256, 3
# Marlin's integer offset of each type: uint4 (zero point 0), uint4b8, uint8b128
OFFSET = {"Q4_K": 0, "Q4_0": 8, "Q8_0": 128}


def _module():
    from vllm.model_executor.layers.quantization import gguf_marlin_moe

    return gguf_marlin_moe


@pytest.mark.parametrize("type_name,k", [("Q4_K", 256), ("Q4_K", 768), ("Q4_0", 96),
                                         ("Q4_0", 128), ("Q8_0", 160)])
def test_operand_and_input_give_the_gguf_product(type_name, k):
    gm = _module()
    g = torch.Generator().manual_seed(k)
    raw, values = random_blocks(type_name, (64, k), g)
    qtype = QType[type_name]
    q, scales = gm.marlin_operand(raw, qtype, k, torch.float16)
    kp = gm.marlin_k(qtype, k)
    assert q.shape == (64, kp) and scales.shape == (kp // 32, 64) and kp % 64 == 0
    w = (q.double() - OFFSET[type_name]) * scales.t().double().repeat_interleave(32, 1)
    x = torch.randn(5, k, generator=g).half()
    xa = gm.marlin_input(x, qtype, kp)
    assert xa.shape == (5, kp)
    got, want = xa.double() @ w.t(), x.double() @ values.t()
    err = ((got - want).abs().max() / want.abs().max()).item()
    # Q4_0 and Q8_0 are exact; Q4_K rounds d * sc and the group sums to fp16
    assert err < (1e-3 if type_name == "Q4_K" else 1e-12), err


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_q4_k_min_term_holds_group_sums_past_8192(dtype):
    # Q4_K's min-term columns hold each group's input sum; in fp16 none of
    # them may overflow before the sum itself does (65,504, as ggml's q8_1
    # blocks hold it)
    gm = _module()
    g = torch.Generator().manual_seed(5)
    raw, values = random_blocks("Q4_K", (64, 512), g)
    q, scales = gm.marlin_operand(raw, QType.Q4_K, 512, dtype)
    kp = gm.marlin_k(QType.Q4_K, 512)
    w = q.double() * scales.t().double().repeat_interleave(32, 1)
    x = large_group_sums(3, 512, g).to(dtype)
    xa = gm.marlin_input(x, QType.Q4_K, kp)
    assert torch.isfinite(xa).all()
    got, want = xa.double() @ w.t(), x.double() @ values.t()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < (1e-3 if dtype == torch.float16 else 1e-2), err


def test_q4_k_decoder_gives_gguf_values():
    gm = _module()
    raw, values = random_blocks("Q4_K", (16, 512), torch.Generator().manual_seed(3))
    q, sc, m, d, dmin = gm.decode_q4_k(raw)
    scale = (d.double()[..., None] * sc.double()).repeat_interleave(32, -1).view(16, 512)
    minus = (dmin.double()[..., None] * m.double()).repeat_interleave(32, -1).view(16, 512)
    assert torch.equal(scale * q.double() - minus, values)
    assert int(q.min()) >= 0 and int(q.max()) <= 15 and int(m.max()) <= 63


@pytest.mark.parametrize("k", [256, 512, 1280])
def test_q4_k_input_kernel_writes_every_column(k):
    gm = _module()
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(k)).half()
    kp = gm.marlin_k(QType.Q4_K, k)
    out = torch.full((3, kp), float("nan"), dtype=torch.float16)
    n_super = k // 256
    gm._q4_k_input_kernel[(3, n_super + 1)](
        x, out, x.stride(0), out.stride(0), n_super, kp, PAD=gm.TILE
    )
    want = torch.zeros(3, kp, dtype=torch.float16)
    body = want[:, : n_super * 288].view(3, n_super, 288)
    xs = x.view(3, n_super, 256)
    body[..., :256] = xs
    sums = xs.view(3, n_super, 8, 32).float().sum(-1)
    body[..., 256:264] = (-sums / 8).half()
    body[..., 264:272] = (-sums).half()
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-3)


def _cpu_repack(monkeypatch, gm):
    """ops.gptq_marlin_repack on the CPU: vLLM's reference of its layout."""
    monkeypatch.setattr(gm.ops, "gptq_marlin_repack", marlin_repack)


def _operand_values(gm, raw, qtype, k):
    """fp64 [n, k] of one expert as its Marlin operand (marlin_operand's
    integers and fp16 scales) holds them."""
    q, scales = gm.marlin_operand(raw, qtype, k, torch.float16)
    s, n = scales.t().double(), q.shape[0]
    if qtype != QType.Q4_K:
        return ((q.double() - OFFSET[qtype.name]) * s.repeat_interleave(32, 1))[:, :k]
    nsb = k // 256
    body = q[:, : nsb * 288].view(n, nsb, 288).double()
    groups = s[:, : nsb * 9].view(n, nsb, 9)
    values = body[..., :256].view(n, nsb, 8, 32) * groups[..., :8, None]
    # the min-term group's scale is 8 * dmin: m & 7 reads -X / 8, m >> 3 reads -X
    mins = groups[..., 8, None] * (body[..., 256:264] / 8 + body[..., 264:272])
    return (values - mins[..., None]).reshape(n, k)


# several 64-column chunks and 16-row strips: _marlin_value computes the layout
@pytest.mark.parametrize("type_name,n,k", [("Q4_K", 128, 512), ("Q4_0", 192, 96),
                                           ("Q8_0", 128, 160)])
def test_dequantize_reads_the_marlin_layout(type_name, n, k, monkeypatch):
    gm = _module()
    _cpu_repack(monkeypatch, gm)
    qtype = QType[type_name]
    raw, values = random_blocks(type_name, (3, n, k), torch.Generator().manual_seed(n + k))
    w, s = gm.repack_experts(raw, qtype, k, torch.float16)
    out = gm.dequantize(w, s, qtype, n, k)
    assert out.shape == (3, n, k) and out.dtype == torch.float16
    assert torch.isfinite(out).all()
    for e in range(3):
        # fp32 arithmetic, one rounding to fp16
        want = _operand_values(gm, raw[e], qtype, k)
        torch.testing.assert_close(out[e].double(), want, rtol=2e-3, atol=1e-6)
        # gguf-py's values, but for the scales' rounding to fp16 (Q4_K's d * sc)
        err = ((out[e].double() - values[e]).abs().max() / values[e].abs().max()).item()
        assert err < 2e-3, (e, err)


def test_prefill_batches_take_the_float_path_on_sm90_only(monkeypatch):
    from vllm.model_executor.layers.quantization import gguf_dispatch

    gm = _module()
    capability = types.SimpleNamespace(major=9, minor=0)
    platform = types.SimpleNamespace(get_device_capability=lambda: capability)
    monkeypatch.setattr(gguf_dispatch, "current_platform", platform)
    assert gm.use_float(gm.FLOAT_MIN_TOKENS) and not gm.use_float(gm.FLOAT_MIN_TOKENS - 1)
    # a layer whose float experts take two groups waits for longer batches
    assert gm.FLOAT_MIN_TOKENS < gm.FLOAT_MIN_TOKENS_GROUPED
    assert not gm.use_float(gm.FLOAT_MIN_TOKENS_GROUPED - 1, 2)
    assert gm.use_float(gm.FLOAT_MIN_TOKENS_GROUPED, 2)
    for major in (8, 10, 12):
        capability.major = major
        assert not gm.use_float(1 << 20)


@pytest.mark.parametrize("w2_type", ["Q4_K", "Q6_K"])
def test_the_float_path_gets_the_layer_values(w2_type, monkeypatch):
    """float_path hands gguf_dispatch.float_moe the layer's values, any
    group of experts: from the Marlin weights, the down experts from their
    GGUF blocks where they kept them."""
    from vllm.model_executor.layers.quantization import gguf_dispatch

    gm = _module()
    _cpu_repack(monkeypatch, gm)
    g = torch.Generator().manual_seed(4)
    r13, v13 = random_blocks("Q4_K", (E, 2 * INTER, HIDDEN), g)
    r2, v2 = random_blocks(w2_type, (E, HIDDEN, INTER), g)
    w13, s13 = gm.repack_experts(r13, QType.Q4_K, HIDDEN, torch.float16)
    down_marlin = gm.down_on_marlin(QType[w2_type], HIDDEN, INTER)
    w2, s2 = r2, torch.empty(0)
    if down_marlin:
        w2, s2 = gm.repack_experts(r2, QType[w2_type], INTER, torch.float16)
    groups = {}

    def float_moe(x, float_experts, num_experts, rows13, topk_weights, topk_ids, act):
        assert (num_experts, rows13, act) == (E, 2 * INTER, "silu")
        for lo, hi in ((0, E), (2, 5)):
            groups[lo, hi] = float_experts(lo, hi)
        return "float"

    monkeypatch.setattr(gguf_dispatch, "float_moe", float_moe)
    x = torch.randn(4, HIDDEN, generator=g).half()
    ids = torch.rand(4, E, generator=g).argsort(-1)[:, :TOP_K].to(torch.int32)
    out = gm.float_path(x, w13, s13, w2, s2, torch.rand(4, TOP_K), ids, QType.Q4_K,
                        QType[w2_type], "silu", down_marlin)
    assert out == "float"
    for (lo, hi), (up, down) in groups.items():
        assert up.shape == (hi - lo, 2 * INTER, HIDDEN) and up.dtype == torch.float16
        assert down.shape == (hi - lo, HIDDEN, INTER) and down.dtype == torch.float16
        for got, want in ((up, v13[lo:hi]), (down, v2[lo:hi])):
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert err < 2e-3, (lo, hi, err)


_AOT_SCRIPT = r"""
import json
from vllm.model_executor.layers.quantization import gguf_marlin_moe as gm
from support.aot import AotKernel, compile_for
kernels = []
for ptr in ("*fp16", "*bf16"):
    kernels.append(AotKernel(
        name=f"input-{ptr[1:]}", fn=gm._q4_k_input_kernel,
        signature={"x_ptr": ptr, "out_ptr": ptr, "stride_x": "i32", "stride_out": "i32",
                   "n_super": "i32", "k_out": "i32", "PAD": "constexpr"},
        constexprs={"PAD": gm.TILE}, options={"num_warps": 4, "num_stages": 1}))
    for bits, offset, q4_k in ((4, 0, True), (4, 8, False), (8, 128, False)):
        kernels.append(AotKernel(
            name=f"dequant{bits}-{offset}-{ptr[1:]}", fn=gm._marlin_dequant_kernel,
            signature={"w_ptr": "*i32", "s_ptr": ptr, "out_ptr": ptr,
                       "n": "i32", "k": "i32", "stride_w": "i32", "stride_s": "i32",
                       "BITS": "constexpr", "OFFSET": "constexpr", "Q4_K": "constexpr",
                       "BLOCK_N": "constexpr", "GROUPS": "constexpr"},
            constexprs={"BITS": bits, "OFFSET": offset, "Q4_K": q4_k, "BLOCK_N": 32,
                        "GROUPS": 4},
            options={"num_warps": 4, "num_stages": 1}))
out = {}
for kernel in kernels:
    for cap in ((12, 0), (9, 0)):
        out[f"sm{cap[0]}{cap[1]}-{kernel.name}"] = compile_for(kernel, cap).metadata.shared
print(json.dumps(out))
"""


def test_kernels_compile_for_sm120_and_sm90(tmp_path):
    """The input kernel (every GPU) and the dequantizer (the SM90 float
    path) compile for SM120 and SM90 within SM120's shared memory. A fresh
    process: the interpreter patches triton.language in this one."""
    from support.aot import SM120_MAX_SHARED_BYTES, run_aot_script

    shared = run_aot_script(_AOT_SCRIPT, tmp_path)
    assert len(shared) == 2 * 2 * 4  # sm_120, sm_90 x fp16, bf16 x 4 kernels
    assert all(0 <= v <= SM120_MAX_SHARED_BYTES for v in shared.values()), shared


@pytest.mark.parametrize("capability,compiles", [
    ((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True), ((12, 0), False),
    ((12, 1), False), (None, False),
])
def test_a_gpu_without_marlin_code_is_told_of_the_ptx_compile(capability, compiles,
                                                              monkeypatch):
    """vLLM 0.23's Marlin MoE kernels carry code for SM 8.x and 12.x; a
    start elsewhere spends about a minute a kernel compiling their PTX, and
    says so."""
    gm = _module()
    reported = types.SimpleNamespace(major=capability[0], minor=capability[1]) if (
        capability) else None
    monkeypatch.setattr(gm, "current_platform",
                        types.SimpleNamespace(get_device_capability=lambda: reported))
    note = gm.ptx_compile_note("vLLM's Marlin MoE kernels", gm.MARLIN_MOE_CODE_MAJORS)
    if not compiles:
        assert note is None
        return
    assert note.startswith(f"vLLM's Marlin MoE kernels have no code for SM {capability[0]}."
                           f"{capability[1]} in vLLM 0.23's build")
    assert "PTX" in note and "CUDA JIT cache" in note and "CUDA_CACHE_MAXSIZE" in note


@pytest.fixture
def on_cuda(monkeypatch):
    gm = _module()
    platform = types.SimpleNamespace(is_cuda=lambda: True, has_device_capability=lambda c: True)
    monkeypatch.setattr(gm, "current_platform", platform)
    monkeypatch.setattr(gm, "_has_marlin_moe", lambda: True)
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    return gm


# want: (usable, down_on_marlin)
@pytest.mark.parametrize("w13,w2,hidden,inter,dtype,want", [
    ("Q4_K", "Q4_K", 6144, 256, torch.float16, (True, True)),    # GLM-5 TP-8
    ("Q4_K", "Q8_0", 7168, 256, torch.bfloat16, (True, True)),   # DeepSeek-V3.2 TP-8
    ("Q4_0", "Q8_0", 512, 96, torch.float16, (True, True)),      # K of w2 padded to 128
    ("Q4_K", "Q6_K", 6144, 256, torch.float16, (True, False)),   # Q4_K_M: Q6_K has no Marlin format
    ("Q8_0", "IQ4_XS", 6144, 256, torch.float16, (True, False)),
    ("Q4_K", "Q4_K", 6144, 160, torch.float16, (True, False)),   # down rows of 160, not 256s
    ("Q8_0", "Q4_K", 512, 96, torch.float16, (True, False)),     # down rows of 96, not 256s
    ("Q4_K", "F16", 6144, 256, torch.float16, (False, False)),   # no ggml kernel for the down
    ("IQ4_XS", "Q4_K", 6144, 256, torch.float16, (False, True)),
    ("Q4_K", "Q4_K", 6144, 256, torch.float32, (False, True)),
    ("Q8_0", "Q8_0", 512, 48, torch.float16, (False, False)),    # gate/up rows not a multiple of 64
    # rows 320 (gate/up) and 832 (down) at K' 832 and 192: no thread configuration
    ("Q8_0", "Q8_0", 832, 160, torch.float16, (False, False)),
    ("Q8_0", "Q8_0", 896, 160, torch.float16, (True, True)),     # K' 896, rows 896
])
def test_which_layers_run_marlin(on_cuda, w13, w2, hidden, inter, dtype, want):
    assert on_cuda.usable(QType[w13], QType[w2], hidden, inter, dtype) is want[0]
    assert on_cuda.down_on_marlin(QType[w2], hidden, inter) is want[1]


@pytest.mark.parametrize("choice,want", [("series", True), ("ggml", False),
                                         ("upstream", False), ("fused", False)])
def test_vllm_gguf_kernels_choice(on_cuda, monkeypatch, choice, want):
    monkeypatch.setenv("VLLM_GGUF_KERNELS", choice)
    assert on_cuda.usable(QType.Q4_K, QType.Q4_K, 6144, 256, torch.float16) is want


def test_no_marlin_where_the_wheel_lacks_its_kernels(on_cuda, monkeypatch):
    monkeypatch.setattr(on_cuda, "_has_marlin_moe", lambda: False)
    assert not on_cuda.usable(QType.Q4_K, QType.Q4_K, 6144, 256, torch.float16)


def test_no_marlin_without_cuda(monkeypatch):
    gm = _module()
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    if torch.cuda.is_available():
        pytest.skip("checks the CPU answer")
    assert not gm.usable(QType.Q4_K, QType.Q4_K, 6144, 256, torch.float16)


def test_a_layer_off_the_gpu_keeps_its_gguf_blocks(on_cuda):
    """repack_layer leaves a layer whose blocks are not on a CUDA device
    (CPU offload, no GPU) as it was, for gguf_dispatch's kernels."""
    layer, *_ = _layer("Q4_K", "Q4_K", torch.float16, seed=1, device="cpu")
    blocks = layer.w13_qweight
    assert not on_cuda.repack_layer(layer)
    assert layer.w13_qweight is blocks and not hasattr(layer, "gguf_marlin_workspace")


@pytest.mark.parametrize("w2_type,tokens,kernel", [
    ("Q6_K", 3, "vec"), ("Q6_K", 9, "mmq"), ("IQ4_XS", 9, "vec_triton"), ("Q5_K", 12, "float"),
])
def test_down_experts_in_gguf_blocks(w2_type, tokens, kernel, monkeypatch):
    """down_gguf: ggml's vector kernel below moe_mmq_min_tokens, MMQ where
    the type has it (else the series' Triton vector kernel for an imatrix
    type's short rows), the float path from gguf_dispatch's threshold (here
    lowered to 12); rows weighted by the router."""
    from vllm.model_executor.layers.quantization import gguf_dispatch

    gm = _module()
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    monkeypatch.setattr(gguf_dispatch, "MOE_DEQUANT_MIN_TOKENS", 12)
    floats = []
    monkeypatch.setattr(gm, "_down_float", lambda *a: floats.append(a[2]) or "float")
    ops = CpuGgufMoeOps().install(monkeypatch)
    g = torch.Generator().manual_seed(tokens)
    raw, down = random_blocks(w2_type, (E, HIDDEN, INTER), g)
    act = torch.randn(tokens * TOP_K, INTER, generator=g).half()
    topk_ids = torch.rand(tokens, E, generator=g).argsort(-1)[:, :TOP_K].to(torch.int32)
    topk_weights = torch.rand(tokens, TOP_K, generator=g) + 0.1
    out = gm.down_gguf(act, raw, QType[w2_type], topk_weights, topk_ids)
    if kernel == "float":
        assert out == "float" and floats == [QType[w2_type]] and not ops.calls
        return
    assert ops.calls == [(kernel, w2_type)]
    rows = topk_ids.flatten().long()
    ref = torch.stack([down[e] @ a for e, a in zip(rows, act.double())])
    ref *= topk_weights.flatten().double()[:, None]
    assert out.shape == (tokens * TOP_K, HIDDEN) and torch.isfinite(out).all()
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-3, err


# ---------------------------------------------------------------- GPU


def _layer(w13_type, w2_type, dtype, seed, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    r13, v13 = random_blocks(w13_type, (E, 2 * INTER, HIDDEN), g)
    r2, v2 = random_blocks(w2_type, (E, HIDDEN, INTER), g)
    layer = gguf_moe_layer(r13.to(device), QType[w13_type], r2.to(device), QType[w2_type],
                           dtype)
    return layer, v13[:, :INTER], v13[:, INTER:], v2


@pytest.mark.gpu
@pytest.mark.parametrize("w13_type,w2_type,dtype", [
    ("Q4_K", "Q4_K", torch.float16), ("Q8_0", "Q8_0", torch.float16),
    ("Q4_0", "Q4_K", torch.float16), ("Q4_K", "Q8_0", torch.bfloat16),
    ("Q4_K", "Q6_K", torch.float16), ("Q8_0", "IQ4_XS", torch.bfloat16),
])
def test_marlin_layer_matches_fp64(monkeypatch, dtype, w13_type, w2_type):
    from vllm.model_executor.layers.quantization import gguf_dispatch

    gm = _module()
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    layer, gate, up, down = _layer(w13_type, w2_type, dtype, seed=7)
    assert gm.repack_layer(layer)
    assert layer.w13_qweight.dtype == torch.int32
    on_marlin = gm.down_on_marlin(QType[w2_type], HIDDEN, INTER)
    assert layer.w2_qweight.dtype == (torch.int32 if on_marlin else torch.uint8)
    g = torch.Generator().manual_seed(11)
    float_path, ran_float = gm.float_path, []

    def spy(*args):
        ran_float.append(i)
        return float_path(*args)

    monkeypatch.setattr(gm, "float_path", spy)
    # 600: ggml's down kernels give way to the float path; 600 again: one
    # expert a group; then the whole layer on the float path: not
    # from FLOAT_MIN_TOKENS while its float experts take several groups,
    # from FLOAT_MIN_TOKENS_GROUPED; in one group from FLOAT_MIN_TOKENS
    for i, tokens in enumerate((1, 7, 64, 300, 600, 600, 600, 600, 600)):
        if i == 5:
            monkeypatch.setattr(gguf_dispatch, "MOE_DEQUANT_BYTES", 3 * HIDDEN * INTER * 2)
        if i == 6:
            monkeypatch.setattr(gm, "FLOAT_MIN_TOKENS", 512)
            monkeypatch.setattr(gguf_dispatch, "float_measured_faster", lambda: True)
        if i == 7:
            monkeypatch.setattr(gm, "FLOAT_MIN_TOKENS_GROUPED", 512)
        if i == 8:
            monkeypatch.setattr(gm, "FLOAT_MIN_TOKENS_GROUPED", 1 << 30)
            monkeypatch.setattr(gguf_dispatch, "MOE_DEQUANT_BYTES", 3 << 30)
        x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
        topk_ids = torch.rand(tokens, E, generator=g).argsort(-1)[:, :TOP_K].to(torch.int32)
        topk_weights = torch.rand(tokens, TOP_K, generator=g) + 0.1
        ref = moe_reference(x.double(), gate, up, down, topk_weights.double(), topk_ids)
        out = gm.apply(layer, x.cuda(), topk_weights.cuda(), topk_ids.cuda())
        assert out.shape == x.shape and out.dtype == dtype
        assert torch.isfinite(out).all()
        err = ((out.double().cpu() - ref).abs().max() / ref.abs().max()).item()
        # fp16: group scales and partial sums rounded once; bf16 rounds to 8
        # bits; ggml's down kernels round their inputs to 8 bits
        bar = 4e-3 if dtype == torch.float16 else 3e-2
        if not on_marlin and not gguf_dispatch.use_moe_dequant(tokens, QType[w2_type]):
            bar = max(bar, 2e-2)
        assert err < bar, (tokens, err)
    assert ran_float == [7, 8]


@pytest.mark.gpu
@pytest.mark.parametrize("w2_type", ["Q4_K", "Q6_K"])
def test_marlin_layer_in_a_cuda_graph(monkeypatch, w2_type):
    gm = _module()
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    layer, *_ = _layer("Q4_K", w2_type, torch.float16, seed=5)
    assert gm.repack_layer(layer)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, HIDDEN, generator=g).half().cuda()
    ids = torch.rand(16, E, generator=g).argsort(-1)[:, :TOP_K].to(torch.int32).cuda()
    w = (torch.rand(16, TOP_K, generator=g) + 0.1).cuda()
    eager = gm.apply(layer, x, w, ids)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gm.apply(layer, x, w, ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gm.apply(layer, x, w, ids)
    x.copy_(torch.randn(16, HIDDEN, generator=g).half())
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, eager)
    torch.testing.assert_close(out, gm.apply(layer, x, w, ids), rtol=0, atol=0)


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_is_gptqs_for_the_repack_op(bits):
    """The operand of gptq_marlin_repack is GPTQ's packing (vLLM's own
    gptq_pack): consecutive K values in an int32, low bits first."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import gptq_pack

    gm = _module()
    g = torch.Generator().manual_seed(bits)
    n, k = 64, 128
    q = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.int32)
    want = gptq_pack(q.t().contiguous(), bits, k, n)
    assert torch.equal(gm._pack_k(q, bits), want.to(torch.int32))
