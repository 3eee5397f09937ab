#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse MLA, few tokens: where the split path's time goes, and how fast a
kernel that only gathers the same rows can be (bf16, GLM-5 shapes, topk 2048).

For each (tables, h_q, s_q), at ``auto_config``'s own config and split count
(tables: this GPU's; the SM12x ones on this GPU; the SM12x ones with one CTA
per SM, as on SM120, see sm120_occupancy):
- ``call``: ``sparse_mla_fwd`` as vLLM runs it (main kernel + merge);
- ``main``: the same call with the merge kernel left out;
- ``main, rows in L2``: that, with every index inside the first 8,192 cache
  rows (9.4 MB, which the L2 keeps), i.e. with DRAM mostly out of the way;
- ``gather floor``: the fastest of 12 gather-only kernels (no dots: each
  CTA loads its rows and sums them; 4/16/64 splits, 16/32-row loads, 4/8
  warps). It depends on s_q only. A kernel that computes attention over these rows in one launch
  cannot be expected to beat it.

A second table (``--sass``, works without a GPU) reads the compiler's
report for the 16-head configs: shared memory, registers, and per loop
iteration (one block of rows) the instruction counts of one warp.

Writes bench/results/<card>/sparse_mla_decode_bounds.jsonl (or under
--results); bench/render.py renders the tables.

    PYTHONPATH=tests python bench/sparse_mla_decode_bounds.py [--sass]
    PYTHONPATH=tests python bench/sparse_mla_decode_bounds.py --no-timings --card "NVIDIA H200"
"""

# The lambdas handed to timed() are called before the loop moves on.
# ruff: noqa: B023
import argparse
import os
import re
import subprocess
import tempfile

import torch
import triton
import triton.language as tl
from vllm.v1.attention.ops import triton_sparse_mla as tsm

import harness
from benchdata import BenchData, environment, results_dir
from sm120_occupancy import available, shared_per_sm
from sparse_mla_work import D_QK, TOPK
from support.aot import compile_for, sparse_mla_kernel

L2_ROWS = 8192
SQ_LIST = [1, 4, 16, 64]
# name: (tables' capability or None for this GPU's, one CTA per SM as on SM120)
TABLES = {
    "this GPU": (None, False),
    "SM12x": ((12, 0), False),
    "SM12x, 1 CTA/SM": ((12, 0), True),
}


@triton.jit
def _gather_only(kv_ptr, idx_ptr, out_ptr, stride_kv, stride_idx, split_len,
                 BLOCK_N: tl.constexpr, NUM_ITERS: tl.constexpr):  # fmt: skip
    s = tl.program_id(0)
    sp = tl.program_id(1)
    offs_v = tl.arange(0, 512)
    offs_r = 512 + tl.arange(0, 64)
    # 576 = 512 + 64 values per row: two loads, as the attention kernel does.
    acc_v = tl.zeros([BLOCK_N, 512], tl.float32)
    acc_r = tl.zeros([BLOCK_N, 64], tl.float32)
    for it in range(NUM_ITERS):
        offs = sp * split_len + it * BLOCK_N + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + s * stride_idx + offs)
        rows = kv_ptr + idx.to(tl.int64) * stride_kv
        acc_v += tl.load(rows[:, None] + offs_v[None, :]).to(tl.float32)
        acc_r += tl.load(rows[:, None] + offs_r[None, :]).to(tl.float32)
    total = tl.sum(tl.sum(acc_v, 1), 0) + tl.sum(tl.sum(acc_r, 1), 0)
    tl.store(out_ptr + s * 64 + sp, total)


def gather_floor(kv, sets, s_q):
    """(µs, splits) of the fastest gather-only variant."""
    best = None
    out = torch.empty(s_q * 64, device="cuda", dtype=torch.float32)
    for splits in (4, 16, 64):
        split_len = TOPK // splits
        for block_n in (16, 32):
            for warps in (4, 8):

                def f(q, i):
                    _gather_only[(s_q, splits)](
                        kv, i, out, kv.stride(0), i.stride(0), split_len,
                        BLOCK_N=block_n, NUM_ITERS=split_len // block_n,
                        num_warps=warps,
                    )  # fmt: skip

                t = harness.timed(f, sets)
                if best is None or t < best[0]:
                    best = (t, splits)
    return best


class _NoMerge:
    """Stands in for the merge kernel: launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def time_case(kv, sets, cfg, splits, one_cta):
    """(call, main, main with rows in L2) in ms."""
    call = lambda q, i, kv=kv: tsm.sparse_mla_fwd(
        q, kv, i, D_QK**-0.5, num_splits=splits, config=cfg
    )
    t_call = harness.timed(call, sets, one_cta)
    merge = tsm._sparse_mla_merge_kernel
    tsm._sparse_mla_merge_kernel = _NoMerge()
    try:
        t_main = harness.timed(call, sets, one_cta)
        small = kv[:L2_ROWS]
        l2_sets = [(q, torch.remainder(i, L2_ROWS).to(torch.int32)) for q, i in sets]
        t_l2 = harness.timed(lambda q, i: call(q, i, small), l2_sets, one_cta)
    finally:
        tsm._sparse_mla_merge_kernel = merge
    return t_call, t_main, t_l2


def run_timings(data, heads):
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(harness.POOL, 1, D_QK, device="cuda", generator=gen).to(
        torch.bfloat16
    )
    copy_bw, _ = harness.ceilings()
    data.figures["copy_tbps"] = copy_bw / 1e12
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    own_cap = torch.cuda.get_device_capability()
    for s_q in SQ_LIST:
        floor_sets = harness.input_sets(
            s_q, 8, torch.bfloat16, gen, harness.n_rotate(s_q)
        )
        floor, f_splits = gather_floor(kv, floor_sets, s_q)
        copy_us = s_q * TOPK * D_QK * 2 / copy_bw * 1e6
        for name, (cap, one_cta) in TABLES.items():
            if one_cta and not available():
                continue
            cap = cap or own_cap
            for h_q in heads:
                sets = harness.input_sets(
                    s_q, h_q, torch.bfloat16, gen, harness.n_rotate(s_q)
                )
                cfg, splits = tsm.auto_config(
                    cap,
                    s_q,
                    h_q,
                    TOPK,
                    torch.bfloat16,
                    sms,
                    None,
                    shared_per_sm(one_cta),
                )
                t_call, t_main, t_l2 = (
                    t * 1e3 for t in time_case(kv, sets, cfg, splits, one_cta)
                )
                inputs = {
                    "tables": name,
                    "h_q": h_q,
                    "s_q": s_q,
                    "config": list(cfg)[:4],
                    "hoist": bool(cfg.hoist),
                    "gluon": bool(cfg.gluon),
                    "splits": splits,
                }
                data.row(
                    "bounds",
                    inputs,
                    call_us=t_call,
                    main_us=t_main,
                    merge_us=t_call - t_main,
                    l2_us=t_l2,
                    floor_us=floor * 1e3,
                    floor_splits=f_splits,
                    copy_us=copy_us,
                    x_floor=t_call / (floor * 1e3),
                )
                print(inputs, f"call {t_call:.1f} main {t_main:.1f} l2 {t_l2:.1f}", flush=True)


def _run_tool(name, *args):
    """stdout of one of the CUDA tools Triton ships (nvdisasm, cuobjdump)."""
    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", name)
    return subprocess.run(
        [tool, *args], capture_output=True, text=True, check=True
    ).stdout


def loop_report(capability, cfg, path="decode"):
    """Shared bytes, registers and one warp's instructions per loop
    iteration of the main kernel (16-head block, 512 rows per CTA as with 4
    splits), AOT-compiled for ``capability``."""
    k = compile_for(sparse_mla_kernel(torch.bfloat16, path, cfg, h_q=16, topk=512), capability)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = _run_tool("nvdisasm", "-c", f.name)
        res = _run_tool("cuobjdump", "-res-usage", f.name)
    lines = sass.splitlines()
    # The loop: the first branch back to a label above it, from that label.
    labels = {s[:-1]: i for i, s in enumerate(lines) if re.fullmatch(r"\.L_x_\d+:", s)}
    start, back = next(
        (labels[m.group(1)], i)
        for i, s in enumerate(lines)
        if (m := re.search(r"BRA.*`\((\.L_x_\d+)\)", s))
        and labels.get(m.group(1), i) < i
    )
    counts: dict[str, int] = {}
    total = 0
    for s in lines[start : back + 1]:
        m = re.search(r"\*/\s+(?:@!?U?P[T\d]\s+)?([A-Z][A-Z0-9]*)", s)
        if m:
            total += 1
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    return k.metadata.shared, regs, total, counts


SASS_OPS = ("HMMA", "LDSM", "LDS", "STS", "BAR", "SHFL", "LDGSTS")


def run_sass(data):
    for cc, path in (((9, 0), "decode"), ((12, 0), "decode"), ((12, 0), "prefill")):
        cfg = tsm.get_config(cc, 16, torch.bfloat16, path)
        shared, regs, total, counts = loop_report(cc, cfg, path)
        data.row(
            "sass",
            {
                "target": f"sm_{cc[0]}{cc[1]}",
                "path": path,
                "config": list(cfg)[:4],
                "hoist": bool(cfg.hoist),
            },
            shared_bytes=shared,
            registers=regs,
            instructions=total,
            counts={o: counts.get(o, 0) for o in SASS_OPS},
        )
        print(cc, path, tuple(cfg), shared, regs, total, counts, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", nargs="+", type=int, default=[8, 16, 32, 64, 128])
    ap.add_argument(
        "--sass", action="store_true", help="also the compiler report (no GPU needed)"
    )
    ap.add_argument(
        "--no-timings", action="store_true", help="only the compiler report"
    )
    ap.add_argument(
        "--results",
        default=None,
        help="results root (default bench/results); data go to "
        "<root>/<card>/sparse_mla_decode_bounds.jsonl",
    )
    ap.add_argument(
        "--card", default=None, help="device name for the results folder (default: the GPU's)"
    )
    args = ap.parse_args()
    if not args.no_timings and not torch.cuda.is_available():
        raise SystemExit(
            "error: the timings need a CUDA GPU (--no-timings --sass runs without one)"
        )
    env = environment()
    card = args.card or env.get("card")
    if card is None:
        raise SystemExit("error: no GPU here to name the results folder: pass --card")
    env.setdefault("card", card)
    data = BenchData("sparse_mla_decode_bounds", env)
    if not args.no_timings:
        run_timings(data, args.heads)
    if args.sass or args.no_timings:
        run_sass(data)
    path = data.write(results_dir(card, args.results))
    print(f"wrote {path}; render with: python bench/render.py", flush=True)


if __name__ == "__main__":
    main()
