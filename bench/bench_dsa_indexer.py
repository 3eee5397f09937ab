#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Check and time the Triton DSA indexer against the fp64 reference
(tests/support) and DeepGEMM.

Needs torch, triton and the kernel module
``vllm.v1.attention.ops.triton_dsa_indexer`` (the patched wheel). DeepGEMM
(SM90/SM100 only) is the ``deep_gemm`` package in the folder given with
--deep-gemm (e.g. the wheel's ``vllm/third_party``), else on the path.
Upstream vLLM's own Triton MQA logits (vLLM's main branch, not in a
release) is timed beside them where --vllm-triton-src or $VLLM_MAIN_SRC
names a vLLM main checkout, a folder holding its ``mqa_logits_triton.py``,
or that file.
Writes every check, timing and sweep point to
bench/results/<card>/dsa_indexer.jsonl (or under --results); render the
tables with bench/render.py.

GLM-5 indexer shapes: 32 heads x 128 dims, fp8 e4m3 q/k, top-2048, cache
block size 64. Prefill = chunked causal windows; decode = paged cache with
shuffled blocks, next_n 1 and 2.

    PYTHONPATH=tests python bench/bench_dsa_indexer.py --deep-gemm DIR [--skip sweep]
    PYTHONPATH=tests python bench/bench_dsa_indexer.py --smoke  # tiny, CPU, writes nothing
"""

import argparse
import functools
import json
import os
import subprocess
import sys
import time
import traceback

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
from vllm.v1.attention.ops import triton_dsa_indexer as tdi  # noqa: E402

from benchdata import BenchData, environment, results_dir  # noqa: E402
from support.indexer_ref import ref_logits  # noqa: E402
from support.peers import load_deep_gemm as load_peer_deep_gemm  # noqa: E402
from support.peers import load_vllm_triton_mqa_logits  # noqa: E402

H, D, TOPK, BLOCK = 32, 128, 2048, 64
FP8 = torch.float8_e4m3fn
T0 = time.time()
DATA = BenchData("dsa_indexer", {})


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def check(name, ok, **info):
    DATA.row("checks", {"name": name}, ok=bool(ok), **info)
    log("PASS" if ok else "FAIL", name, json.dumps(info, default=str))
    return ok


def section(fn):
    def run(*a, **k):
        if time.time() - T0 > ARGS.deadline:
            log("SKIP (deadline)", fn.__name__)
            DATA.notes.append(f"skipped {fn.__name__}: deadline")
            return None
        try:
            return fn(*a, **k)
        except Exception as e:  # keep going: one call has to return everything
            tb = traceback.format_exc()
            log("ERROR in", fn.__name__, repr(e))
            print(tb, flush=True)
            DATA.notes.append(f"error in {fn.__name__}: {e!r}")
            return None

    run.__name__ = fn.__name__
    return run


# ---------------------------------------------------------------------------
# Inputs and references
# ---------------------------------------------------------------------------


def rand_fp8(shape, dev, amp=3.0):
    return (torch.randn(shape, device=dev) * amp).clamp(-448, 448).to(FP8)


def quant_k(n, dev):
    k = torch.randn(n, D, device=dev)
    scale = k.abs().amax(-1).clamp_min(1e-4) / 448.0
    # ue8m0 scales, as vLLM's indexer uses (scale_fmt="ue8m0").
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return (k / scale[:, None]).to(FP8), scale


def fp64_tol(dev, upcast=False):
    """Hopper's fp8 MMA accumulates with fewer bits than fp32 (DeepGEMM shows
    the same ~1e-4); the fp16 path and the CPU interpreter are fp32-exact."""
    return 1e-5 if (dev == "cpu" or upcast) else 1e-3


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def prefill_case(t, s, reqs, dev, seed):
    """`reqs` packed requests; each one's last tokens are the new ones."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    torch.manual_seed(seed)
    q = rand_fp8((t, H, D), dev)
    k8, k_scale = quant_k(s, dev)
    w = torch.randn(t, H, device=dev)
    tq = [t // reqs] * reqs
    tq[-1] += t - sum(tq)
    sk = [s // reqs] * reqs
    sk[-1] += s - sum(sk)
    ks, ke = [], []
    s0 = 0
    for nq, nk in zip(tq, sk, strict=True):
        nq_eff = min(nq, nk)
        for i in range(nq):
            j = max(i - (nq - nq_eff), 0)
            ks.append(s0)
            ke.append(s0 + nk - nq_eff + j + 1 if i >= nq - nq_eff else s0)
        s0 += nk
    del g
    ks = torch.tensor(ks, dtype=torch.int32, device=dev)
    ke = torch.tensor(ke, dtype=torch.int32, device=dev)
    return q, k8, k_scale, w, ks, ke


def decode_case(b, next_n, max_len, dev, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    torch.manual_seed(seed)
    ctx = torch.randint(max(next_n, max_len // 8), max_len + 1, (b,), generator=g)
    ctx[0] = max_len
    if b > 2:
        ctx[1] = next_n  # tiny context
    max_blocks = triton.cdiv(max_len, BLOCK)
    nb = b * max_blocks + 1
    perm = torch.randperm(nb, generator=g)[: b * max_blocks]
    bt = perm.view(b, max_blocks).to(torch.int32).to(dev)
    # Build the cache bytes directly: [nb, BLOCK*D fp8 | BLOCK fp32 scales].
    k8, k_scale = quant_k(nb * BLOCK, dev)
    cache = torch.empty(nb, BLOCK * (D + 4), dtype=torch.uint8, device=dev)
    cache[:, : BLOCK * D] = k8.view(torch.uint8).view(nb, BLOCK * D)
    cache[:, BLOCK * D :] = k_scale.view(nb, BLOCK).view(torch.uint8)
    cache = cache.view(nb, BLOCK, D + 4)
    q = rand_fp8((b, next_n, H, D), dev)
    w = torch.randn(b * next_n, H, device=dev)
    ctx = ctx.to(torch.int32).to(dev)
    ctx2d = (ctx[:, None] - next_n + 1 + torch.arange(next_n, device=dev)[None, :]).to(
        torch.int32
    )
    k_all = k8.view(nb, BLOCK, D)
    s_all = k_scale.view(nb, BLOCK)
    return q, cache, w, ctx, ctx2d.contiguous(), bt, (k_all, s_all)


def gather_keys(kv, bt_row, n):
    k_all, s_all = kv
    pages = bt_row[: triton.cdiv(n, BLOCK)].long()
    return k_all[pages].reshape(-1, D)[:n], s_all[pages].reshape(-1)[:n]


def topk_sets_equal(la, lb, starts, ends, k, ref=None):
    """Rows' top-k sets of la and lb agree except at near-ties (judged on
    `ref` or la). Returns (rows checked, rows differing beyond ties)."""
    n = la.shape[1]
    col = torch.arange(n, device=la.device)
    valid = (col[None] >= starts[:, None]) & (col[None] < ends[:, None])
    ninf = torch.tensor(float("-inf"), device=la.device)
    ma = torch.where(valid, la, ninf)
    mb = torch.where(valid, lb, ninf)
    ref = ma if ref is None else torch.where(valid, ref.to(la.dtype), ninf)
    kk = min(k, n)
    ia = torch.topk(ma, kk, dim=1).indices
    ib = torch.topk(mb, kk, dim=1).indices
    sa = torch.zeros_like(valid).scatter_(1, ia, True) & valid
    sb = torch.zeros_like(valid).scatter_(1, ib, True) & valid
    kth = torch.topk(ref, kk, dim=1).values[:, -1:]
    scale = ref.abs().where(valid, torch.zeros((), device=la.device)).amax(1, True)
    near = (ref - kth).abs() <= 1e-5 * scale + 1e-30
    bad = ((sa ^ sb) & ~near).any(1)
    long_rows = (ends - starts) > k
    return int(long_rows.sum()), int((bad & long_rows).sum())


# ---------------------------------------------------------------------------
# DeepGEMM
# ---------------------------------------------------------------------------

DG = None
VT = None  # upstream vLLM's Triton MQA logits, where a source is given


def load_deep_gemm():
    global DG
    if SMOKE:
        return
    DG, why = load_peer_deep_gemm(ARGS.deep_gemm)
    if DG is None:
        log("DeepGEMM:", why)
        DATA.figures["deep_gemm"] = why
        return
    version = getattr(DG, "__version__", "?")
    # the module, not its file: records name no machine's paths
    DATA.figures["deep_gemm"] = f"{version} ({DG.__name__})"
    log("DeepGEMM", version, f"({DG.__name__})")


def load_vllm_triton():
    """Upstream vLLM's Triton MQA logits (vLLM main), where a source is given."""
    global VT
    if SMOKE:
        return
    VT, why = load_vllm_triton_mqa_logits(ARGS.vllm_triton_src)
    DATA.figures["vllm_triton"] = f"loaded, sha256 {VT.sha256}" if VT else why
    log("vLLM's Triton MQA logits:", "loaded" if VT else why)


def peer_agreement(row, ours, theirs, valid, starts, ends):
    """How far upstream's Triton logits are from ours inside the windows
    (relative), and in how many rows with more keys than top-k the top-k
    sets differ beyond ties."""
    row["vllm_triton_rel_diff"] = rel(theirs[valid], ours[valid])
    row["vllm_triton_topk_rows_differing"] = topk_sets_equal(
        ours, theirs.float(), starts, ends, TOPK)[1]


def dg_mqa(q, k8, k_scale, w, ks, ke, clean):
    return DG.fp8_fp4_mqa_logits((q, None), (k8, k_scale), w, ks, ke, clean_logits=clean)


def dg_paged(q, cache, w, ctx2d, bt, max_len, clean, sched=None):
    if sched is None:
        sched = DG.get_paged_mqa_logits_metadata(
            ctx2d, BLOCK, torch.cuda.get_device_properties(0).multi_processor_count
        )
    out = DG.fp8_fp4_paged_mqa_logits(
        (q, None), cache.unsqueeze(-2), w, ctx2d, bt, sched, max_len, clean_logits=clean
    )
    return out, sched


def add(table, row, input_keys):
    """One row of ``table``: the keys named in ``input_keys`` are what ran,
    the others what was measured."""
    DATA.row(
        table,
        {k: v for k, v in row.items() if k in input_keys},
        **{k: v for k, v in row.items() if k not in input_keys},
    )


def bench(fn):
    if SMOKE:
        fn()
        return float("nan")
    return triton.testing.do_bench(fn, warmup=20, rep=ARGS.rep, return_mode="median")


# ---------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------


def prefill_shapes():
    if SMOKE:
        return [(24, 200, 2), (10, 333, 1)]
    return [(8192, 8192, 1), (4096, 32768, 4), (2048, 65536, 1), (8192, 65536, 1)]


def decode_shapes():
    if SMOKE:
        return [(3, 1, 300), (2, 2, 200)]
    return [(1, 1, 65536), (32, 1, 65536), (128, 1, 65536), (256, 1, 65536),
            (64, 2, 65536), (256, 2, 32768)]


@section
def env_info():
    DATA.env = environment()
    DATA.env["smoke"] = SMOKE
    if torch.cuda.is_available():
        try:
            DATA.env["sm_clocks_mhz"] = subprocess.run(
                ["nvidia-smi", "-i", "0", "--query-gpu=clocks.sm,clocks.max.sm",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            DATA.env["sm_clocks_mhz"] = repr(e)
    log("env", json.dumps(DATA.env, default=str))


@section
def prefill_checks(dev):
    for t, s, reqs in prefill_shapes():
        if time.time() - T0 > ARGS.deadline:
            break
        q, k8, ks_, w, ks, ke = prefill_case(t, s, reqs, dev, seed=t + s)
        name = f"prefill T={t} S={s} reqs={reqs}"
        out = tdi.fp8_mqa_logits(q, (k8, ks_), w, ks, ke, clean_logits=True)
        col = torch.arange(s, device=dev)
        valid = (col[None] >= ks[:, None]) & (col[None] < ke[:, None])
        check(f"{name}: -inf exactly outside windows",
              torch.equal(torch.isneginf(out), ~valid) and not out.isnan().any())
        rows = torch.unique(torch.cat([torch.tensor([0, t - 1]),
                                       torch.randint(0, t, (30,))])).to(dev)
        ref = ref_logits(q[rows], k8, ks_, w[rows])
        m = valid[rows]
        e = rel(out[rows][m], ref[m])
        check(f"{name}: vs fp64 (sampled rows)", e < fp64_tol(dev), rel_err=e)
        if dev == "cuda" and (t, s, reqs) == prefill_shapes()[0]:
            up = tdi.fp8_mqa_logits(q, (k8, ks_), w, ks, ke, upcast=True)
            eu = rel(up[rows][m], ref[m])
            check(f"{name}: fp8->fp16 path vs fp64", eu < 1e-5, rel_err=eu)
            del up
        # Each row's own max error: top-k may differ from fp64 only there.
        row_err = torch.where(m, (out[rows].double() - ref).abs(), 0).amax(1, True)
        # Fallback top-k on the unclean logits vs torch.topk of the clean ones.
        raw = tdi.fp8_mqa_logits(q, (k8, ks_), w, ks, ke, clean_logits=False)
        idx = torch.empty(rows.numel(), TOPK, dtype=torch.int32, device=dev)
        sub = raw[rows]
        tdi.top_k_per_row_prefill(sub, ks[rows], ke[rows], idx, rows.numel(),
                                  sub.stride(0), sub.stride(1), TOPK)
        # -1 slots land in a dummy last column.
        picked = torch.zeros(m.shape[0], s + 1, dtype=torch.bool, device=dev)
        abs_idx = torch.where(idx >= 0, idx.long() + ks[rows, None].long(), s)
        picked.scatter_(1, abs_idx.clamp(0, s), True)
        ia_sets = picked[:, :s] & m
        ref_pick = torch.zeros_like(m)
        kk = min(TOPK, s)
        top = torch.topk(torch.where(m, ref, float("-inf")), kk, dim=1)
        ref_pick.scatter_(1, top.indices, True)
        ref_pick &= m
        kth = top.values[:, -1:]
        near = (ref - kth).abs() <= 2 * row_err + 1e-6 * ref.abs().amax(1, True)
        bad = ((ia_sets ^ ref_pick) & ~near).any(1).sum().item()
        check(f"{name}: fallback top-{TOPK} sets vs fp64 (sampled rows)", bad == 0,
              bad_rows=bad)
        if DG is not None:
            dg = dg_mqa(q, k8, ks_, w, ks, ke, clean=True)[:, :s]
            e2 = rel(out[valid], dg[valid])
            check(f"{name}: vs DeepGEMM (all rows)", e2 < 1e-5, rel_err=e2,
                  dg_shape=list(dg.shape), dg_inf_matches=bool(
                      torch.equal(torch.isneginf(dg), ~valid)))
            n_long, n_bad = topk_sets_equal(out, dg.float(), ks, ke, TOPK)
            check(f"{name}: top-{TOPK} sets Triton == DeepGEMM up to ties",
                  n_bad == 0, rows_with_gt_topk=n_long, rows_differing=n_bad)
            del dg
        del out, raw
        torch.cuda.empty_cache() if dev == "cuda" else None


@section
def decode_checks(dev):
    for b, next_n, max_len in decode_shapes():
        if time.time() - T0 > ARGS.deadline:
            break
        q, cache, w, ctx, ctx2d, bt, kv = decode_case(b, next_n, max_len, dev, seed=b)
        name = f"decode B={b} next_n={next_n} max_len={max_len}"
        lens = ctx2d.reshape(-1).long()
        col = torch.arange(max_len, device=dev)
        valid = col[None] < lens[:, None]
        outs = {}
        for label, ctx_arg in (("1d", ctx), ("2d", ctx2d)):
            out = tdi.fp8_paged_mqa_logits(q, cache, w, ctx_arg, bt, None, max_len,
                                           clean_logits=True)
            outs[label] = out
            check(f"{name} ctx {label}: -inf exactly past context",
                  torch.equal(torch.isneginf(out), ~valid) and not out.isnan().any())
        check(f"{name}: 1-D and 2-D context lens agree",
              torch.equal(outs["1d"], outs["2d"]))
        out = outs["2d"]
        del outs
        errs = []
        for i in sorted({0, b - 1, b // 2}):
            n = int(ctx[i])
            k8, sc = gather_keys(kv, bt[i], n)
            ref = ref_logits(q[i], k8, sc, w[i * next_n:(i + 1) * next_n])
            for j in range(next_n):
                r = int(lens[i * next_n + j])
                if r:
                    errs.append(rel(out[i * next_n + j, :r], ref[j, :r]))
        e = max(errs) if errs else 0.0
        check(f"{name}: vs fp64 (sampled requests)", e < fp64_tol(dev), rel_err=e)
        if dev == "cuda" and (b, next_n, max_len) == decode_shapes()[0]:
            up = tdi.fp8_paged_mqa_logits(q, cache, w, ctx, bt, None, max_len,
                                          upcast=True)
            i, n = 0, int(ctx[0])
            k8, sc = gather_keys(kv, bt[0], n)
            ref = ref_logits(q[0], k8, sc, w[:next_n])
            eu = rel(up[next_n - 1, :n], ref[next_n - 1, :n])
            check(f"{name}: fp8->fp16 path vs fp64", eu < 1e-5, rel_err=eu)
            del up
        if DG is not None:
            # DeepGEMM's clean_logits needs 1-D context lens; compare the
            # written region only.
            dg, _ = dg_paged(q, cache, w, ctx2d, bt, max_len, clean=False)
            e2 = rel(out[valid], dg[valid])
            check(f"{name}: vs DeepGEMM", e2 < 1e-5, rel_err=e2,
                  dg_shape=list(dg.shape))
            zeros = torch.zeros_like(lens)
            n_long, n_bad = topk_sets_equal(out, dg.float(), zeros, lens, TOPK)
            check(f"{name}: top-{TOPK} sets Triton == DeepGEMM up to ties",
                  n_bad == 0, rows_with_gt_topk=n_long, rows_differing=n_bad)
            del dg
        idx = torch.empty(b * next_n, TOPK, dtype=torch.int32, device=dev)
        tdi.top_k_per_row_decode(out, next_n, ctx, idx, b * next_n, out.stride(0),
                                 1, TOPK)
        tk = torch.topk(out, min(TOPK, max_len), dim=1)
        sel = torch.zeros(b * next_n, max_len + 1, dtype=torch.bool, device=dev)
        sel.scatter_(1, torch.where(idx >= 0, idx.long(), max_len), True)
        sel = sel[:, :max_len]
        ref_sel = torch.zeros_like(valid).scatter_(1, tk.indices, True) & valid
        check(f"{name}: fallback decode top-k == torch.topk",
              torch.equal(sel, ref_sel))
        del out, cache


@section
def prefill_timings(dev):
    for t, s, reqs in prefill_shapes():
        if time.time() - T0 > ARGS.deadline:
            break
        q, k8, ks_, w, ks, ke = prefill_case(t, s, reqs, dev, seed=1)
        flops = 2.0 * H * D * (ke - ks).clamp_min(0).sum().item()
        row = {"kind": "prefill", "T": t, "S": s, "reqs": reqs}
        row["triton_ms"] = bench(functools.partial(
            tdi.fp8_mqa_logits, q, (k8, ks_), w, ks, ke, clean_logits=False))
        if DG is not None:
            row["deepgemm_ms"] = bench(functools.partial(dg_mqa, q, k8, ks_, w, ks, ke, False))
            row["ratio_dg_over_triton"] = row["deepgemm_ms"] / row["triton_ms"]
        if VT is not None:
            row["vllm_triton_ms"] = bench(functools.partial(VT.prefill, q, k8, ks_, w, ks, ke))
            row["ratio_vllm_triton_over_triton"] = row["vllm_triton_ms"] / row["triton_ms"]
            col = torch.arange(s, device=dev)
            peer_agreement(row, tdi.fp8_mqa_logits(q, (k8, ks_), w, ks, ke, clean_logits=True),
                           VT.prefill(q, k8, ks_, w, ks, ke),
                           (col[None] >= ks[:, None]) & (col[None] < ke[:, None]), ks, ke)
        row["triton_tflops"] = flops / row["triton_ms"] / 1e9
        add("timings", row, ("kind", "T", "S", "reqs", "B", "next_n", "max_len"))
        log(json.dumps(row))


@section
def decode_timings(dev):
    for b, next_n, max_len in decode_shapes():
        if time.time() - T0 > ARGS.deadline:
            break
        q, cache, w, ctx, ctx2d, bt, _ = decode_case(b, next_n, max_len, dev, seed=2)
        nbytes = ctx.long().sum().item() * (D + 4)
        out = torch.empty(b * next_n, max_len, device=dev)
        row = {"kind": "decode", "B": b, "next_n": next_n, "max_len": max_len,
               "mean_ctx": ctx.float().mean().item()}
        row["triton_ms"] = bench(functools.partial(
            tdi.fp8_paged_mqa_logits, q, cache, w, ctx2d, bt, None, max_len,
            clean_logits=False, out=out))
        if DG is not None:
            _, sched = dg_paged(q, cache, w, ctx2d, bt, max_len, False)
            row["deepgemm_ms"] = bench(
                functools.partial(dg_paged, q, cache, w, ctx2d, bt, max_len, False, sched))
            row["ratio_dg_over_triton"] = row["deepgemm_ms"] / row["triton_ms"]
        if VT is not None:
            row["vllm_triton_ms"] = bench(
                functools.partial(VT.paged, q, cache, w, ctx, bt, max_len))
            row["ratio_vllm_triton_over_triton"] = row["vllm_triton_ms"] / row["triton_ms"]
            lens = ctx2d.reshape(-1).long()
            peer_agreement(row, tdi.fp8_paged_mqa_logits(q, cache, w, ctx2d, bt, None, max_len,
                                                         clean_logits=True),
                           VT.paged(q, cache, w, ctx, bt, max_len),
                           torch.arange(max_len, device=dev)[None] < lens[:, None],
                           torch.zeros_like(lens), lens)
        row["triton_kv_TBps"] = nbytes / row["triton_ms"] / 1e9
        # GPU time alone (host launch overhead excluded) via graph replay.
        if dev == "cuda":
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                tdi.fp8_paged_mqa_logits(q, cache, w, ctx2d, bt, None, max_len,
                                         clean_logits=False, out=out)
            row["triton_graph_ms"] = bench(g.replay)
        # The torch fallback top-k, for scale (vLLM uses its _C ops).
        idx = torch.empty(b * next_n, TOPK, dtype=torch.int32, device=dev)
        row["fallback_topk_ms"] = bench(functools.partial(
            tdi.top_k_per_row_decode, out, next_n, ctx2d, idx, b * next_n, out.stride(0), 1,
            TOPK))
        add("timings", row, ("kind", "T", "S", "reqs", "B", "next_n", "max_len"))
        log(json.dumps(row))


@section
def sweep(dev):
    """Other tile configs: correctness on one shape each, then time."""
    if SMOKE:
        pcfgs = [tdi.PrefillConfig(2, 32, 2, 4, 1)]
        dcfgs = [tdi.DecodeConfig(4, 1, 2)]
    else:
        pcfgs = [tdi.PrefillConfig(bt, bn, tp, nw, ns)
                 for bt, bn, tp, nw, ns in [
                     (4, 64, 8, 4, 3), (4, 64, 16, 4, 3), (4, 64, 4, 4, 3),
                     (4, 64, 8, 4, 4), (4, 64, 8, 4, 2), (2, 64, 8, 4, 3),
                     (8, 64, 8, 4, 3), (8, 32, 8, 4, 3), (4, 32, 16, 4, 3),
                     (4, 128, 8, 4, 3)]]
        pcfgs.append(tdi.PrefillConfig(4, 64, 8, 4, 3, KV_MAJOR=False))
        dcfgs = [tdi.DecodeConfig(nw, ns, pps) for nw, ns, pps in [
            (4, 3, 16), (4, 3, 32), (4, 2, 16), (4, 4, 16)]]
        dcfgs.append(tdi.DecodeConfig(4, 3, 16, KV_MAJOR=False))
    shapes = [prefill_shapes()[0]] if SMOKE else [(8192, 16384, 1), (2048, 65536, 1)]
    for (t, s, reqs), cfg in [(sh, c) for sh in shapes for c in pcfgs]:
        if cfg is pcfgs[0]:
            q, k8, ks_, w, ks, ke = prefill_case(t, s, reqs, dev, seed=3)
            ref_out = tdi.fp8_mqa_logits(q, (k8, ks_), w, ks, ke, clean_logits=True)
        if time.time() - T0 > ARGS.deadline:
            break
        try:
            out = tdi.fp8_mqa_logits(q, (k8, ks_), w, ks, ke, clean_logits=True,
                                     config=cfg)
            same = torch.equal(torch.isneginf(out), torch.isneginf(ref_out))
            fin = torch.isfinite(ref_out)
            e = rel(out[fin], ref_out[fin].double())
            ms = bench(functools.partial(
                tdi.fp8_mqa_logits, q, (k8, ks_), w, ks, ke, clean_logits=False, config=cfg))
            row = {"kind": "prefill", "shape": [t, s], "config": cfg.__dict__,
                   "ms": ms, "ok": bool(same and e < 1e-5), "rel_vs_default": e}
        except Exception as ex:
            row = {"kind": "prefill", "config": cfg.__dict__, "error": repr(ex)[:300]}
        add("sweep", row, ("kind", "shape", "config"))
        log(json.dumps(row))
    b, next_n, max_len = (3, 1, 300) if SMOKE else (128, 1, 65536)
    q, cache, w, ctx, ctx2d, bt, _ = decode_case(b, next_n, max_len, dev, seed=4)
    ref_out = tdi.fp8_paged_mqa_logits(q, cache, w, ctx, bt, None, max_len)
    for cfg in dcfgs:
        if time.time() - T0 > ARGS.deadline:
            break
        try:
            out = tdi.fp8_paged_mqa_logits(q, cache, w, ctx, bt, None, max_len,
                                           config=cfg)
            fin = torch.isfinite(ref_out)
            ok = torch.equal(torch.isneginf(out), torch.isneginf(ref_out)) and (
                rel(out[fin], ref_out[fin].double()) < 1e-5)
            buf = torch.empty_like(out)
            ms = bench(functools.partial(
                tdi.fp8_paged_mqa_logits, q, cache, w, ctx, bt, None, max_len,
                clean_logits=False, out=buf, config=cfg))
            row = {"kind": "decode", "shape": [b, next_n, max_len],
                   "config": cfg.__dict__, "ms": ms, "ok": bool(ok)}
        except Exception as ex:
            row = {"kind": "decode", "config": cfg.__dict__, "error": repr(ex)[:300]}
        add("sweep", row, ("kind", "shape", "config"))
        log(json.dumps(row))


def summary():
    rows = {t: [r for r in DATA.rows if r["table"] == t]
            for t in ("checks", "timings", "sweep")}
    checks = [r["figures"]["ok"] for r in rows["checks"]]
    lines = ["", (f"== checks: {sum(checks)} pass, {len(checks) - sum(checks)} fail; "
                  f"notes: {len(DATA.notes)}")]
    for r in rows["checks"]:
        if not r["figures"]["ok"]:
            lines.append("  FAIL " + r["inputs"]["name"])
    lines += ["  " + n for n in DATA.notes]
    lines.append("== timings (median ms)")
    for rec in rows["timings"]:
        r = {**rec["inputs"], **rec["figures"]}
        shape = (f"T={r['T']} S={r['S']} reqs={r['reqs']}" if r["kind"] == "prefill"
                 else f"B={r['B']} next_n={r['next_n']} ctx~{r['mean_ctx']:.0f}")
        extra = (f" {r['triton_tflops']:.0f} TFLOP/s" if "triton_tflops" in r
                 else f" {r.get('triton_kv_TBps', 0):.2f} TB/s")
        dg = (f" dg {r['deepgemm_ms']:.3f} dg/triton {r['ratio_dg_over_triton']:.2f}"
              if "deepgemm_ms" in r else "")
        if "triton_graph_ms" in r:
            dg += f" (triton in a graph {r['triton_graph_ms']:.3f})"
        lines.append(f"  {r['kind']:7s} {shape:32s} triton {r['triton_ms']:.3f}"
                     f"{extra}{dg}")
    for rec in rows["sweep"]:
        r = {**rec["inputs"], **rec["figures"]}
        lines.append(f"  sweep {r['kind']} {r.get('shape')} {r.get('config')} "
                     f"{r.get('ms', float('nan')):.3f} ok={r.get('ok')} "
                     f"{r.get('error', '')}")
    return "\n".join(lines)


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--deep-gemm", default=None,
                    help="folder holding the deep_gemm package")
    ap.add_argument("--vllm-triton-src", default=None,
                    help="vLLM main checkout (or a folder holding, or the file "
                         "mqa_logits_triton.py) for upstream's Triton MQA logits "
                         "(else $VLLM_MAIN_SRC)")
    ap.add_argument("--results", default=None,
                    help="results root (default bench/results); data go to "
                    "<root>/<card>/dsa_indexer.jsonl (with --smoke: only if given)")
    ap.add_argument("--deadline", type=float, default=1e9,
                    help="seconds after which remaining sections are skipped")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--skip", default="", help="comma list of sections to skip")
    ARGS = ap.parse_args()
    dev = "cpu" if SMOKE else "cuda"
    skip = set(ARGS.skip.split(","))
    env_info()
    if "dg" not in skip:
        section(load_deep_gemm)()
    if "vt" not in skip:
        section(load_vllm_triton)()
    for fn in (prefill_checks, decode_checks, prefill_timings, decode_timings, sweep):
        if fn.__name__ not in skip:
            fn(dev)
    text = summary()
    print(text, flush=True)
    if not SMOKE or ARGS.results:
        card = DATA.env.get("card", "cpu-triton-interpreter")
        path = DATA.write(results_dir(card, ARGS.results))
        log(f"wrote {path}; render with: python bench/render.py")
    checks = [r for r in DATA.rows if r["table"] == "checks"]
    return 0 if all(r["figures"]["ok"] for r in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
