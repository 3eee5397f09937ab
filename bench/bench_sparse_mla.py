#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse MLA on one CUDA GPU: the Triton kernel (its own configs and the
SM120 ones) side by side with FlashMLA sparse prefill, plus accuracy against
an fp64 reference.

Standalone (torch + triton + vllm.v1.attention.ops.triton_sparse_mla, which
needs nothing else from vLLM). FlashMLA is optional: pass the path of the
pinned wheel's ``vllm/_flashmla_C.abi3.so`` with --flashmla-so (or have the
wheel installed).

    python bench/bench_sparse_mla.py --out bench/results/sparse_mla_h200.md \
        --accuracy-out bench/results/sparse_mla_accuracy_h200.md \
        [--flashmla-so path/to/_flashmla_C.abi3.so] [--sweep]

Times: the calls over several input sets (rotated so that one pass gathers
>= 200 MB) are captured in one CUDA graph and replayed under
triton.testing.do_bench (median; L2 flushed before each replay); time per
call = replay time / number of sets. Host launch overhead is thus excluded,
as in vLLM's CUDA-graph decode. FLOPs = 2*s_q*h_q*topk*(576+
512); gathered bytes = s_q*topk*576*elt + q + out. Roofline time = max(bytes
/ copy bandwidth, FLOPs / bf16 matmul rate), both measured in the same run.
"""

# Long lines are markdown table text; the lambdas handed to timed() are
# called before the loop moves on.
# ruff: noqa: E501, B023
import argparse
import contextlib
import datetime
import json
import subprocess
import sys

import torch
import triton
import triton.testing
from sm120_occupancy import available, one_cta_per_sm, shared_per_sm
from sparse_mla_work import D_QK, D_V, TOPK, work
from vllm.v1.attention.ops.triton_sparse_mla import (
    SparseMLAConfig,
    auto_config,
    get_config,
    sparse_mla_fwd,
)

SCALE = D_QK**-0.5
POOL = 262144  # cache rows: 302 MB in bf16, ~6x the H200's L2
H_LIST = [8, 16, 32, 64, 128]
SQ_LIST = [1, 2, 4, 8, 16, 64, 256, 1024, 4096]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def load_flashmla(path):
    try:
        if path:
            torch.ops.load_library(path)
        else:
            import vllm._flashmla_C  # noqa: F401
        raw = torch.ops._flashmla_C.sparse_prefill_fwd
        schema = raw.default._schema
        print("FlashMLA schema:", schema, flush=True)
        n_args = len(schema.arguments)

        def op(q, kv, idx, scale, d_v, *_):
            # (q, kv, indices, sm_scale, d_v[, attn_sink, topk_length[, out]])
            return raw(q, kv, idx, scale, d_v, *([None] * (n_args - 5)))

        return op
    except Exception as e:  # noqa: BLE001 - optional peer, report and go on
        print(f"FlashMLA not available: {e!r}", flush=True)
        return None


def unique_indices(s_q, s_kv, topk, gen):
    # Unique per row (as the indexer's top-k): one random set, shifted per row.
    perm = torch.randperm(s_kv, device="cuda", generator=gen)[:topk]
    shift = torch.randint(0, s_kv, (s_q, 1), device="cuda", generator=gen)
    return ((perm[None] + shift) % s_kv).to(torch.int32)[:, None, :].contiguous()


def input_sets(s_q, h_q, dtype, gen, n_sets):
    return [
        (
            torch.randn(s_q, h_q, D_QK, device="cuda", generator=gen).to(dtype),
            unique_indices(s_q, POOL, TOPK, gen),
        )
        for _ in range(n_sets)
    ]


WARM_ONLY = False


def timed(fn, sets, one_cta=False):
    """Median µs of one call. The calls over all input sets are captured in
    one CUDA graph (as vLLM runs decode), so host launch overhead is out of
    the number; do_bench flushes L2 before each replay. ``one_cta``: one
    CTA of the Triton kernel per SM, as on SM120 (sm120_occupancy)."""
    if WARM_ONLY:  # compile (fills Triton's cache for the timed run) only
        fn(*sets[0])
        return 1.0
    for a in sets:
        fn(*a)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    pinned = one_cta_per_sm() if one_cta else contextlib.nullcontext()
    with pinned, torch.cuda.graph(g):
        for a in sets:
            fn(*a)
    ms = triton.testing.do_bench(g.replay, warmup=5, rep=40, return_mode="median")
    return ms / len(sets)


def n_rotate(s_q):
    # Enough sets that one replay gathers >= ~200 MB (4x the H200's L2).
    return max(2, min(64, -(-200_000_000 // (s_q * TOPK * D_QK * 2))))


def _copy_bandwidth():
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    t = triton.testing.do_bench(
        lambda: y.copy_(x), warmup=20, rep=100, return_mode="median"
    )
    return 2 * x.numel() * 2 / (t * 1e-3)  # bytes read + written


def ceilings():
    copy_bw = _copy_bandwidth()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = triton.testing.do_bench(lambda: a @ b, warmup=20, rep=100, return_mode="median")
    return copy_bw, 2 * 8192**3 / (t * 1e-3)


CAP = (9, 0)  # set from the device in main()
# (name, capability whose configs run, one CTA per SM): this GPU's; on SM90
# also its Triton kernel without the Gluon kernels (the configs SM100 uses);
# SM120's, at this GPU's occupancy and (where it can be pinned) at SM120's.
FAMILIES = [("triton", CAP, False), ("triton-sm120cfg", (12, 0), False)]


def family_call(cap, h_q, dtype, s_q, picks, one_cta=False):
    """(config, num_splits) exactly as sparse_mla_fwd's auto path decides on
    a device of capability ``cap`` with this GPU's SMs (and SM120's shared
    memory per SM with ``one_cta``); the prefill config replaced by the
    sweep's pick where given (picks[(cap major, bucket)])."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg, ns = auto_config(cap, s_q, h_q, TOPK, dtype, sms, None, shared_per_sm(one_cta))
    if ns == 1 and cfg == get_config(cap, h_q, dtype, "prefill"):
        cfg = picks.get((cap[0], bucket(h_q)), cfg)
    return cfg, ns


def bucket(h_q):
    return min(64, max(16, triton.next_power_of_2(h_q)))


def metrics(s_q, h_q, elt, ms, copy_bw, mm_rate):
    flops, nbytes = work(s_q, h_q, elt)
    t = ms * 1e-3
    roof = max(nbytes / copy_bw, flops / mm_rate)
    return flops / t / 1e12, nbytes / t / 1e12, roof / t


def run_bench(args, op, copy_bw, mm_rate, picks):
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    pools = {
        name: torch.randn(POOL, 1, D_QK, device="cuda", generator=gen).to(dt)
        for name, dt in DTYPES.items()
    }
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        kv = pools[dname]
        elt = kv.element_size()
        for h_q in args.heads:
            for s_q in args.sq:
                sets = input_sets(s_q, h_q, dtype, gen, n_rotate(s_q))
                out = torch.empty(s_q, h_q, D_V, device="cuda", dtype=dtype)
                res, calls = {}, []
                for name, cap, one_cta in FAMILIES:
                    cfg, ns = family_call(cap, h_q, dtype, s_q, picks, one_cta)
                    if name == "triton-nogluon" and (cfg, ns) in calls:
                        continue  # no Gluon kernel here: same as "triton"
                    calls.append((cfg, ns))
                    res[name] = timed(
                        lambda q, i: sparse_mla_fwd(
                            q, kv, i, SCALE, out=out, num_splits=ns, config=cfg
                        ),
                        sets,
                        one_cta,
                    )
                if op is not None and dtype == torch.bfloat16:
                    hp = max(
                        64, h_q
                    )  # FlashMLA needs h_q % 64 == 0 on SM90: pad as vLLM does
                    psets = [
                        (torch.nn.functional.pad(q, (0, 0, 0, hp - h_q)), i)
                        for q, i in sets
                    ]
                    res["flashmla"] = timed(
                        lambda q, i: op(q, kv, i, SCALE, D_V, None, None, None), psets
                    )
                for name, ms in res.items():
                    tf, tb, roof = metrics(s_q, h_q, elt, ms, copy_bw, mm_rate)
                    ratio = (
                        res["flashmla"] / ms
                        if "flashmla" in res and name != "flashmla"
                        else None
                    )
                    rows.append((dname, h_q, s_q, name, ms * 1e3, tf, tb, roof, ratio))
                    print(
                        f"{dname} h{h_q:>3} s_q{s_q:>5} {name:<16} {ms * 1e3:9.1f} us {tf:6.1f} TF/s "
                        f"{tb:5.2f} TB/s roof {roof:5.2f}"
                        + (f" x{ratio:.2f} FlashMLA" if ratio else ""),
                        flush=True,
                    )
                del sets
    return rows


def run_sweep(kv_bf16, gen, part=(0, 1)):
    """Prefill configs (this GPU's family and SM120-legal ones, run here) and
    decode split counts, bf16. Returns (markdown lines, picks): the fastest
    prefill config per (capability major, head bucket)."""
    C = SparseMLAConfig
    cands = {
        (9, 16, 8): [
            C(16, 64, 8, 2),
            C(16, 64, 4, 2),
            C(16, 32, 4, 2),
            C(16, 128, 8, 2),
        ],
        (9, 32, 32): [
            C(32, 64, 4, 2),
            C(32, 64, 8, 2),
            C(32, 64, 4, 2, gluon=True),
        ],
        (9, 64, 64): [
            C(64, 64, 8, 2),
            C(64, 32, 8, 2),
            C(64, 64, 4, 2, gluon=True),
        ],
        # SM120-legal: every one AOT-checked <= 101,376 B for sm_120.
        (12, 16, 8): [
            C(16, 64, 4, 2),
            C(16, 32, 4, 2),
        ],
        (12, 32, 32): [
            C(32, 32, 4, 2),
            C(32, 16, 4, 2),
        ],
        (12, 64, 64): [
            C(32, 32, 4, 2),
            C(32, 16, 4, 2),
        ],
    }
    lines = [
        "| case | config (block_h, block_n, warps, stages, hoist, gluon) | num_splits | µs |",
        "|---|---|---:|---:|",
    ]
    picks, k = {}, 0
    for (major, bkt, h_q), cl in cands.items():
        for h in [h_q, 128] if bkt == 64 else [h_q]:
            s_q = 1024
            sets = input_sets(s_q, h, torch.bfloat16, gen, 2)
            out = torch.empty(s_q, h, D_V, device="cuda", dtype=torch.bfloat16)
            best = None
            for cfg in cl:
                k += 1
                if k % part[1] != part[0]:
                    continue
                try:
                    ms = timed(
                        lambda q, i: sparse_mla_fwd(
                            q, kv_bf16, i, SCALE, out=out, num_splits=1, config=cfg
                        ),
                        sets,
                    )
                except Exception as e:  # noqa: BLE001 - e.g. out of resources
                    print("sweep fail", cfg, repr(e)[:200])
                    continue
                if h == h_q and (best is None or ms < best[0]):
                    best = (ms, cfg)
                lines.append(
                    f"| prefill sm{major}x-legal h{h} s_q{s_q} | {tuple(cfg)} | 1 | {ms * 1e3:.1f} |"
                )
                print(lines[-1], flush=True)
            if best is not None:
                picks[(major, bkt)] = best[1]
    # Decode: this GPU's and SM12x's decode configs and one alternative, at
    # the split count auto_config gives each and at half and twice that.
    p = torch.cuda.get_device_properties(0)
    for h_q, s_q in [(8, 1), (8, 16), (8, 64), (64, 1), (64, 16)]:
        sets = input_sets(s_q, h_q, torch.bfloat16, gen, n_rotate(s_q))
        out = torch.empty(s_q, h_q, D_V, device="cuda", dtype=torch.bfloat16)
        cfgs = [get_config(c, h_q, torch.bfloat16, "decode") for c in (CAP, (12, 0))]
        cfgs += [C(16, 64, 4, 2), C(16, 32, 4, 3, hoist=True)]
        for cfg in dict.fromkeys(cfgs):
            _, auto_ns = auto_config(
                CAP,
                s_q,
                h_q,
                TOPK,
                torch.bfloat16,
                p.multi_processor_count,
                cfg,
                p.shared_memory_per_multiprocessor,
            )
            least = 2 if cfg.gluon else 1  # no one-pass Gluon split kernel
            for ns in sorted({max(least, auto_ns // 2), auto_ns, auto_ns * 2}):
                k += 1
                if k % part[1] != part[0]:
                    continue
                ms = timed(
                    lambda q, i: sparse_mla_fwd(
                        q, kv_bf16, i, SCALE, out=out, num_splits=ns, config=cfg
                    ),
                    sets,
                )
                lines.append(
                    f"| decode h{h_q} s_q{s_q} | {tuple(cfg)} | {ns} | {ms * 1e3:.1f} |"
                )
                print(lines[-1], flush=True)
        if part == (0, 1):
            ms = timed(lambda q, i: sparse_mla_fwd(q, kv_bf16, i, SCALE, out=out), sets)
            lines.append(f"| decode h{h_q} s_q{s_q} | auto | auto | {ms * 1e3:.1f} |")
            print(lines[-1], flush=True)
    return lines, picks


def check_picks(picks):
    """Accuracy of the picked configs (both dtypes) vs fp64, GLM-5 shape."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    lines = []
    for (major, bkt), cfg in sorted(picks.items()):
        for dname, dtype in DTYPES.items():
            for h_q in [bkt // 2, bkt] if bkt < 64 else [64, 128]:
                kv = torch.randn(65536, 1, D_QK, device="cuda", generator=gen).to(dtype)
                q = torch.randn(256, h_q, D_QK, device="cuda", generator=gen).to(dtype)
                perm = torch.randperm(65536, device="cuda", generator=gen)[:TOPK]
                shift = torch.randint(0, 65536, (256, 1), device="cuda", generator=gen)
                idx = (
                    ((perm[None] + shift) % 65536)
                    .to(torch.int32)[:, None, :]
                    .contiguous()
                )
                idx[::3, 0, 1500:] = -1
                r_out, _ = ref_fp64(q, kv, idx)
                out = torch.full(
                    (256, h_q, D_V), float("nan"), device="cuda", dtype=dtype
                )
                o = sparse_mla_fwd(
                    q, kv, idx, SCALE, out=out, num_splits=1, config=cfg
                )[0]
                err = ((o.double() - r_out).norm() / r_out.norm()).item()
                ok = (
                    err <= (2e-3 if dtype == torch.float16 else 1e-2)
                    and not torch.isnan(o).any().item()
                )
                lines.append(
                    f"| pick sm{major}x bucket {bkt} {tuple(cfg)} | {dname} h{h_q} | {err:.2e} | {'ok' if ok else 'FAIL'} |"
                )
                print(lines[-1], flush=True)
    return lines


def ref_fp64(q, kv, idx, chunk=64):
    outs, lses = [], []
    rows_all = kv[:, 0]
    for c0 in range(0, q.shape[0], chunk):
        i = idx[c0 : c0 + chunk, 0].long()
        valid = (i >= 0) & (i < rows_all.shape[0])
        rows = rows_all[i.clamp(0, rows_all.shape[0] - 1)].double()
        lg = torch.einsum("chd,ctd->cht", q[c0 : c0 + chunk].double(), rows) * SCALE
        lg = lg.masked_fill(~valid[:, None], float("-inf"))
        lse = torch.logsumexp(lg, -1)
        outs.append(
            torch.einsum(
                "cht,ctd->chd", torch.exp(lg - lse[..., None]), rows[..., :D_V]
            )
        )
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def run_accuracy(op):
    gen = torch.Generator(device="cuda").manual_seed(1)
    s_kv = 65536
    lines = [
        "| dtype | h_q | s_q | path | triton rel err | triton max abs lse err | FlashMLA rel err |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for dname, dtype in DTYPES.items():
        kv = torch.randn(s_kv, 1, D_QK, device="cuda", generator=gen).to(dtype)
        for h_q in H_LIST:
            for s_q in [1, 4, 1024]:
                q = torch.randn(s_q, h_q, D_QK, device="cuda", generator=gen).to(dtype)
                perm = torch.randperm(s_kv, device="cuda", generator=gen)[:TOPK]
                shift = torch.randint(0, s_kv, (s_q, 1), device="cuda", generator=gen)
                idx = (
                    ((perm[None] + shift) % s_kv)
                    .to(torch.int32)[:, None, :]
                    .contiguous()
                )
                r_out, r_lse = ref_fp64(q, kv, idx)
                rnorm = r_out.norm()
                for ns in [None, 1] if s_q <= 4 else [None]:
                    out = torch.full(
                        (s_q, h_q, D_V), float("nan"), device="cuda", dtype=dtype
                    )
                    o, _, lse = sparse_mla_fwd(
                        q, kv, idx, SCALE, out=out, num_splits=ns
                    )
                    err = ((o.double() - r_out).norm() / rnorm).item()
                    lerr = (lse.double() - r_lse).abs().max().item()
                    path = "auto" if ns is None else "one-pass"
                    ferr = ""
                    if (
                        op is not None
                        and dtype == torch.bfloat16
                        and h_q >= 64
                        and ns is None
                    ):
                        fo = op(q, kv, idx, SCALE, D_V, None, None, None)[0]
                        ferr = f"{((fo.double() - r_out).norm() / rnorm).item():.2e}"
                    lines.append(
                        f"| {dname} | {h_q} | {s_q} | {path} | {err:.2e} | {lerr:.1e} | {ferr} |"
                    )
                    print(lines[-1], flush=True)
    return lines


def probe_empty_row(op):
    """What FlashMLA returns for a row without valid indices."""
    q = torch.randn(2, 64, D_QK, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(100, 1, D_QK, device="cuda", dtype=torch.bfloat16)
    idx = torch.full((2, 1, 128), -1, device="cuda", dtype=torch.int32)
    idx[1, 0, :5] = torch.arange(5, device="cuda", dtype=torch.int32)
    o, m, lse_f = op(q, kv, idx, SCALE, D_V, None, None, None)[:3]
    mine = sparse_mla_fwd(q, kv, idx, SCALE)
    txt = (
        f"FlashMLA all-invalid row: out absmax {o[0].abs().max().item()}, max_logits {m[0, :2].tolist()}, "
        f"lse {lse_f[0, :2].tolist()}, nan out {torch.isnan(o[0]).any().item()}; "
        f"Triton: out absmax {mine[0][0].abs().max().item()}, max_logits {mine[1][0, :2].tolist()}, "
        f"lse {mine[2][0, :2].tolist()}; valid-row lse diff "
        f"{(mine[2][1] - lse_f[1]).abs().max().item():.2e}, max_logits diff {(mine[1][1] - m[1]).abs().max().item():.2e}"
    )
    print(txt, flush=True)
    return txt


def header():
    p = torch.cuda.get_device_properties(0)
    try:
        drv = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        drv = "?"
    return (
        f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. "
        f"Card: {p.name} ({p.multi_processor_count} SMs, capability {p.major}.{p.minor}), driver {drv}, "
        f"torch {torch.__version__}, triton {triton.__version__}. Commit: (fill in)."
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flashmla-so", default=None)
    ap.add_argument("--out", default=None, help="markdown file for the timing table")
    ap.add_argument(
        "--accuracy-out", default=None, help="markdown file for the accuracy table"
    )
    ap.add_argument(
        "--sweep", action="store_true", help="also time config / split variants"
    )
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument(
        "--picks",
        default=None,
        help='JSON file {"<major>,<bucket>": [config fields]}: prefill configs '
        "to time instead of the module's tables (e.g. from a separate sweep)",
    )
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"])
    ap.add_argument("--heads", nargs="+", type=int, default=H_LIST)
    ap.add_argument("--sq", nargs="+", type=int, default=SQ_LIST)
    ap.add_argument(
        "--sweep-part",
        nargs=2,
        type=int,
        default=[0, 1],
        metavar=("K", "N"),
        help="with --warm-only: compile only every N-th sweep case, from K",
    )
    ap.add_argument(
        "--warm-only",
        action="store_true",
        help="only compile every variant the run would time (parallel warm-up)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_sparse_mla: needs a CUDA GPU")
    if args.warm_only:
        global WARM_ONLY
        WARM_ONLY = True
        args.flashmla_so, args.accuracy_out, args.out = None, None, None
    op = None if args.warm_only else load_flashmla(args.flashmla_so)
    head = header()
    print(head, flush=True)
    probe = probe_empty_row(op) if op is not None else ""

    if args.accuracy_out:
        acc = run_accuracy(op)
        with open(args.accuracy_out, "w") as f:
            f.write("# Sparse MLA accuracy vs fp64 reference\n\n" + head + "\n\n")
            f.write(
                "topk 2048, s_kv 65536, unique random indices, sm_scale 576^-0.5; rel err = "
                "||out - ref|| / ||ref||; lse error in natural-log units.\n\n"
            )
            f.write("\n".join(acc) + "\n\n" + probe + "\n")

    copy_bw, mm_rate = (1.0, 1.0) if args.warm_only else ceilings()
    ceil_txt = f"Ceilings measured in this run: copy {copy_bw / 1e12:.2f} TB/s (read+write), bf16 matmul {mm_rate / 1e12:.0f} TFLOP/s."
    print(ceil_txt, flush=True)
    global CAP, FAMILIES
    CAP = torch.cuda.get_device_capability()
    FAMILIES = [("triton", CAP, False), ("triton-sm120cfg", (12, 0), False)]
    if CAP[0] == 9:
        FAMILIES.insert(1, ("triton-nogluon", (10, 0), False))
    if CAP[0] != 12 and available():
        FAMILIES.append(("triton-sm120-1cta", (12, 0), True))
    sweep, picks = [], {}
    if args.sweep:
        gen = torch.Generator(device="cuda").manual_seed(2)
        kvb = torch.randn(POOL, 1, D_QK, device="cuda", generator=gen).to(
            torch.bfloat16
        )
        sweep, picks = run_sweep(kvb, gen, tuple(args.sweep_part))
        del kvb
        if not args.warm_only:
            sweep += [
                "",
                "Picked prefill configs (used for the tables above): " + repr(picks),
                "",
                "| pick | case | rel err vs fp64 | |",
                "|---|---|---:|---|",
            ] + check_picks(picks)
    if args.picks:
        with open(args.picks) as f:
            for key, fields in json.load(f).items():
                major, bkt = (int(x) for x in key.split(","))
                picks[(major, bkt)] = SparseMLAConfig(*fields)
        print("prefill picks:", picks, flush=True)
    if args.no_bench:
        print("\n".join(sweep))
        return
    rows = run_bench(args, op, copy_bw, mm_rate, {} if args.warm_only else picks)
    table = [
        "| dtype | h_q | s_q | kernel | µs | TFLOP/s | gathered TB/s | × roofline | × FlashMLA speed |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for d, h, s, name, us, tf, tb, roof, ratio in rows:
        table.append(
            f"| {d} | {h} | {s} | {name} | {us:.1f} | {tf:.1f} | {tb:.2f} | {roof:.2f} | "
            f"{'' if ratio is None else f'{ratio:.2f}'} |"
        )
    text = "\n".join(table)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Sparse MLA timings\n\n" + head + "\n\n" + ceil_txt + "\n\n")
            f.write(
                "topk 2048, d_qk 576, d_v 512, kv pool 262,144 rows, unique random indices per token. "
                "`triton`: this GPU's tables, config and split count as sparse_mla_fwd's auto_config "
                "picks them for this GPU (with --sweep, the prefill configs are the sweep's picks, see "
                "below); `triton-sm120cfg`: the SM120/SM121 tables, picked the same way for this GPU's "
                "SMs, run here; `triton-sm120-1cta`: the same with one CTA per SM, as on SM120 (emulated: "
                "launched with 116 KB of dynamic shared memory, auto_config told 100 KB per SM; see "
                "bench/sm120_occupancy.py); `triton-nogluon` (SM90 "
                "only, rows where it differs): the Triton kernel with the configs SM100 uses, i.e. without the "
                "Hopper Gluon kernels; `flashmla`: "
                "_flashmla_C.sparse_prefill_fwd from the pinned wheel, bf16 only, h_q padded to 64 "
                "(as vLLM pads). × FlashMLA speed = FlashMLA time / this time. Times per call from CUDA-graph "
                "replays over rotated inputs (no host launch overhead; see the script's docstring).\n\n"
            )
            f.write(text + "\n")
            if sweep:
                f.write("\n## Config sweep (bf16)\n\n" + "\n".join(sweep) + "\n")


if __name__ == "__main__":
    main()
