# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's compiled ops on the fp16 DSA serving path, in float16 (bfloat16 as a
control), against float64 references on the same inputs.

Checked (outputs poisoned with NaN where the op writes into a given buffer):
- ggml_dequantize: Q4_0 Q8_0 Q2_K..Q6_K IQ4_XS blocks, against gguf-py.
- ggml_mul_mat_vec_a8 / ggml_mul_mat_a8: GGUF linear, decode and prefill.
- ggml_moe_a8 (with moe_align_block_size) / ggml_moe_a8_vec: GGUF experts.
- moe_sum (_moe_C): top-k 2-4 run the kernel, 8 falls back to at::sum_out.
- grouped_topk (_moe_C): sigmoid + e_score_correction_bias, DSV3/GLM-5 groups.
- topk_sigmoid (_moe_C): the router when grouping does not apply.
- rms_norm / fused_add_rms_norm: vectorized and scalar widths, strided input.
- rotary_embedding: MLA (GPT-J) and indexer (NeoX and GPT-J) q/k views.
- silu_and_mul: vectorized (incl. >128 tokens) and scalar widths.
- per_token_group_fp8_quant: the indexer's q, 128-groups, ue8m0 scales.
- concat_and_cache_mla ("auto" cache) and concat_mla_q: bit-exact copies.

Not covered:
- indexer_k_quant_and_cache: fixed and tested with its own change.
- cp_gather_indexer_k_quant_cache, top_k_per_row_prefill/decode,
  persistent_topk, moe_align_block_size alone: no fp16/bf16 operand (uint8
  cache, fp32 logits, int32 ids), so the model dtype cannot reach them.
- apply_repetition_penalties_: the sampler casts logits to fp32 first.
- dsv3_router_gemm / fp32_router_gemm: gated to SM90/SM100 and fixed shapes,
  never SM120; the GGUF gate is an F.linear.
- fp8 KV-cache variants of concat_and_cache_mla (incl. fp8_ds_mla):
  TRITON_MLA_SPARSE rejects quantized KV caches.
- flashinfer rope and the Triton kernels (fused_moe, sparse MLA, indexer):
  not vLLM compiled ops; the Triton ones have their own tests.
"""

import gguf
import pytest
import torch
from vllm import _custom_ops as ops

# Byte offsets of each block's fp16 scale fields (d, dmin), per gguf-py.
from support.gguf_moe_ref import F16_FIELDS

DTYPES = [torch.float16, torch.bfloat16]
FP8 = torch.float8_e4m3fn
MMQ_TYPES = ["Q4_0", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
MMVQ_TYPES = MMQ_TYPES + ["IQ4_XS"]


def eps(dtype):
    return torch.finfo(dtype).eps


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, g, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(dtype).cuda()


def nan_like(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def close(out, ref, rtol, atol):
    # assert_close rejects NaN in `out` unless `ref` has it there too.
    torch.testing.assert_close(out.double(), ref.double(), rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------
# GGUF (fp16-only in serving: vLLM's GGUF path refuses bf16)
# ---------------------------------------------------------------------------


def gguf_weight(name, shape, g):
    """Random blocks with sane fp16 scales: (raw uint8 [..., bytes], fp64
    dequantized [..., cols] from gguf-py)."""
    qt = gguf.GGMLQuantizationType[name]
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    *lead, cols = shape
    nblk = cols // bs
    for n in lead:
        nblk *= n
    raw = torch.randint(0, 256, (nblk, ts), dtype=torch.uint8, generator=g)
    for off in F16_FIELDS[name]:
        d = (torch.rand(nblk, generator=g) * 8e-3 + 2e-3).half()
        raw[:, off : off + 2] = d.view(torch.uint8).view(nblk, 2)
    raw = raw.reshape(*lead, cols // bs * ts)
    deq = gguf.quants.dequantize(raw.numpy(), qt)
    return raw.cuda(), torch.from_numpy(deq).double().cuda()


def q8_1(x):
    """x as the a8 kernels see it: 32-blocks scaled to int8 by amax/127,
    the scale kept as fp16."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.round(xb / d.clamp_min(1e-30))
    return (q * d.half().float()).double().reshape(x.shape)


# Bytes after the scales: zeroing them leaves each 32-block's constant
# offset (-8d for Q4_0, -dmin*m for Q4_K/Q5_K).
QUANT_BYTES = {"Q4_0": 2, "Q4_K": 16, "Q5_K": 16}


def a8_ref(x, raw, w, name, mmq):
    """x @ w.T as the a8 kernels compute it. Q4_0 (always) and Q4_K/Q5_K (in
    the MMQ kernels) apply the block offset to the unquantized x block sum."""
    if name != "Q4_0" and not (mmq and name in QUANT_BYTES):
        return q8_1(x) @ w.transpose(-1, -2)
    qt = gguf.GGMLQuantizationType[name]
    zeroed = raw.cpu().clone()
    zeroed.view(-1, gguf.GGML_QUANT_SIZES[qt][1])[:, QUANT_BYTES[name] :] = 0
    off = torch.from_numpy(gguf.quants.dequantize(zeroed.numpy(), qt)).double()
    off = off.to(w.device)
    return q8_1(x) @ (w - off).transpose(-1, -2) + x.double() @ off.transpose(-1, -2)


def a8_tol(dtype):
    # x is quantized identically in the reference, so what is left is fp32
    # accumulation order, the output rounding and rare roundf ties.
    return (4e-3, 4e-3) if dtype == torch.float16 else (2e-2, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MMVQ_TYPES)
def test_ggml_dequantize(name, dtype):
    raw, ref = gguf_weight(name, (96, 768), gen(1))
    out = ops.ggml_dequantize(raw, int(gguf.GGMLQuantizationType[name]), 96, 768, dtype)
    assert out.dtype == dtype and out.shape == (96, 768)
    # K-quants dequantize in half arithmetic (d*sc, dmin*m rounded to fp16);
    # bf16 output is that half value rounded again.
    rtol = 4e-3 if dtype == torch.float16 else 1.6e-2
    close(out, ref, rtol, rtol * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MMVQ_TYPES)
@pytest.mark.parametrize("vecs", [1, 3])
def test_ggml_mul_mat_vec_a8(name, vecs, dtype):
    g = gen(2)
    raw, w = gguf_weight(name, (256, 768), g)
    x = randn((vecs, 768), dtype, g)
    out = ops.ggml_mul_mat_vec_a8(raw, x, int(gguf.GGMLQuantizationType[name]), 256)
    ref = a8_ref(x, raw, w, name, mmq=False)
    rtol, a = a8_tol(dtype)
    close(out, ref, rtol, a * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MMQ_TYPES)
@pytest.mark.parametrize("batch", [17, 70])
def test_ggml_mul_mat_a8(name, batch, dtype):
    g = gen(3)
    raw, w = gguf_weight(name, (256, 768), g)
    x = randn((batch, 768), dtype, g)
    out = ops.ggml_mul_mat_a8(raw, x, int(gguf.GGMLQuantizationType[name]), 256)
    ref = a8_ref(x, raw, w, name, mmq=True)
    rtol, a = a8_tol(dtype)
    close(out, ref, rtol, a * ref.abs().max().item())


def distinct_topk_ids(t, e, k, g):
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()


def moe_ref(x, raw, w, name, ids, mmq):
    # Row t*k+j of the output is token t through expert ids[t, j].
    every = a8_ref(x, raw, w, name, mmq).transpose(0, 1)  # [T, E, N]
    picked = every.gather(1, ids.long()[..., None].expand(-1, -1, w.shape[1]))
    return picked.reshape(-1, w.shape[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MMQ_TYPES)
def test_ggml_moe_a8(name, dtype):
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import (
        moe_align_block_size,
    )

    g = gen(4)
    e, n, k, t, topk = 8, 256, 768, 70, 4
    raw, w = gguf_weight(name, (e, n, k), g)
    x = randn((t, k), dtype, g)
    ids = distinct_topk_ids(t, e, topk, g).cuda()
    qt = int(gguf.GGMLQuantizationType[name])
    sorted_ids, expert_ids, n_post = moe_align_block_size(
        ids, ops.ggml_moe_get_block_size(qt), e
    )
    out = ops.ggml_moe_a8(x, raw, sorted_ids, expert_ids, n_post, qt, n, topk, t)
    ref = moe_ref(x, raw, w, name, ids, mmq=True)
    rtol, a = a8_tol(dtype)
    close(out, ref, rtol, a * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MMVQ_TYPES)
def test_ggml_moe_a8_vec(name, dtype):
    g = gen(5)
    e, n, k, t, topk = 8, 256, 768, 3, 4
    raw, w = gguf_weight(name, (e, n, k), g)
    x = randn((t, k), dtype, g)
    ids = distinct_topk_ids(t, e, topk, g).cuda()
    qt = int(gguf.GGMLQuantizationType[name])
    out = ops.ggml_moe_a8_vec(x, raw, ids, topk, qt, n, t)
    ref = moe_ref(x, raw, w, name, ids, mmq=False)
    rtol, a = a8_tol(dtype)
    close(out, ref, rtol, a * ref.abs().max().item())


# ---------------------------------------------------------------------------
# MoE routing and reduction
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("topk", [2, 3, 4, 8])
def test_moe_sum(topk, dtype):
    g = gen(6)
    x = randn((13, topk, 1000), dtype, g)
    out = nan_like((13, 1000), dtype)
    ops.moe_sum(x, out)
    # The kernel accumulates in the element type: each add rounds by at most
    # half an ulp of a partial sum, itself at most sum(|x|).
    err = (out.double() - x.double().sum(1)).abs()
    assert (err <= topk * eps(dtype) / 2 * x.double().abs().sum(1)).all()


def routing_case(t, e, n_group, topk_group, topk, dtype, g):
    """Logits whose biased top-k is unambiguous and differs from the
    unbiased one: winners are even experts (bias +0.3, sigmoid 0.6-0.9),
    decoys odd experts (bias -0.3, sigmoid 0.9-0.98), the rest below 0.3.
    Winners sit topk // topk_group to a group in topk_group groups."""
    bias = torch.where(torch.arange(e) % 2 == 0, 0.3, -0.3).float()
    s = torch.rand(t, e, generator=g) * 0.25 + 0.05
    per_group = e // n_group
    winners = []
    for row in range(t):
        picked = []
        for grp in torch.randperm(n_group, generator=g)[:topk_group].tolist():
            evens = torch.arange(grp * per_group, (grp + 1) * per_group, 2)
            perm = torch.randperm(len(evens), generator=g)
            picked += evens[perm[: topk // topk_group]].tolist()
        s[row, picked] = torch.rand(len(picked), generator=g) * 0.3 + 0.6
        decoys = torch.arange(1, e, 2)[torch.randperm(e // 2, generator=g)[:4]]
        s[row, decoys] = torch.rand(4, generator=g) * 0.08 + 0.9
        winners.append(sorted(picked))
    logits = torch.logit(s.double()).to(dtype).cuda()
    return logits, bias.cuda(), torch.tensor(winners)


def check_routing(weights, ids, logits, winners, scale, rtol):
    order = ids.long().sort(-1)
    assert torch.equal(order.values.cpu(), winners)
    s = logits.double().sigmoid().gather(1, order.values)
    ref = s / s.sum(-1, keepdim=True) * scale
    close(weights.gather(1, order.indices), ref, rtol, 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_group,topk_group", [(8, 4), (1, 1)], ids=["dsv3", "glm5"])
@pytest.mark.parametrize("t", [1, 37])
def test_grouped_topk(t, n_group, topk_group, dtype):
    logits, bias, winners = routing_case(t, 256, n_group, topk_group, 8, dtype, gen(7))
    weights, ids = ops.grouped_topk(logits, n_group, topk_group, 8, True, 2.5, bias, 1)
    # The kernel rounds sigmoid to the element type before normalising.
    check_routing(weights, ids, logits, winners, 2.5, 3 * eps(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 37])
def test_topk_sigmoid(t, dtype):
    logits, bias, winners = routing_case(t, 256, 1, 1, 8, dtype, gen(8))
    weights = nan_like((t, 8), torch.float32)
    ids = torch.full((t, 8), -1, dtype=torch.int32, device="cuda")
    token_expert = torch.full_like(ids, -1)
    ops.topk_sigmoid(weights, ids, token_expert, logits, True, bias)
    # Sigmoid in fp32 from the element-type logits: float rounding only.
    check_routing(weights, ids, logits, winners, 1.0, 1e-5)


# ---------------------------------------------------------------------------
# Norms, rope, activation
# ---------------------------------------------------------------------------


def rms_ref(x, w, eps_, dtype):
    # The kernels round x * rsqrt(var) to the element type, then times w.
    xf = x.double()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps_)).to(dtype)
    return (normed.double() * w.double()).to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hidden,width", [(6144, None), (7168, None), (4099, None), (512, 576)]
)
@pytest.mark.parametrize("t", [1, 33])
def test_rms_norm(t, hidden, width, dtype):
    g = gen(9)
    # width: kv_a_layernorm normalises the first 512 of each 576-wide row.
    base = randn((t, width or hidden), dtype, g, 3.0)
    x = base[:, :hidden]
    w = randn((hidden,), dtype, g) + 1
    out = nan_like((t, hidden), dtype)
    ops.rms_norm(out, x, w, 1e-6)
    # Two roundings, each may land an ulp off after rsqrtf: margin of three.
    close(out, rms_ref(x, w, 1e-6, dtype), 3 * eps(dtype), 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [6144, 7168, 4099])
@pytest.mark.parametrize("t", [1, 33])
def test_fused_add_rms_norm(t, hidden, dtype):
    g = gen(10)
    x = randn((t, hidden), dtype, g, 3.0)
    res = randn((t, hidden), dtype, g, 3.0)
    w = randn((hidden,), dtype, g) + 1
    new_res = (x.double() + res.double()).to(dtype)
    ref = rms_ref(new_res, w, 1e-6, dtype)
    ops.fused_add_rms_norm(x, res, w, 1e-6)
    # The sum is stored rounded to the element type: half an ulp.
    close(res, new_res, eps(dtype), 0.0)
    close(x, ref, 3 * eps(dtype), 1e-5)


def cos_sin_cache(max_pos, rot, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    f = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv
    # 1.2: a yarn mscale, so entries exceed 1.
    return (torch.cat([f.cos(), f.sin()], -1) * 1.2).to(dtype).cuda()


def rope_ref(x, pos, cache, neox):
    cos, sin = cache[pos].double().chunk(2, -1)
    cos, sin = cos[:, None], sin[:, None]
    x = x.double()
    if neox:
        x1, x2 = x.chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_fp32", [False, True])
@pytest.mark.parametrize(
    "layout,neox",
    [("mla", False), ("indexer", True), ("indexer", False)],
)
@pytest.mark.parametrize("t", [1, 37])
def test_rotary_embedding(t, layout, neox, cache_fp32, dtype):
    g = gen(11)
    cache = cos_sin_cache(4096, 64, torch.float32 if cache_fp32 else dtype)
    pos = torch.randint(0, 4096, (t,), generator=g).cuda()
    if layout == "mla":
        # q [T, H, 192] rotates [..., 128:]; k_pe is [:, 512:] of kv_a's rows.
        q = randn((t, 8, 192), dtype, g)
        k = randn((t, 576), dtype, g)
        q_pe, k_pe = q[..., 128:], k[:, 512:].unsqueeze(1)
    else:
        # Indexer: q [T, 64, 128] and k [T, 128] rotate their first 64.
        q = randn((t, 64, 128), dtype, g)
        k = randn((t, 128), dtype, g)
        q_pe, k_pe = q[..., :64], k[:, :64].unsqueeze(1)
    q_ref, k_ref = q.double().clone(), k.double().clone()
    q_ref_pe = q_ref[..., 128:] if layout == "mla" else q_ref[..., :64]
    k_ref_pe = k_ref[:, 512:] if layout == "mla" else k_ref[:, :64]
    q_ref_pe.copy_(rope_ref(q_pe, pos, cache, neox))
    k_ref_pe.copy_(rope_ref(k_pe, pos, cache, neox)[:, 0])
    ops.rotary_embedding(pos, q_pe, k_pe, 64, cache, neox)
    # fp32 math, one rounding; atol for fp32 error where terms cancel. The
    # parts outside the views must come back untouched.
    close(q, q_ref, eps(dtype), 1e-5)
    close(k, k_ref, eps(dtype), 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [2048, 1001])
@pytest.mark.parametrize("t", [7, 200])
def test_silu_and_mul(t, d, dtype):
    x = randn((t, 2 * d), dtype, gen(12), 3.0)
    out = nan_like((t, d), dtype)
    torch.ops._C.silu_and_mul(out, x)
    gate, up = x.double().chunk(2, -1)
    # silu is rounded to the element type before the product, as the kernel;
    # expf may move either rounding by an ulp.
    ref = ((gate * gate.sigmoid()).to(dtype).double() * up).to(dtype)
    close(out, ref, 3 * eps(dtype), 1e-5)


# ---------------------------------------------------------------------------
# Indexer q quantization, MLA cache and q
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 3, 37])
def test_per_token_group_fp8_quant(t, dtype):
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        per_token_group_quant_fp8,
    )

    g = gen(13)
    # Group magnitudes spread over 1e-3..1e3 to exercise the scale range.
    mag = 10 ** (torch.rand(t, 64, 1, generator=g) * 6 - 3)
    x = (torch.randn(t, 64, 128, generator=g) * mag).to(dtype).cuda()
    x = x.view(t, 64 * 128)
    out_q = torch.full(x.shape, float("nan"), device="cuda").to(FP8)
    q, s = per_token_group_quant_fp8(x, 128, out_q=out_q, use_ue8m0=True)
    amax = x.float().view(t, 64, 128).abs().amax(-1).clamp_min(1e-10)
    s_ref = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q_ref = (x.float().view(t, 64, 128) / s_ref[..., None]).clamp(-448, 448).to(FP8)
    # Power-of-two scales make the division exact: bit-equal results.
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(t, -1).view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 37])
def test_concat_and_cache_mla(t, dtype):
    g = gen(14)
    blocks, block_size = 4, 64
    kv_c = randn((t, 512), dtype, g)
    kv_a = randn((t, 576), dtype, g)
    k_pe = kv_a[:, 512:]  # strided, as split from kv_a's output
    slots = torch.randperm(blocks * block_size, generator=g)[:t].cuda()
    slots[t // 2] = -1  # a padded token writes nothing
    cache = nan_like((blocks, block_size, 576), dtype)
    scale = torch.ones(1, dtype=torch.float32, device="cuda")
    ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, "auto", scale)
    rows = cache.view(-1, 576)
    keep = slots >= 0
    want = torch.cat([kv_c, k_pe], -1)[keep]
    assert torch.equal(rows[slots[keep]].view(torch.int16), want.view(torch.int16))
    untouched = torch.ones(rows.shape[0], dtype=torch.bool, device="cuda")
    untouched[slots[keep]] = False
    assert rows[untouched].isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 8), (37, 16), (5, 128)])
def test_concat_mla_q(t, h, dtype):
    g = gen(15)
    # ql_nope as the W_UK bmm leaves it: [H, T, 512] transposed to [T, H, 512].
    ql_nope = randn((h, t, 512), dtype, g).transpose(0, 1)
    q_pe = randn((t, h, 192), dtype, g)[..., 128:]
    out = nan_like((t, h, 576), dtype)
    ops.concat_mla_q(ql_nope, q_pe, out)
    want = torch.cat([ql_nope, q_pe], -1)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
