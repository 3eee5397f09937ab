#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse MLA: every path the automatic choice can take, timed against the
choice itself (bf16, GLM-5 shapes, topk 2048).

For each (h_q, s_q): the table's prefill config in one pass, and its decode
config over topk in 1, 2, 4, ... splits (up to three waves of CTAs), then
``sparse_mla_fwd``'s own choice (``auto_config``). Writes every timing
(the data ``auto_config``'s cost model was fitted to), the choice, the
fastest option and their ratio to bench/results/<card>/sparse_mla_paths.jsonl
(or under --results); bench/render.py renders the table.

Modes (``--modes``):
- ``sm90``: the Hopper tables on this GPU;
- ``sm12``: the SM12x tables on this GPU, as many CTAs per SM as fit;
- ``sm12-1cta``: the SM12x tables with one CTA per SM, as on SM120, whose
  100 KB SMs hold one CTA of these configs. The Triton kernel is launched
  with 116 KB of dynamic shared memory (it uses <= 99 KB), which a 228 KB
  SM fits once; this patches Triton 3.6's compiled-kernel launch metadata.

    python bench/sweep_sparse_mla_paths.py --modes sm12-1cta sm12 sm90
"""

# The lambdas handed to timed() are called before the loop moves on.
# ruff: noqa: B023
import argparse
import math

import torch
import triton
from vllm.v1.attention.ops import triton_sparse_mla as tsm

from benchdata import BenchData, environment, results_dir
from harness import POOL, SCALE, input_sets, n_rotate, timed
from sm120_occupancy import available, shared_per_sm
from sparse_mla_work import D_QK, D_V, TOPK

MODES = {
    "sm90": ((9, 0), False),
    "sm12": ((12, 0), False),
    "sm12-1cta": ((12, 0), True),
}
SQ_LIST = [1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 80, 96, 112, 128, 144, 160, 192, 224, 256,
           320, 384]  # fmt: skip


def options(cap, h_q, s_q, num_sms, shared):
    """(label, config, num_splits) of every path auto_config weighs."""
    dt = torch.bfloat16
    pre = tsm.get_config(cap, h_q, dt, "prefill")
    dec = tsm.get_config(cap, h_q, dt, "decode")
    out = [("prefill", pre, 1)]
    hblocks = triton.cdiv(h_q, tsm._block_h(dec, h_q))
    slots = num_sms * tsm._resident_ctas(dec, tsm._block_h(dec, h_q), shared)
    n = 1
    while n <= min(64, triton.cdiv(TOPK, dec.block_n)):
        if not (n == 1 and dec.gluon) and (n <= 2 or s_q * hblocks * n <= 3 * slots):
            out.append((f"decode/{n}", dec, n))
        n *= 2
    return out


def label(cap, h_q, cfg, ns):
    if ns > 1:
        return f"decode/{ns}"
    return (
        "prefill"
        if cfg == tsm.get_config(cap, h_q, torch.bfloat16, "prefill")
        else "decode/1"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--heads", nargs="+", type=int, default=[8, 16, 32, 64, 128])
    ap.add_argument(
        "--sq",
        nargs="+",
        type=int,
        default=SQ_LIST,
    )
    ap.add_argument(
        "--results",
        default=None,
        help="results root (default bench/results); data go to "
        "<root>/<card>/sparse_mla_paths.jsonl",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_sparse_mla_paths: needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    env = environment()
    data = BenchData("sparse_mla_paths", env)
    data.keep_partial(results_dir(env["card"], args.results))  # rows kept if killed
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(POOL, 1, D_QK, device="cuda", generator=gen).to(torch.bfloat16)
    for mode in args.modes:
        cap, one_cta = MODES[mode]
        if one_cta and not available():
            raise SystemExit("sm12-1cta: this GPU or Triton cannot pin one CTA per SM")
        shared = shared_per_sm(one_cta)
        ratios = []
        for h_q in args.heads:
            for s_q in args.sq:
                sets = input_sets(s_q, h_q, torch.bfloat16, gen, n_rotate(s_q))
                out = torch.empty(s_q, h_q, D_V, device="cuda", dtype=torch.bfloat16)
                times = {}
                for name, cfg, ns in options(
                    cap, h_q, s_q, props.multi_processor_count, shared
                ):
                    ms = timed(
                        lambda q, i: tsm.sparse_mla_fwd(
                            q, kv, i, SCALE, out=out, num_splits=ns, config=cfg
                        ),
                        sets,
                        one_cta,
                    )
                    times[name] = ms * 1e3
                cfg, ns = tsm.auto_config(
                    cap,
                    s_q,
                    h_q,
                    TOPK,
                    torch.bfloat16,
                    props.multi_processor_count,
                    None,
                    shared,
                )
                pick = label(cap, h_q, cfg, ns)
                best = min(times, key=times.get)
                ratios.append(times[pick] / times[best])
                data.row(
                    "paths",
                    {"mode": mode, "h_q": h_q, "s_q": s_q},
                    choice=pick,
                    choice_us=times[pick],
                    fastest=best,
                    fastest_us=times[best],
                    ratio=ratios[-1],
                    times_us=times,
                )
                print(mode, h_q, s_q, pick, f"{times[pick]:.1f}", best, f"{times[best]:.1f}",
                      flush=True)
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        data.row(
            "modes",
            {"mode": mode, "tables": f"{cap[0]}.{cap[1]}", "sms": props.multi_processor_count,
             "shared_per_sm": shared},
            geo_mean=geo,
            worst=max(ratios),
            within_5pct=sum(r <= 1.05 for r in ratios),
            cases=len(ratios),
        )
        print(f"{mode}: geometric mean {geo:.3f}, worst {max(ratios):.2f}", flush=True)
    path = data.write(results_dir(env["card"], args.results))
    print(f"wrote {path}; render with: python bench/render.py", flush=True)


if __name__ == "__main__":
    main()
