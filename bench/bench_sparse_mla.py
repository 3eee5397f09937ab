#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse MLA on one CUDA GPU: the Triton kernel (its own configs and the
SM120 ones) side by side with FlashMLA sparse prefill, plus accuracy against
the fp64 reference (tests/support), and beside them upstream vLLM's own
Triton sparse MLA and vLLM PR 54929's Triton ports of FlashMLA's sparse ops
where source trees holding them are given.

Writes bench/results/<card>/sparse_mla.jsonl (or under --results); render
the tables and the plot with bench/render.py. FlashMLA (SM90/SM100) comes
from --flashmla-so (the pinned wheel's ``vllm/_flashmla_C.abi3.so``),
$FLASHMLA_SO or the installed wheel. Upstream's Triton kernel
(``TRITON_MLA_SPARSE`` of vLLM's main branch, not in a release) comes from
--vllm-triton-src or $VLLM_MAIN_SRC: a checkout of vLLM main, a folder
holding its ``triton_sparse_mla_kernel.py``, or that file; bf16 only, as
it is. PR 54929's kernels (open, for SM12x) come from --pr54929-src or
$VLLM_PR54929_SRC: a checkout of the PR, a folder holding its
``sm12x_sparse_mla_attn.py`` and main's ``sparse_mla_kernels.py``, or the
first file with the second beside it. Two rows: ``pr54929-fp8``, its
flash_mla_with_kvcache over an fp8_ds_mla cache packed from the same bf16 KV
(656 bytes a row; its error includes the fp8 quantization; the accuracy rows
also give its error against the fp64 reference of the dequantized
cache), and ``pr54929-bf16``, its flash_mla_sparse_fwd over the bf16 KV;
both at the true head count (vLLM pads q to 64/128 heads for the fp8 op).

    PYTHONPATH=tests python bench/bench_sparse_mla.py [--flashmla-so PATH] [--sweep]
    PYTHONPATH=tests python bench/bench_sparse_mla.py --dtypes bf16 --heads 8 --sq 1 64

Times: see bench/harness.py (CUDA-graph replays over rotated inputs, no
host launch overhead). FLOPs = 2*s_q*h_q*topk*(576+512); gathered bytes =
s_q*topk*576*elt + q + out. Roofline time = max(bytes / copy bandwidth,
FLOPs / bf16 matmul rate), both measured in the same run.
"""

# The lambdas handed to timed() are called before the loop moves on.
# ruff: noqa: B023
import argparse
import json
import sys

import torch
import triton
from vllm.v1.attention.ops.triton_sparse_mla import (
    SparseMLAConfig,
    auto_config,
    get_config,
    sparse_mla_fwd,
)

import harness
from benchdata import BenchData, environment, results_dir
from harness import SCALE, ceilings, input_sets, n_rotate, timed
from sm120_occupancy import available, shared_per_sm
from sparse_mla_work import D_QK, D_V, TOPK, work
from support.peers import (
    FP8_DS_MLA_BYTES,
    load_flashmla_sparse,
    load_pr54929_sparse_mla,
    load_vllm_triton_sparse_mla,
    pack_fp8_ds_mla,
    unpack_fp8_ds_mla,
)
from support.sparse_mla_ref import ref_sparse_mla

H_LIST = [8, 16, 32, 64, 128]
SQ_LIST = [1, 2, 4, 8, 16, 64, 256, 1024, 4096]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def families(cap):
    """(name, capability whose configs run, one CTA per SM): this GPU's; on
    SM90 also its Triton kernel without the Gluon kernels (the configs SM100
    uses); SM120's, at this GPU's occupancy and (where it can be pinned) at
    SM120's."""
    fams = [("triton", cap, False), ("triton-sm120cfg", (12, 0), False)]
    if cap[0] == 9:
        fams.insert(1, ("triton-nogluon", (10, 0), False))
    if cap[0] != 12 and available():
        fams.append(("triton-sm120-1cta", (12, 0), True))
    return fams


def bucket(h_q):
    return min(64, max(16, triton.next_power_of_2(h_q)))


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


def metrics(s_q, h_q, elt, ms, copy_bw, mm_rate, kv_row_bytes=None):
    flops, nbytes = work(s_q, h_q, elt)
    if kv_row_bytes is not None:  # gathered rows of another width (fp8_ds_mla)
        nbytes += s_q * TOPK * (kv_row_bytes - D_QK * elt)
    t = ms * 1e-3
    roof = max(nbytes / copy_bw, flops / mm_rate)
    return flops / t / 1e12, nbytes / t / 1e12, roof / t


def ratio(res, peer, name):
    """How many times faster ``name`` ran than ``peer`` (None without it)."""
    return res[peer] / res[name] if peer in res and name != peer else None


def run_bench(data, args, op, copy_bw, mm_rate, picks, vt=None, pr=None):
    gen = torch.Generator(device="cuda").manual_seed(0)
    cap = torch.cuda.get_device_capability()
    pools = {
        name: torch.randn(harness.POOL, 1, D_QK, device="cuda", generator=gen).to(dt)
        for name, dt in DTYPES.items()
    }
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        kv = pools[dname]
        elt = kv.element_size()
        cache = pack_fp8_ds_mla(kv) if pr is not None and dtype == torch.bfloat16 else None
        for h_q in args.heads:
            for s_q in args.sq:
                sets = input_sets(s_q, h_q, dtype, gen, n_rotate(s_q))
                out = torch.empty(s_q, h_q, D_V, device="cuda", dtype=dtype)
                res, calls = {}, []
                for name, fcap, one_cta in families(cap):
                    cfg, ns = family_call(fcap, h_q, dtype, s_q, picks, one_cta)
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
                    # FlashMLA needs h_q % 64 == 0 on SM90: pad as vLLM does.
                    hp = max(64, h_q)
                    psets = [
                        (torch.nn.functional.pad(q, (0, 0, 0, hp - h_q)), i)
                        for q, i in sets
                    ]
                    res["flashmla"] = timed(
                        lambda q, i: op(q, kv, i, SCALE, D_V), psets
                    )
                if vt is not None and dtype == torch.bfloat16:
                    res["vllm-triton"] = timed(lambda q, i: vt(q, kv, i, SCALE), sets)
                if cache is not None:
                    res["pr54929-fp8"] = timed(lambda q, i: pr.fp8(q, cache, i, SCALE), sets)
                    res["pr54929-bf16"] = timed(lambda q, i: pr.bf16(q, kv, i, SCALE), sets)
                for name, ms in res.items():
                    row_bytes = FP8_DS_MLA_BYTES if name == "pr54929-fp8" else None
                    tf, tb, roof = metrics(s_q, h_q, elt, ms, copy_bw, mm_rate, row_bytes)
                    x_fm, x_pr = ratio(res, "flashmla", name), ratio(res, "pr54929-fp8", name)
                    data.row(
                        "timings",
                        {"dtype": dname, "h_q": h_q, "s_q": s_q, "kernel": name},
                        us=ms * 1e3,
                        tflops=tf,
                        gathered_tbps=tb,
                        x_roofline=roof,
                        x_flashmla=x_fm,
                        x_vllm_triton=ratio(res, "vllm-triton", name),
                        x_pr54929_fp8=x_pr,
                        x_pr54929_bf16=ratio(res, "pr54929-bf16", name),
                    )
                    print(
                        f"{dname} h{h_q:>3} s_q{s_q:>5} {name:<18} {ms * 1e3:9.1f} us "
                        f"{tf:6.1f} TF/s {tb:5.2f} TB/s roof {roof:5.2f}"
                        + (f" x{x_fm:.2f} FlashMLA" if x_fm else "")
                        + (f" x{x_pr:.2f} PR54929-fp8" if x_pr else ""),
                        flush=True,
                    )
                del sets


def sweep_candidates():
    C = SparseMLAConfig
    return {
        (9, 16, 8): [C(16, 64, 8, 2), C(16, 64, 4, 2), C(16, 32, 4, 2), C(16, 128, 8, 2)],
        (9, 32, 32): [C(32, 64, 4, 2), C(32, 64, 8, 2), C(32, 64, 4, 2, gluon=True)],
        (9, 64, 64): [C(64, 64, 8, 2), C(64, 32, 8, 2), C(64, 64, 4, 2, gluon=True)],
        # SM120-legal: every one AOT-checked <= 101,376 B for sm_120.
        (12, 16, 8): [C(16, 64, 4, 2), C(16, 32, 4, 2)],
        (12, 32, 32): [C(32, 32, 4, 2), C(32, 16, 4, 2)],
        (12, 64, 64): [C(32, 32, 4, 2), C(32, 16, 4, 2)],
    }  # fmt: skip


def run_sweep(data, kv_bf16, gen, part=(0, 1)):
    """Prefill configs (this GPU's family and SM120-legal ones, run here) and
    decode split counts, bf16, as rows of table ``sweep``. Returns the
    picks: the fastest prefill config per (capability major, head bucket)."""
    picks, k = {}, 0
    for (major, bkt, h_q), cl in sweep_candidates().items():
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
                case = f"prefill sm{major}x-legal h{h} s_q{s_q}"
                data.row("sweep", {"case": case, "config": list(cfg), "num_splits": 1}, us=ms * 1e3)
                print(case, tuple(cfg), f"{ms * 1e3:.1f} us", flush=True)
            if best is not None:
                picks[(major, bkt)] = best[1]
    # Decode: this GPU's and SM12x's decode configs and one alternative, at
    # the split count auto_config gives each and at half and twice that.
    p = torch.cuda.get_device_properties(0)
    cap = torch.cuda.get_device_capability()
    for h_q, s_q in [(8, 1), (8, 16), (8, 64), (64, 1), (64, 16)]:
        sets = input_sets(s_q, h_q, torch.bfloat16, gen, n_rotate(s_q))
        out = torch.empty(s_q, h_q, D_V, device="cuda", dtype=torch.bfloat16)
        cfgs = [get_config(c, h_q, torch.bfloat16, "decode") for c in (cap, (12, 0))]
        cfgs += [SparseMLAConfig(16, 64, 4, 2), SparseMLAConfig(16, 32, 4, 3, hoist=True)]
        case = f"decode h{h_q} s_q{s_q}"
        for cfg in dict.fromkeys(cfgs):
            _, auto_ns = auto_config(
                cap,
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
                data.row("sweep", {"case": case, "config": list(cfg), "num_splits": ns},
                         us=ms * 1e3)
                print(case, tuple(cfg), ns, f"{ms * 1e3:.1f} us", flush=True)
        if part == (0, 1):
            ms = timed(lambda q, i: sparse_mla_fwd(q, kv_bf16, i, SCALE, out=out), sets)
            data.row("sweep", {"case": case, "config": "auto", "num_splits": "auto"}, us=ms * 1e3)
            print(case, "auto", f"{ms * 1e3:.1f} us", flush=True)
    return picks


def random_case(gen, s_q, h_q, s_kv, dtype):
    kv = torch.randn(s_kv, 1, D_QK, device="cuda", generator=gen).to(dtype)
    q = torch.randn(s_q, h_q, D_QK, device="cuda", generator=gen).to(dtype)
    perm = torch.randperm(s_kv, device="cuda", generator=gen)[:TOPK]
    shift = torch.randint(0, s_kv, (s_q, 1), device="cuda", generator=gen)
    idx = ((perm[None] + shift) % s_kv).to(torch.int32)[:, None, :].contiguous()
    return q, kv, idx


def check_picks(data, picks):
    """Accuracy of the picked configs (both dtypes) vs fp64, GLM-5 shape."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    for (major, bkt), cfg in sorted(picks.items()):
        for dname, dtype in DTYPES.items():
            for h_q in [bkt // 2, bkt] if bkt < 64 else [64, 128]:
                q, kv, idx = random_case(gen, 256, h_q, 65536, dtype)
                idx[::3, 0, 1500:] = -1
                r_out = ref_sparse_mla(q, kv, idx, SCALE)[0]
                out = torch.full((256, h_q, D_V), float("nan"), device="cuda", dtype=dtype)
                o = sparse_mla_fwd(q, kv, idx, SCALE, out=out, num_splits=1, config=cfg)[0]
                err = ((o.double() - r_out).norm() / r_out.norm()).item()
                ok = (
                    err <= (2e-3 if dtype == torch.float16 else 1e-2)
                    and not torch.isnan(o).any().item()
                )
                data.row(
                    "pick_check",
                    {"pick": f"sm{major}x bucket {bkt}", "config": list(cfg), "dtype": dname,
                     "h_q": h_q},
                    rel_err=err,
                    ok=ok,
                )
                print("pick", major, bkt, tuple(cfg), dname, h_q, f"{err:.2e}", ok, flush=True)


def run_accuracy(data, op, dtypes, heads, vt=None, pr=None):
    gen = torch.Generator(device="cuda").manual_seed(1)
    for dname in dtypes:
        dtype = DTYPES[dname]
        kv = torch.randn(65536, 1, D_QK, device="cuda", generator=gen).to(dtype)
        cache = pack_fp8_ds_mla(kv) if pr is not None and dtype == torch.bfloat16 else None
        for h_q in heads:
            for s_q in [1, 4, 1024]:
                q = torch.randn(s_q, h_q, D_QK, device="cuda", generator=gen).to(dtype)
                perm = torch.randperm(65536, device="cuda", generator=gen)[:TOPK]
                shift = torch.randint(0, 65536, (s_q, 1), device="cuda", generator=gen)
                idx = ((perm[None] + shift) % 65536).to(torch.int32)[:, None, :].contiguous()
                r_out, _, r_lse = ref_sparse_mla(q, kv, idx, SCALE)
                rnorm = r_out.norm()
                for ns in [None, 1] if s_q <= 4 else [None]:
                    out = torch.full((s_q, h_q, D_V), float("nan"), device="cuda", dtype=dtype)
                    o, _, lse = sparse_mla_fwd(q, kv, idx, SCALE, out=out, num_splits=ns)
                    err = ((o.double() - r_out).norm() / rnorm).item()
                    lerr = (lse.double() - r_lse).abs().max().item()
                    ferr = None
                    if op is not None and dtype == torch.bfloat16 and h_q >= 64 and ns is None:
                        fo = op(q, kv, idx, SCALE, D_V)[0]
                        ferr = ((fo.double() - r_out).norm() / rnorm).item()
                    verr = None
                    if vt is not None and dtype == torch.bfloat16 and ns is None:
                        vo = vt(q, kv, idx, SCALE)
                        verr = ((vo.double() - r_out).norm() / rnorm).item()
                    perr = dict.fromkeys(("pr54929_fp8_rel_err", "pr54929_fp8_kernel_rel_err",
                                          "pr54929_bf16_rel_err"))
                    if cache is not None and ns is None:
                        # fp8: against the bf16 KV's reference (quantization
                        # included) and the dequantized cache's (kernel alone)
                        po = pr.fp8(q, cache, idx, SCALE).double()
                        r_deq = ref_sparse_mla(q, unpack_fp8_ds_mla(cache), idx, SCALE)[0]
                        bo = pr.bf16(q, kv, idx, SCALE).double()
                        perr = dict(
                            pr54929_fp8_rel_err=((po - r_out).norm() / rnorm).item(),
                            pr54929_fp8_kernel_rel_err=((po - r_deq).norm()
                                                        / r_deq.norm()).item(),
                            pr54929_bf16_rel_err=((bo - r_out).norm() / rnorm).item())
                    path = "auto" if ns is None else "one-pass"
                    data.row(
                        "accuracy",
                        {"dtype": dname, "h_q": h_q, "s_q": s_q, "path": path},
                        rel_err=err,
                        lse_max_abs_err=lerr,
                        flashmla_rel_err=ferr,
                        vllm_triton_rel_err=verr,
                        **perr,
                    )
                    print(dname, h_q, s_q, path, f"{err:.2e} {lerr:.1e}", ferr, verr,
                          {k: f"{v:.2e}" for k, v in perr.items() if v is not None}, flush=True)


def probe_empty_row(op):
    """What FlashMLA returns for a row without valid indices (text)."""
    q = torch.randn(2, 64, D_QK, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(100, 1, D_QK, device="cuda", dtype=torch.bfloat16)
    idx = torch.full((2, 1, 128), -1, device="cuda", dtype=torch.int32)
    idx[1, 0, :5] = torch.arange(5, device="cuda", dtype=torch.int32)
    o, m, lse_f = op(q, kv, idx, SCALE, D_V)
    mine = sparse_mla_fwd(q, kv, idx, SCALE)
    txt = (
        f"FlashMLA all-invalid row: out absmax {o[0].abs().max().item()}, "
        f"max_logits {m[0, :2].tolist()}, "
        f"lse {lse_f[0, :2].tolist()}, nan out {torch.isnan(o[0]).any().item()}; "
        f"Triton: out absmax {mine[0][0].abs().max().item()}, "
        f"max_logits {mine[1][0, :2].tolist()}, "
        f"lse {mine[2][0, :2].tolist()}; valid-row lse diff "
        f"{(mine[2][1] - lse_f[1]).abs().max().item():.2e}, "
        f"max_logits diff {(mine[1][1] - m[1]).abs().max().item():.2e}"
    )  # fmt: skip
    print(txt, flush=True)
    return txt


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flashmla-so", default=None,
                    help="FlashMLA library (else $FLASHMLA_SO or the wheel)")
    ap.add_argument("--vllm-triton-src", default=None,
                    help="vLLM main checkout (or a folder holding, or the file "
                         "triton_sparse_mla_kernel.py) for upstream's Triton sparse MLA "
                         "(else $VLLM_MAIN_SRC)")
    ap.add_argument("--pr54929-src", default=None,
                    help="vLLM checkout of PR 54929 (or a folder holding its "
                         "sm12x_sparse_mla_attn.py and main's sparse_mla_kernels.py, or the "
                         "first file with the second beside it) for its Triton sparse MLA "
                         "(else $VLLM_PR54929_SRC)")
    ap.add_argument("--results", default=None,
                    help="results root (default bench/results); data go to "
                         "<root>/<card>/sparse_mla.jsonl")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the accuracy table")
    ap.add_argument("--sweep", action="store_true", help="also time config / split variants")
    ap.add_argument("--no-bench", action="store_true", help="skip the timing table")
    ap.add_argument(
        "--picks",
        default=None,
        help='JSON file {"<major>,<bucket>": [config fields]}: prefill configs '
        "to time instead of the module's tables (e.g. from a separate sweep)",
    )
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--heads", nargs="+", type=int, default=H_LIST)
    ap.add_argument("--sq", nargs="+", type=int, default=SQ_LIST)
    ap.add_argument(
        "--kv-rows",
        type=int,
        default=harness.POOL,
        help="rows of the KV cache the timed calls gather from (the context; default "
        f"{harness.POOL:,}); the accuracy rows keep 65,536",
    )
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
        help="only compile every variant the run would time (parallel warm-up); writes nothing",
    )
    return ap.parse_args()


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_sparse_mla: needs a CUDA GPU")
    harness.WARM_ONLY = args.warm_only
    if args.kv_rows < TOPK:
        sys.exit(f"bench_sparse_mla: --kv-rows {args.kv_rows} is fewer than top-k {TOPK}")
    harness.POOL = args.kv_rows
    env = environment()
    data = BenchData("sparse_mla", env)
    data.figures["kv_pool_rows"] = harness.POOL
    data.keep_partial(results_dir(env["card"], args.results))  # rows kept if killed
    print(json.dumps(env), flush=True)
    op = None
    if not args.warm_only:
        op, why = load_flashmla_sparse(args.flashmla_so)
        print("FlashMLA:", "loaded" if op else why, flush=True)
        data.figures["flashmla"] = "loaded" if op else why
    vt = None
    if not args.warm_only:
        vt, why = load_vllm_triton_sparse_mla(args.vllm_triton_src)
        print("vLLM's Triton sparse MLA:", "loaded" if vt else why, flush=True)
        data.figures["vllm_triton"] = f"loaded, sha256 {vt.sha256}" if vt else why
    pr = None
    if not args.warm_only:
        pr, why = load_pr54929_sparse_mla(args.pr54929_src)
        print("PR 54929's Triton sparse MLA:", "loaded" if pr else why, flush=True)
        data.figures["pr54929"] = f"loaded, sha256 {json.dumps(pr.sha256)}" if pr else why
    if op is not None:
        data.figures["empty_row_probe"] = probe_empty_row(op)
    if not (args.no_accuracy or args.warm_only):
        run_accuracy(data, op, args.dtypes, args.heads, vt, pr)

    copy_bw, mm_rate = (1.0, 1.0) if args.warm_only else ceilings()
    data.figures.update(copy_tbps=copy_bw / 1e12, matmul_tflops=mm_rate / 1e12)
    print(f"ceilings: copy {copy_bw / 1e12:.2f} TB/s, bf16 matmul {mm_rate / 1e12:.0f} TFLOP/s",
          flush=True)
    picks = {}
    if args.sweep:
        gen = torch.Generator(device="cuda").manual_seed(2)
        kvb = torch.randn(harness.POOL, 1, D_QK, device="cuda", generator=gen).to(
            torch.bfloat16)
        picks = run_sweep(data, kvb, gen, tuple(args.sweep_part))
        del kvb
        data.figures["sweep_picks"] = {f"{m},{b}": list(c) for (m, b), c in sorted(picks.items())}
        if not args.warm_only:
            check_picks(data, picks)
    if args.picks:
        with open(args.picks) as f:
            for key, fields in json.load(f).items():
                major, bkt = (int(x) for x in key.split(","))
                picks[(major, bkt)] = SparseMLAConfig(*fields)
        data.figures["prefill_picks"] = {f"{m},{b}": list(c) for (m, b), c in sorted(picks.items())}
        print("prefill picks:", picks, flush=True)
    if not args.no_bench:
        run_bench(data, args, op, copy_bw, mm_rate, {} if args.warm_only else picks, vt, pr)
    if args.warm_only:
        return
    path = data.write(results_dir(env["card"], args.results))
    print(f"wrote {path}; render with: python bench/render.py", flush=True)


if __name__ == "__main__":
    main()
