# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Triton DSA indexer (patch 0005): MQA logits (ragged prefill, paged decode)
and the torch top-k fallback, against fp64 references.

CPU: runs the kernels under TRITON_INTERPRET=1 at small sizes, checks that
bad arguments raise ValueError/TypeError naming the argument, and AOT-
compiles every shipped tile config for sm_120/sm_121 (and the fp8->fp16
path for sm_86; tests/support/aot.py) to keep shared memory within
101,376 B.
GPU (`-m gpu`): larger shapes, plus DeepGEMM side by side where it runs.
"""


import pytest
import torch
import triton
from vllm.v1.attention.ops import triton_dsa_indexer as tdi

from support.aot import SM120_MAX_SHARED_BYTES, dsa_indexer_kernels, run_aot_script
from support.indexer_ref import ref_logits
from support.peers import load_deep_gemm

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0

def window_mask(starts, ends, n):
    col = torch.arange(n, device=starts.device)
    return (col[None, :] >= starts[:, None].long()) & (
        col[None, :] < ends[:, None].long()
    )


def quant_k_per_token(k):
    """Per-token fp8 e4m3 quantization as indexer_k_quant_and_cache does it
    (quant_block_size == head_dim, fp32 scale = max(amax, 1e-4) / 448)."""
    scale = k.float().abs().amax(-1).clamp_min(1e-4) / FP8_MAX
    k8 = (k.float() / scale[:, None]).to(FP8)
    return k8, scale


def write_indexer_cache(cache, k8, k_scale, slots):
    """Scatter tokens into a [num_blocks, block_size, D + 4] uint8 cache with
    the byte layout of csrc indexer_k_quant_and_cache_kernel: per block,
    block_size*D fp8 bytes (token-major), then block_size fp32 scales."""
    num_blocks, block_size, width = cache.shape
    d = width - 4
    flat = cache.view(num_blocks, block_size * width)
    for i, slot in enumerate(slots.tolist()):
        blk, off = divmod(slot, block_size)
        flat[blk, off * d : (off + 1) * d] = k8[i].view(torch.uint8)
        s0 = block_size * d + off * 4
        flat[blk, s0 : s0 + 4] = k_scale[i : i + 1].view(torch.uint8)


def rand_fp8(shape, device, amp=3.0):
    return (torch.randn(shape, device=device) * amp).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------
# Ragged prefill logits
# ---------------------------------------------------------------------------


def make_windows(t, s, device, gen):
    ks = torch.randint(0, s, (t,), generator=gen, dtype=torch.int32)
    lens = torch.randint(0, s, (t,), generator=gen, dtype=torch.int32)
    ke = torch.minimum(ks + lens, torch.tensor(s, dtype=torch.int32))
    ke[0] = ks[0]  # empty window
    if t > 2:
        ks[1], ke[1] = 0, s  # full window
    if t > 3:
        ke[2] = max(int(ks[2]) - 1, 0)  # ke < ks: empty as well
    return ks.to(device), ke.to(device)


@pytest.mark.parametrize("upcast", [False, True], ids=["fp8", "fp8->fp16"])
@pytest.mark.parametrize("t,h,s", [(13, 32, 300), (6, 5, 130)])
def test_mqa_logits_ragged(upcast, t, h, s):
    device = "cpu"
    gen = torch.Generator().manual_seed(1000 * t + h)
    torch.manual_seed(1000 * t + h)
    d = 128
    q = rand_fp8((t, h, d), device)
    k8, k_scale = quant_k_per_token(torch.randn(s, d, device=device))
    w = torch.randn(t, h, device=device)
    ks, ke = make_windows(t, s, device, gen)

    ref = ref_logits(q, k8, k_scale, w)
    mask = window_mask(ks, ke, s)

    # clean_logits=True: -inf exactly outside the window.
    out = torch.full((t, s), float("nan"), device=device)
    tdi.fp8_mqa_logits(
        q, (k8, k_scale), w, ks, ke, clean_logits=True, out=out, upcast=upcast
    )
    assert not out.isnan().any()
    assert torch.equal(torch.isneginf(out), ~mask)
    assert rel_err(out[mask], ref[mask]) < 1e-5

    # clean_logits=False (what vLLM passes): window written, the rest untouched.
    out2 = torch.full((t, s), float("nan"), device=device)
    tdi.fp8_mqa_logits(
        (q, None),
        (k8, k_scale[:, None]),
        w,
        ks,
        ke,
        clean_logits=False,
        out=out2,
        upcast=upcast,
    )
    assert out2[~mask].isnan().all()
    assert torch.isfinite(out2[mask]).all()
    assert rel_err(out2[mask], ref[mask]) < 1e-5


def test_row_major_dot_variant():
    """The q @ k^T orientation (KV_MAJOR=False) computes the same logits."""
    torch.manual_seed(7)
    gen = torch.Generator().manual_seed(7)
    t, h, d, s = 5, 32, 128, 150
    q = rand_fp8((t, h, d), "cpu")
    k8, k_scale = quant_k_per_token(torch.randn(s, d))
    w = torch.randn(t, h)
    ks, ke = make_windows(t, s, "cpu", gen)
    cfg = tdi.PrefillConfig(2, 32, 2, 4, 1, KV_MAJOR=False)
    out = tdi.fp8_mqa_logits(q, (k8, k_scale), w, ks, ke, config=cfg)
    mask = window_mask(ks, ke, s)
    ref = ref_logits(q, k8, k_scale, w)
    assert torch.equal(torch.isneginf(out), ~mask)
    assert rel_err(out[mask], ref[mask]) < 1e-5

    q, cache, w, ctx, bt, ref = build_paged_case(2, 2, 32, d, 16, 100, True, seed=8)
    dcfg = tdi.DecodeConfig(4, 1, 2, KV_MAJOR=False)
    out = tdi.fp8_paged_mqa_logits(q, cache, w, ctx, bt, None, 100, config=dcfg)
    valid = torch.isfinite(ref)
    assert torch.equal(torch.isneginf(out), ~valid)
    assert rel_err(out[valid], ref[valid]) < 1e-5


def test_mqa_logits_rejects_fp4():
    q = torch.zeros(2, 32, 64, dtype=torch.uint8)
    with pytest.raises(NotImplementedError):
        tdi.fp8_mqa_logits((q, q), (q[0], q[0]), None, None, None)


# ---------------------------------------------------------------------------
# Paged decode logits
# ---------------------------------------------------------------------------


def build_paged_case(
    b, next_n, h, d, block_size, max_model_len, ctx_2d, seed, device="cpu"
):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    max_blocks = triton.cdiv(max_model_len, block_size)
    ctx = torch.randint(next_n, max_model_len + 1, (b,), generator=gen)
    ctx[0] = next_n - 1  # row 0 of request 0 sees no keys at all
    if b > 1:
        ctx[1] = max_model_len
    num_blocks = b * max_blocks + 3
    # Shuffled physical blocks; unused cache bytes are 0xFF (fp8 NaN, fp32 NaN)
    # so a read from the wrong place shows up as NaN.
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = perm[: b * max_blocks].view(b, max_blocks).to(torch.int32)
    cache = torch.full((num_blocks, block_size, d + 4), 0xFF, dtype=torch.uint8)
    keys = []
    for i in range(b):
        n = int(ctx[i])
        k8, k_scale = quant_k_per_token(torch.randn(n, d))
        pos = torch.arange(n)
        slots = block_table[i, pos // block_size].long() * block_size + pos % block_size
        write_indexer_cache(cache, k8, k_scale, slots)
        keys.append((k8, k_scale))
    q = rand_fp8((b, next_n, h, d), "cpu")
    w = torch.randn(b * next_n, h)
    if ctx_2d:
        ctx_arg = (ctx[:, None] - next_n + 1 + torch.arange(next_n)[None, :]).to(
            torch.int32
        )
    else:
        ctx_arg = ctx.to(torch.int32)
    # Reference: [B*next_n, max_model_len], -inf past each row's context.
    ref = torch.full((b * next_n, max_model_len), float("-inf"), dtype=torch.float64)
    for i in range(b):
        k8, k_scale = keys[i]
        full = ref_logits(q[i], k8, k_scale, w[i * next_n : (i + 1) * next_n])
        for j in range(next_n):
            n = int(ctx[i]) - next_n + j + 1
            ref[i * next_n + j, :n] = full[j, :n]
    to = lambda x: x.to(device)  # noqa: E731
    return to(q), to(cache), to(w), to(ctx_arg), to(block_table), to(ref)


@pytest.mark.parametrize("upcast", [False, True], ids=["fp8", "fp8->fp16"])
@pytest.mark.parametrize(
    "next_n,ctx_2d,h,block_size",
    [(1, False, 32, 64), (2, True, 32, 64), (2, False, 32, 16), (3, True, 7, 16)],
)
def test_paged_mqa_logits(upcast, next_n, ctx_2d, h, block_size):
    b, d, max_model_len = 3, 128, 200
    q, cache, w, ctx, bt, ref = build_paged_case(
        b, next_n, h, d, block_size, max_model_len, ctx_2d, seed=17 * next_n + h
    )
    valid = torch.isfinite(ref)

    out = torch.full((b * next_n, max_model_len), float("nan"))
    tdi.fp8_paged_mqa_logits(
        q,
        cache.unsqueeze(-2),
        w,
        ctx,
        bt,
        None,
        max_model_len,
        clean_logits=False,
        out=out,
        upcast=upcast,
    )
    assert out[~valid].isnan().all(), "wrote past a row's context"
    assert torch.isfinite(out[valid]).all()
    assert rel_err(out[valid], ref[valid]) < 1e-5

    out2 = tdi.fp8_paged_mqa_logits(
        (q, None),
        cache,
        w,
        ctx,
        bt,
        None,
        max_model_len,
        clean_logits=True,
        upcast=upcast,
    )
    assert torch.equal(torch.isneginf(out2), ~valid)
    assert rel_err(out2[valid], ref[valid]) < 1e-5


@pytest.mark.parametrize("upcast", [False, True], ids=["fp8", "fp8->fp16"])
def test_paged_mqa_logits_masks_block_ids_outside_the_cache(upcast):
    """Block ids < 0 or >= the cache's block count: never read, their keys
    score -inf; every other key as the reference. The blocks past the real
    cache are NaN bytes (0xFF), so a read of them would show."""
    b, next_n, h, d, block_size, max_model_len = 2, 1, 8, 128, 16, 96
    q, cache, w, ctx, bt, ref = build_paged_case(
        b, next_n, h, d, block_size, max_model_len, False, seed=29)
    real = cache.shape[0]
    padded = torch.cat([cache, torch.full_like(cache, 0xFF)])[:real + 4]
    view = padded[:real]  # the kernel sees `real` blocks; 4 NaN blocks follow
    bt = bt.clone()
    bt[0, 1], bt[1, 0] = real + 2, -3
    out = tdi.fp8_paged_mqa_logits(q, view, w, ctx, bt, None, max_model_len,
                                   clean_logits=True, upcast=upcast)
    assert not out.isnan().any()
    bad = torch.zeros_like(ref, dtype=torch.bool)
    bad[0, block_size : 2 * block_size] = True
    bad[1, :block_size] = True
    valid = torch.isfinite(ref) & ~bad
    assert torch.isneginf(out[bad]).all()
    assert torch.equal(torch.isneginf(out), ~valid)
    assert rel_err(out[valid], ref[valid]) < 1e-5


def test_paged_mqa_logits_cuts_contexts_to_the_logits_row():
    """A context past max_model_len (the logits' width) is cut to it: not
    written into the next row, no page past the block table's row read."""
    b, next_n, h, d, block_size, max_model_len = 3, 1, 4, 128, 16, 64
    q, cache, w, ctx, bt, ref = build_paged_case(
        b, next_n, h, d, block_size, max_model_len, False, seed=31)
    ctx = ctx.clone()
    ctx[1] = max_model_len + 3 * block_size  # ref row 1: the full width
    ctx[2] = 5  # row 2 keeps its first 5 keys
    out = torch.full((b * next_n, max_model_len), float("nan"))
    tdi.fp8_paged_mqa_logits(q, cache, w, ctx, bt, None, max_model_len,
                             clean_logits=False, out=out)
    assert rel_err(out[1], ref[1]) < 1e-5
    assert rel_err(out[2, :5], ref[2, :5]) < 1e-5
    assert out[2, 5:].isnan().all(), "row 1 wrote into row 2"


# ---------------------------------------------------------------------------
# Top-k fallback
# ---------------------------------------------------------------------------


def assert_topk_matches(idx, ref_vals, starts, ends, topk):
    """idx: [rows, topk] relative indices from the kernel/fallback; ref_vals:
    [rows, N] fp64 reference logits. Equal sets up to ties at the k-th value."""
    for r in range(idx.shape[0]):
        st, en = int(starts[r]), max(int(ends[r]), int(starts[r]))
        n = en - st
        row = idx[r].long()
        if n <= topk:
            assert sorted(row[:n].tolist()) == list(range(n)), r
            assert (row[n:] == -1).all(), r
            continue
        assert (row >= 0).all() and (row < n).all(), r
        assert row.unique().numel() == topk, f"row {r}: duplicates"
        vals = ref_vals[r, st:en]
        kth = torch.topk(vals, topk).values[-1]
        chosen = vals[row]
        tol = 1e-6 * vals.abs().max()
        assert (chosen >= kth - tol).all(), r
        # Everything strictly above the threshold must be chosen.
        must = (vals > kth + tol).nonzero().flatten()
        assert torch.isin(must, row).all(), r


@pytest.mark.parametrize("topk", [37, 64])
def test_topk_prefill_fallback(topk):
    gen = torch.Generator().manual_seed(topk)
    rows, n = 11, 150
    logits = torch.randn(rows, n, generator=gen)
    ks, ke = make_windows(rows, n, "cpu", gen)
    ke[3], ks[3] = 20, 10  # short row (< topk)
    ks[4], ke[4] = 5, 5 + topk  # exactly topk long
    # Garbage outside the windows must not matter (vLLM passes clean=False).
    logits[~window_mask(ks, ke, n)] = float("nan")
    # A padded, strided logits buffer as DeepGEMM may return.
    buf = torch.full((rows, n + 7), float("nan"))
    buf[:, :n] = logits
    view = buf[:, :n]
    out = torch.full((rows, topk + 5), -7, dtype=torch.int32)
    tdi.top_k_per_row_prefill(
        view, ks, ke, out, rows, view.stride(0), view.stride(1), topk
    )
    assert (out[:, topk:] == -7).all()
    ref_vals = torch.nan_to_num(logits.double(), nan=float("-inf"))
    assert_topk_matches(out[:, :topk], ref_vals, ks, ke, topk)


def test_topk_fallback_never_leaves_the_window():
    """A row longer than topk with fewer finite logits than topk (keys of
    masked blocks score -inf): its picks stay inside the window, the rest
    are -1."""
    rows, n, topk = 3, 64, 16
    logits = torch.full((rows, n), float("-inf"))
    ks = torch.tensor([0, 10, 30], dtype=torch.int32)
    ke = torch.tensor([40, 50, 64], dtype=torch.int32)
    finite = {0: [3, 7], 1: [12, 20, 49], 2: []}
    for r, cols in finite.items():
        logits[r, cols] = torch.arange(len(cols), dtype=torch.float32)
    out = torch.full((rows, topk), -7, dtype=torch.int32)
    tdi.top_k_per_row_prefill(logits, ks, ke, out, rows, n, 1, topk)
    for r, cols in finite.items():
        got = out[r].tolist()
        want = sorted(c - int(ks[r]) for c in cols)
        assert sorted(i for i in got if i != -1) == want, (r, got)
        assert got.count(-1) == topk - len(cols), (r, got)


@pytest.mark.parametrize("seq_2d", [False, True])
def test_topk_decode_fallback(seq_2d):
    gen = torch.Generator().manual_seed(5)
    b, next_n, width, topk = 4, 2, 160, 40
    seq = torch.tensor([1, 30, 160, 97], dtype=torch.int32)
    logits = torch.randn(b * next_n, width, generator=gen)
    row_end = (seq[:, None] - next_n + 1 + torch.arange(next_n)[None, :]).clamp_min(0)
    seq_arg = row_end.to(torch.int32) if seq_2d else seq
    lens = row_end.flatten()
    logits[torch.arange(width)[None, :] >= lens[:, None]] = float("nan")
    out = torch.full((b * next_n, topk), -7, dtype=torch.int32)
    tdi.top_k_per_row_decode(
        logits,
        next_n,
        seq_arg,
        out,
        b * next_n,
        logits.stride(0),
        logits.stride(1),
        topk,
    )
    ref_vals = torch.nan_to_num(logits.double(), nan=float("-inf"))
    assert_topk_matches(out, ref_vals, torch.zeros_like(lens), lens, topk)


def test_logits_then_topk_end_to_end():
    """Kernel logits -> fallback top-k picks the fp64 reference's top-k."""
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    t, h, d, s, topk = 8, 32, 128, 256, 48
    q = rand_fp8((t, h, d), "cpu")
    k8, k_scale = quant_k_per_token(torch.randn(s, d))
    w = torch.randn(t, h)
    ks, ke = make_windows(t, s, "cpu", gen)
    logits = tdi.fp8_mqa_logits(q, (k8, k_scale), w, ks, ke, clean_logits=False)
    out = torch.empty(t, topk, dtype=torch.int32)
    tdi.top_k_per_row_prefill(logits, ks, ke, out, t, logits.stride(0), 1, topk)
    ref = ref_logits(q, k8, k_scale, w)
    # Tie tolerance covers fp32 accumulation vs fp64.
    assert_topk_matches(out, ref, ks, ke, topk)


# ---------------------------------------------------------------------------
# Argument checks: ValueError/TypeError naming the argument
# ---------------------------------------------------------------------------


def _prefill_args(case):
    t, h, d, s = 3, 4, 64, 20
    q = rand_fp8((t, h, d), "cpu")
    k8, k_scale = quant_k_per_token(torch.randn(s, d))
    w = torch.randn(t, h)
    ks = torch.zeros(t, dtype=torch.int32)
    ke = torch.full((t,), s, dtype=torch.int32)
    out = None
    if case == "q_dtype":
        q = q.to(torch.float16)
    elif case == "q_2d":
        q = q[:, 0]
    elif case == "k_dim":
        k8 = k8[:, :32]
    elif case == "k_scale_len":
        k_scale = k_scale[:-1]
    elif case == "weights_shape":
        w = w[:, :2]
    elif case == "weights_dtype":
        w = w.half()
    elif case == "ks_short":
        ks = ks[:2]
    elif case == "ke_dtype":
        ke = ke.long()
    elif case == "q_strided":
        q = rand_fp8((t, h, 2 * d), "cpu")[..., ::2]
    elif case == "out_shape":
        out = torch.empty(t, s + 1)
    return (q, (k8, k_scale), w, ks, ke), {"out": out}


PREFILL_BAD = {
    "q_dtype": (TypeError, ["q", "float8_e4m3fn", "torch.float16"]),
    "q_2d": (ValueError, ["q", "[M, H, D]", "(3, 64)"]),
    "k_dim": (ValueError, ["k (kv[0])", "[N, 64]", "(20, 32)"]),
    "k_scale_len": (ValueError, ["k_scale", "[20]", "(19,)"]),
    "weights_shape": (ValueError, ["weights", "[3, 4]", "(3, 2)"]),
    "weights_dtype": (TypeError, ["weights", "torch.float32", "torch.float16"]),
    "ks_short": (ValueError, ["cu_seqlen_ks", "[3]", "(2,)"]),
    "ke_dtype": (TypeError, ["cu_seqlen_ke", "torch.int32", "torch.int64"]),
    "q_strided": (ValueError, ["q", "stride 1", "2"]),
    "out_shape": (ValueError, ["out", "[3, 20]", "(3, 21)"]),
}


@pytest.mark.parametrize("case", list(PREFILL_BAD))
def test_mqa_logits_rejects_bad_arguments_by_name(case):
    exc, words = PREFILL_BAD[case]
    args, kw = _prefill_args(case)
    with pytest.raises(exc) as info:
        tdi.fp8_mqa_logits(*args, clean_logits=False, **kw)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"


def _paged_args(case):
    q, cache, w, ctx, bt, _ = build_paged_case(2, 1, 4, 64, 16, 48, False, seed=1)
    out = None
    if case == "kv_cache_dtype":
        cache = cache.view(torch.int8)
    elif case == "kv_cache_width":
        cache = cache[..., :-4].contiguous()
    elif case == "weights_shape":
        w = w[:1]
    elif case == "context_lens_shape":
        ctx = ctx[:1]
    elif case == "context_lens_dtype":
        ctx = ctx.long()
    elif case == "block_tables_rows":
        bt = bt[:1]
    elif case == "block_tables_dtype":
        bt = bt.long()
    elif case == "q_3d":
        q = q[:, 0]
    elif case == "out_shape":
        out = torch.empty(2, 47)
    return (q, cache, w, ctx, bt, None, 48), {"out": out}


PAGED_BAD = {
    "kv_cache_dtype": (TypeError, ["kv_cache", "torch.uint8", "torch.int8"]),
    "kv_cache_width": (ValueError, ["kv_cache", "68", "(9, 16, 64)"]),
    "weights_shape": (ValueError, ["weights", "[2, 4]", "(1, 4)"]),
    "context_lens_shape": (ValueError, ["context_lens", "[2]", "(1,)"]),
    "context_lens_dtype": (TypeError, ["context_lens", "torch.int32", "torch.int64"]),
    "block_tables_rows": (ValueError, ["block_tables", "[2, max_blocks]", "(1, 3)"]),
    "block_tables_dtype": (TypeError, ["block_tables", "torch.int32", "torch.int64"]),
    "q_3d": (ValueError, ["q", "[B, next_n, H, D]", "(2, 4, 64)"]),
    "out_shape": (ValueError, ["out", "[2, 48]", "(2, 47)"]),
}


@pytest.mark.parametrize("case", list(PAGED_BAD))
def test_paged_mqa_logits_rejects_bad_arguments_by_name(case):
    exc, words = PAGED_BAD[case]
    args, kw = _paged_args(case)
    with pytest.raises(exc) as info:
        tdi.fp8_paged_mqa_logits(*args, clean_logits=False, **kw)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"


def test_topk_fallbacks_reject_short_arguments():
    logits = torch.randn(4, 30)
    ks = torch.zeros(4, dtype=torch.int32)
    ke = torch.full((4,), 30, dtype=torch.int32)
    small = torch.empty(4, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"raw_topk_indices.*\[4, 16\].*\(4, 8\)"):
        tdi.top_k_per_row_prefill(logits, ks, ke, small, 4, 30, 1, 16)
    with pytest.raises(ValueError, match=r"cu_seqlen_ke.*4 rows"):
        tdi.top_k_per_row_prefill(
            logits, ks, ke[:3], torch.empty(4, 16, dtype=torch.int32), 4, 30, 1, 16
        )
    with pytest.raises(ValueError, match=r"seq_lens.*4 rows"):
        tdi.top_k_per_row_decode(
            logits,
            1,
            torch.full((3,), 30, dtype=torch.int32),
            torch.empty(4, 16, dtype=torch.int32),
            4,
            30,
            1,
            16,
        )


# ---------------------------------------------------------------------------
# AOT compile: shared memory per block on SM120/121 (and SM86 fp16 path)
# ---------------------------------------------------------------------------


_AOT_SCRIPT = r"""
import json
from support.aot import compile_for, dsa_indexer_kernels

result = {}
for kernel in dsa_indexer_kernels():
    # SM12x runs the native fp8 kernels; the fp8->fp16 path is what SM8x
    # (< 8.9) runs, and SM86 shares SM120's 99 KiB limit.
    for cap in [(8, 6)] if kernel.constexprs["UPCAST"] else [(12, 0), (12, 1)]:
        k = compile_for(kernel, cap)
        result[f"sm{cap[0]}{cap[1]}-{kernel.name}"] = k.metadata.shared
print(json.dumps(result))
"""


def test_aot_shared_memory(tmp_path):
    """Every shipped config compiles for sm_120/sm_121 (fp8) and sm_86
    (fp8->fp16) within 101,376 B. A fresh process: the interpreter used by
    the other tests patches triton.language in this one."""
    shared = run_aot_script(_AOT_SCRIPT, tmp_path, timeout=600)
    expected = sum(1 if k.constexprs["UPCAST"] else 2 for k in dsa_indexer_kernels())
    assert len(shared) == expected
    over = {k: v for k, v in shared.items() if not 0 < v <= SM120_MAX_SHARED_BYTES}
    assert not over, over


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------


def _gpu_tol(upcast: bool) -> float:
    """The fp8 MMA of Hopper (and DeepGEMM with it) accumulates with fewer
    bits than fp32: ~1.2e-4 relative, measured on an H200. The fp8->fp16
    path accumulates in fp32."""
    return 1e-5 if upcast else 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("upcast", [False, True], ids=["fp8", "fp8->fp16"])
@pytest.mark.parametrize("t,s", [(1024, 4096), (2048, 16384)])
def test_gpu_mqa_logits_vs_reference(t, s, upcast):
    device = "cuda"
    torch.manual_seed(t)
    h, d = 32, 128
    q = rand_fp8((t, h, d), device)
    k8, k_scale = quant_k_per_token(torch.randn(s, d, device=device))
    w = torch.randn(t, h, device=device)
    # Causal windows of a few packed requests, like prefill chunks.
    ks = (torch.arange(t, device=device) // (t // 4)) * (s // 4)
    ke = ks + (s // 4) - (t // 4) + (torch.arange(t, device=device) % (t // 4)) + 1
    ks, ke = ks.int(), ke.int()
    out = torch.full((t, s), float("nan"), device=device)
    tdi.fp8_mqa_logits(
        q, (k8, k_scale), w, ks, ke, clean_logits=True, out=out, upcast=upcast
    )
    mask = window_mask(ks, ke, s)
    for r0 in range(0, t, 256):
        ref = ref_logits(q[r0 : r0 + 256], k8, k_scale, w[r0 : r0 + 256])
        m = mask[r0 : r0 + 256]
        assert rel_err(out[r0 : r0 + 256][m], ref[m]) < _gpu_tol(upcast)
        assert torch.equal(torch.isneginf(out[r0 : r0 + 256]), ~m)
    dg, _ = load_deep_gemm()
    if dg is not None and not upcast:
        ref_dg = dg.fp8_mqa_logits(q, (k8, k_scale), w, ks, ke, clean_logits=True)
        assert rel_err(out[mask], ref_dg[:, :s][mask].double()) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("upcast", [False, True], ids=["fp8", "fp8->fp16"])
@pytest.mark.parametrize("b,next_n", [(64, 1), (16, 2)])
def test_gpu_paged_mqa_logits_vs_reference(b, next_n, upcast):
    h, d, block_size, max_model_len = 32, 128, 64, 4096
    q, cache, w, ctx, bt, ref = build_paged_case(
        b,
        next_n,
        h,
        d,
        block_size,
        max_model_len,
        ctx_2d=next_n > 1,
        seed=b,
        device="cuda",
    )
    out = tdi.fp8_paged_mqa_logits(
        q, cache, w, ctx, bt, None, max_model_len, clean_logits=True, upcast=upcast
    )
    valid = torch.isfinite(ref)
    assert torch.equal(torch.isneginf(out), ~valid)
    assert rel_err(out[valid], ref[valid]) < _gpu_tol(upcast)


# ---------------------------------------------------------------------------
# Dispatch (needs the patched vLLM installed; skipped with the bare module)
# ---------------------------------------------------------------------------


class _FakeCap(tuple):
    def to_int(self) -> int:
        return self[0] * 10 + self[1]


class _FakeCudaPlatform:
    def __init__(self, cap):
        self.cap = _FakeCap(cap)

    def is_cuda(self) -> bool:
        return True

    def get_device_capability(self, device_id: int = 0):
        return self.cap

    def support_deep_gemm(self) -> bool:
        return self.cap[0] == 9 or self.cap[0] == 10


@pytest.mark.parametrize(
    "cap,has_dg,force,expect",
    [
        ((12, 0), True, False, "triton"),  # bundled DeepGEMM cannot run
        ((8, 9), False, False, "triton"),
        ((8, 0), True, False, "triton"),
        ((9, 0), True, False, "deep_gemm"),
        ((10, 0), True, False, "deep_gemm"),
        ((9, 0), True, True, "triton"),  # VLLM_DSA_INDEXER_TRITON=1
        ((9, 0), False, False, "triton"),
        ((7, 5), False, False, "error"),
    ],
)
def test_dispatch(monkeypatch, cap, has_dg, force, expect):
    dispatch = pytest.importorskip("vllm.v1.attention.ops.dsa_indexer_dispatch")
    monkeypatch.setattr(dispatch, "current_platform", _FakeCudaPlatform(cap))
    monkeypatch.setattr(dispatch, "has_deep_gemm", lambda: has_dg)
    # vLLM reports no Triton on a machine without a GPU driver.
    monkeypatch.setattr("vllm.triton_utils.HAS_TRITON", True)
    monkeypatch.setenv("VLLM_DSA_INDEXER_TRITON", "1" if force else "0")
    dispatch.use_triton_dsa_indexer.cache_clear()
    try:
        if expect == "error":
            with pytest.raises(RuntimeError, match="SM80"):
                dispatch.check_dsa_indexer_supported()
            return
        dispatch.check_dsa_indexer_supported()
        assert dispatch.use_triton_dsa_indexer() == (expect == "triton")
    finally:
        dispatch.use_triton_dsa_indexer.cache_clear()
