#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Render the benchmark data into the documents next to it.

Every ``bench/results/<card>/<bench>.jsonl`` (written by a bench script,
see bench/benchdata.py) becomes that folder's markdown tables and, for
sparse MLA, the PNG plot. Only these files are written; analysis lives in
docs/performance.md, which no tool touches. Rendering is deterministic:
the same data give the same bytes (the PNG with matplotlib's Agg backend,
its default style and no timestamp; the pinned matplotlib of
tests/requirements.txt).

    python bench/render.py                 # render every card's data
    python bench/render.py --check         # exit 1 where a file differs
    python bench/render.py --results DIR   # another results root
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections import defaultdict
from pathlib import Path

from benchdata import RESULTS, read, repo_state
from sparse_mla_work import work

DOCS = "../../../docs/performance.md"  # from bench/results/<card>/


def fmt(value, spec: str = "") -> str:
    """A table cell: empty for a figure that was not measured."""
    return "" if value is None else format(value, spec)


def table(head: list[str], align: str, rows: list[list[str]]) -> list[str]:
    """Markdown table; ``align`` has one letter per column, l or r."""
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return [
        "| " + " | ".join(head) + " |",
        rule,
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def header(run: dict) -> list[str]:
    env = run["env"]
    g = lambda k: env.get(k, "?")  # noqa: E731
    # the installed wheel's series ran; the tree beside it may be another's
    tree = (f" (checked-out tree: {env['series_checked_out']})"
            if env.get("series_checked_out") else "")
    lines = [
        (f"Date: {g('date_utc')} UTC. Card: {g('card')} ({g('sms')} SMs, capability "
         f"{g('capability')}), driver {g('driver')}, torch {g('torch')}, triton "
         f"{g('triton')}. Series {g('series')}{tree}, repo commit {g('commit')}. "
         f"Command: `{g('command')}`."),
    ]
    for note in run.get("notes", []):
        lines += ["", note]
    return lines


def footer(bench: str) -> list[str]:
    return [
        "",
        (f"Rendered by bench/render.py from `{bench}.jsonl`; analysis and what "
         f"was tried: [docs/performance.md]({DOCS})."),
    ]


def rows_of(rows: list[dict], name: str) -> list[tuple[dict, dict]]:
    return [(r["inputs"], r["figures"]) for r in rows if r["table"] == name]


def cfg_text(cfg) -> str:
    return "auto" if isinstance(cfg, str) else "(" + ", ".join(map(repr, cfg)) + ")"


# ---------------------------------------------------------------------------
# Sparse MLA (bench_sparse_mla.py)
# ---------------------------------------------------------------------------

SPARSE_MLA_ABOUT = (
    "topk 2048, d_qk 576, d_v 512, kv pool {kv_rows:,} rows, unique random indices per token. "
    "`triton`: this GPU's tables, config and split count as sparse_mla_fwd's auto_config "
    "picks them for this GPU (with --sweep, the prefill configs are the sweep's picks, see "
    "below); `triton-sm120cfg`: the SM120/SM121 tables, picked the same way for this GPU's "
    "SMs, run here; `triton-sm120-1cta`: the same with one CTA per SM, as on SM120 (emulated: "
    "launched with 116 KB of dynamic shared memory, auto_config told 100 KB per SM; see "
    "bench/sm120_occupancy.py); `triton-nogluon` (SM90 "
    "only, rows where it differs): the Triton kernel with the configs SM100 uses, i.e. without the "
    "Hopper Gluon kernels; `flashmla`: "
    "_flashmla_C.sparse_prefill_fwd from the pinned wheel, bf16 only, h_q padded to 64 "
    "(as vLLM pads); `vllm-triton`: upstream vLLM's own Triton sparse MLA (TRITON_MLA_SPARSE "
    "of vLLM's main branch, split-KV decode, its own split heuristic; bf16 only), from the "
    "source tree the run names. × FlashMLA speed = FlashMLA time / this time, × vLLM Triton "
    "speed likewise. Times per call from CUDA-graph "
    "replays over rotated inputs (no host launch overhead; see bench/harness.py)."
)


def sparse_mla_md(run: dict, rows: list[dict]) -> str:
    f = run["figures"]
    out = ["# Sparse MLA timings", "", *header(run), ""]
    if "copy_tbps" in f:
        out += [
            (f"Ceilings measured in this run: copy {f['copy_tbps']:.2f} TB/s (read+write), "
             f"bf16 matmul {f['matmul_tflops']:.0f} TFLOP/s."),
            "",
        ]
    # runs before --kv-rows gathered from harness.POOL's 262,144 rows
    out += [SPARSE_MLA_ABOUT.format(kv_rows=f.get("kv_pool_rows", 262144)), ""]
    out += table(
        ["dtype", "h_q", "s_q", "kernel", "µs", "TFLOP/s", "gathered TB/s",
         "× roofline", "× FlashMLA speed", "× vLLM Triton speed"],
        "lrrlrrrrrr",
        [
            [i["dtype"], str(i["h_q"]), str(i["s_q"]), i["kernel"], fmt(m["us"], ".1f"),
             fmt(m["tflops"], ".1f"), fmt(m["gathered_tbps"], ".2f"),
             fmt(m["x_roofline"], ".2f"), fmt(m["x_flashmla"], ".2f"),
             fmt(m.get("x_vllm_triton"), ".2f")]
            for i, m in rows_of(rows, "timings")
        ],
    )  # fmt: skip
    sweep = rows_of(rows, "sweep")
    if sweep:
        out += ["", "## Config sweep (bf16)", ""]
        out += table(
            ["case", "config (block_h, block_n, warps, stages, hoist, gluon)", "num_splits", "µs"],
            "llrr",
            [[i["case"], cfg_text(i["config"]), str(i["num_splits"]), fmt(m["us"], ".1f")]
             for i, m in sweep],
        )  # fmt: skip
    if "sweep_picks" in f:
        out += ["", ("Picked prefill configs (used for the tables above): "
                     f"{json.dumps(f['sweep_picks'])}")]
    checks = rows_of(rows, "pick_check")
    if checks:
        out += [""] + table(
            ["pick", "case", "rel err vs fp64", ""],
            "llrl",
            [[f"{i['pick']} {cfg_text(i['config'])}", f"{i['dtype']} h{i['h_q']}",
              fmt(m["rel_err"], ".2e"), "ok" if m["ok"] else "FAIL"] for i, m in checks],
        )  # fmt: skip
    if "prefill_picks" in f:
        out += ["", ("Prefill configs timed instead of the tables': "
                     f"{json.dumps(f['prefill_picks'])}")]
    return "\n".join(out + footer("sparse_mla")) + "\n"


def sparse_mla_accuracy_md(run: dict, rows: list[dict]) -> str:
    out = ["# Sparse MLA accuracy vs fp64 reference", "", *header(run), ""]
    out += [
        ("topk 2048, s_kv 65536, unique random indices, sm_scale 576^-0.5; rel err = "
         "||out - ref|| / ||ref||; lse error in natural-log units."),
        "",
    ]
    out += table(
        ["dtype", "h_q", "s_q", "path", "triton rel err", "triton max abs lse err",
         "FlashMLA rel err", "vLLM Triton rel err"],
        "lrrlrrrr",
        [[i["dtype"], str(i["h_q"]), str(i["s_q"]), i["path"], fmt(m["rel_err"], ".2e"),
          fmt(m["lse_max_abs_err"], ".1e"), fmt(m["flashmla_rel_err"], ".2e"),
          fmt(m.get("vllm_triton_rel_err"), ".2e")]
         for i, m in rows_of(rows, "accuracy")],
    )  # fmt: skip
    if "empty_row_probe" in run["figures"]:
        out += ["", run["figures"]["empty_row_probe"]]
    return "\n".join(out + footer("sparse_mla")) + "\n"


def sparse_mla_png(run: dict, rows: list[dict], dtype: str = "bf16") -> bytes:
    """Gathered-bytes throughput against s_q, one panel per head count, one
    line per kernel, with the roofline of the same run drawn in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for i, m in rows_of(rows, "timings"):
        if i["dtype"] == dtype:
            points[i["h_q"]][i["kernel"]].append((i["s_q"], m["gathered_tbps"]))
    if not points:
        raise ValueError(f"sparse_mla: no {dtype} timings to plot")
    copy_bw = run["figures"]["copy_tbps"] * 1e12
    mm_rate = run["figures"]["matmul_tflops"] * 1e12

    def roof(h_q: int, s_q: int) -> float:
        flops, nbytes = work(s_q, h_q, elt=2)
        return nbytes / max(nbytes / copy_bw, flops / mm_rate) / 1e12

    heads = sorted(points)
    kernels = sorted({k for by_kernel in points.values() for k in by_kernel})
    colors = {k: f"C{n}" for n, k in enumerate(kernels)}  # same colour in every panel
    with matplotlib.rc_context():
        matplotlib.rcdefaults()  # no user style: the same bytes everywhere
        fig, axes = plt.subplots(1, len(heads), figsize=(4 * len(heads), 3.8), sharey=True)
        axes = axes if len(heads) > 1 else [axes]
        for ax, h_q in zip(axes, heads, strict=True):
            s_qs = set()
            for kernel, pts in sorted(points[h_q].items()):
                pts.sort()
                s_qs.update(p[0] for p in pts)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                        label=kernel, color=colors[kernel])  # fmt: skip
            xs = sorted(s_qs)
            ax.plot(xs, [roof(h_q, x) for x in xs], "k--", lw=1, label="roofline")
            ax.set_xscale("log", base=2)
            ax.set_title(f"h_q = {h_q}")
            ax.set_xlabel("s_q (tokens)")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("gathered KV TB/s")
        axes[-1].legend(fontsize=8, loc="lower right")
        env = run["env"]
        fig.suptitle(
            f"Sparse MLA, topk 2048, {dtype} — {env.get('card', '?')}, "
            f"{env.get('date_utc', '?')} UTC",
            fontsize=10,
        )
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
        plt.close(fig)
    return buf.getvalue()


# ---------------------------------------------------------------------------
# Sparse MLA path choice (sweep_sparse_mla_paths.py)
# ---------------------------------------------------------------------------


def sparse_mla_paths_md(run: dict, rows: list[dict]) -> str:
    out = ["# Sparse MLA: the automatic path and split choice against every option", ""]
    out += [*header(run), ""]
    out += [
        ("bf16, topk 2048, GLM-5 shapes, times per call from CUDA-graph replays over "
         "rotated inputs. For each (h_q, s_q): the table's prefill config in one pass and "
         "its decode config over topk in 1, 2, 4, … splits (`decode/1`: the decode config "
         "in one pass), then the one `auto_config` picks. Every option's time is in the data.")
    ]
    paths = rows_of(rows, "paths")
    for mi, mf in rows_of(rows, "modes"):
        mode = mi["mode"]
        out += [
            "",
            (f"**{mode}** ({mi['tables']} tables, {mi['sms']} SMs, {mi['shared_per_sm']} B "
             "of shared memory per SM as auto_config sees it)"),
            "",
        ]
        out += table(
            ["h_q", "s_q", "choice", "µs", "fastest", "µs", "choice / fastest"],
            "rrlrlrr",
            [[str(i["h_q"]), str(i["s_q"]), m["choice"], fmt(m["choice_us"], ".1f"),
              m["fastest"], fmt(m["fastest_us"], ".1f"), fmt(m["ratio"], ".2f")]
             for i, m in paths if i["mode"] == mode],
        )  # fmt: skip
        out += [
            "",
            (f"{mode}: choice / fastest option, geometric mean {mf['geo_mean']:.3f}, worst "
             f"{mf['worst']:.2f}, within 5 % in {mf['within_5pct']} of {mf['cases']} cases."),
        ]
    return "\n".join(out + footer("sparse_mla_paths")) + "\n"


# ---------------------------------------------------------------------------
# Few-token bounds (sparse_mla_decode_bounds.py)
# ---------------------------------------------------------------------------


def sparse_mla_decode_bounds_md(run: dict, rows: list[dict]) -> str:
    out = ["# Sparse MLA with few tokens: where the time goes", "", *header(run)]
    bounds = rows_of(rows, "bounds")
    if bounds:
        out += [
            "",
            (f"Copy bandwidth in this run: {run['figures']['copy_tbps']:.2f} TB/s (read + "
             "write). Copy-bound = the gathered bytes (s_q × 2048 × 576 × 2) at that rate. "
             "µs per call."),
            "",
        ]

        def label(i: dict) -> str:
            flags = (" hoist" if i["hoist"] else "") + (" gluon" if i["gluon"] else "")
            return f"{cfg_text(i['config'])}{flags} × {i['splits']}"

        out += table(
            ["tables", "h_q", "s_q", "config × splits", "call", "main", "merge (call − main)",
             "main, rows in L2", "gather floor (splits)", "copy-bound", "call ÷ floor"],
            "lrrlrrrrrrr",
            [[i["tables"], str(i["h_q"]), str(i["s_q"]), label(i), fmt(m["call_us"], ".1f"),
              fmt(m["main_us"], ".1f"), fmt(m["merge_us"], ".1f"), fmt(m["l2_us"], ".1f"),
              f"{m['floor_us']:.1f} ({m['floor_splits']})", fmt(m["copy_us"], ".1f"),
              fmt(m["x_floor"], ".2f")] for i, m in bounds],
        )  # fmt: skip
    sass = rows_of(rows, "sass")
    if sass:
        ops = list(sass[0][1]["counts"])
        out += [
            "",
            "## Compiler report",
            "",
            "Per loop iteration (one block of rows), one warp, 16-head block:",
            "",
        ]
        out += table(
            ["target", "config", "shared B", "registers", "instructions per iteration", *ops],
            "llrrr" + "r" * len(ops),
            [[i["target"], f"{i['path']} {cfg_text(i['config'])}{' hoist' if i['hoist'] else ''}",
              str(m["shared_bytes"]), str(m["registers"]), str(m["instructions"]),
              *(str(m["counts"][o]) for o in ops)] for i, m in sass],
        )  # fmt: skip
    return "\n".join(out + footer("sparse_mla_decode_bounds")) + "\n"


# ---------------------------------------------------------------------------
# DSA indexer (bench_dsa_indexer.py)
# ---------------------------------------------------------------------------


def dsa_indexer_md(run: dict, rows: list[dict]) -> str:
    out = ["# DSA indexer: Triton vs DeepGEMM", "", *header(run)]
    if "deep_gemm" in run["figures"]:
        out += ["", f"DeepGEMM: {run['figures']['deep_gemm']}."]
    if "vllm_triton" in run["figures"]:
        out += ["", (f"vLLM Triton: upstream vLLM's Triton MQA logits (vLLM main, "
                     f"mqa_logits_triton.py): {run['figures']['vllm_triton']}.")]
    checks = rows_of(rows, "checks")
    if checks:
        n_ok = sum(m["ok"] for _, m in checks)
        out += ["", f"## Checks ({n_ok} of {len(checks)} pass)", ""]
        out += table(
            ["check", "result", "figures"],
            "lll",
            [[i["name"], "ok" if m["ok"] else "FAIL",
              json.dumps({k: v for k, v in m.items() if k != "ok"}, sort_keys=True)]
             for i, m in checks],
        )  # fmt: skip
    timings = rows_of(rows, "timings")
    if timings:
        out += [
            "",
            "## Timings (median ms)",
            "",
            ("TFLOP/s counts 2 * 32 * 128 per (token, key) pair inside the windows; TB/s counts "
             "the cache bytes of the context (132 per token) only. DeepGEMM's decode time "
             "excludes its schedule-metadata kernel."),
            "",
        ]

        def case(i: dict, m: dict) -> str:
            if i["kind"] == "prefill":
                return f"prefill T={i['T']} S={i['S']} reqs={i['reqs']}"
            return (f"decode B={i['B']} next_n={i['next_n']} max_len={i['max_len']}, "
                    f"mean ctx {m['mean_ctx']:,.0f}")  # fmt: skip

        def rate(m: dict) -> str:
            if m.get("triton_tflops") is not None:
                return f"{m['triton_tflops']:.0f} TFLOP/s"
            if m.get("triton_kv_TBps") is not None:
                return f"{m['triton_kv_TBps']:.2f} TB/s"
            return ""

        out += table(
            ["case", "Triton", "Triton in a CUDA graph", "DeepGEMM", "DeepGEMM / Triton",
             "Triton rate", "torch top-k fallback", "vLLM Triton", "vLLM Triton / Triton",
             "vLLM Triton: rel diff, top-k rows differing"],
            "lrrrrrrrrl",
            [[case(i, m), fmt(m.get("triton_ms"), ".4g"), fmt(m.get("triton_graph_ms"), ".4g"),
              fmt(m.get("deepgemm_ms"), ".4g"), fmt(m.get("ratio_dg_over_triton"), ".2f"),
              rate(m), fmt(m.get("fallback_topk_ms"), ".4g"), fmt(m.get("vllm_triton_ms"), ".4g"),
              fmt(m.get("ratio_vllm_triton_over_triton"), ".2f"),
              (f"{m['vllm_triton_rel_diff']:.1e}, {m['vllm_triton_topk_rows_differing']}"
               if m.get("vllm_triton_rel_diff") is not None else "")] for i, m in timings],
        )  # fmt: skip
    sweep = rows_of(rows, "sweep")
    if sweep:
        out += ["", "## Tile sweep (ms; each config's logits checked against the default's)", ""]
        out += table(
            ["kind", "shape", "config", "ms", "ok", "rel vs default", "error"],
            "lllrlrl",
            [[i["kind"], fmt(i.get("shape")), json.dumps(i["config"], sort_keys=True),
              fmt(m.get("ms"), ".4g"), fmt(m.get("ok")), fmt(m.get("rel_vs_default"), ".1e"),
              m.get("error", "")] for i, m in sweep],
        )  # fmt: skip
    return "\n".join(out + footer("dsa_indexer")) + "\n"


def _triton_dequant(m: dict) -> str:
    """The candidate Triton dequantizer's time and its distance from
    ggml_dequantize's values (max |diff| / max |value|)."""
    if m.get("triton_dequant_ms") is None:
        return ""
    return f"{m['triton_dequant_ms']:.4g} (diff {m['triton_dequant_max_diff']:.1e})"


def _fused(m: dict) -> str:
    """The fused MoE's time, tile and distance from the fp16 path."""
    if m.get("fused_ms") is None:
        return ""
    return f"{m['fused_ms']:.4g} ({m['fused_config']}, diff {m['fused_max_diff']:.1e})"


def _marlin(m: dict) -> str:
    """The Marlin repack's time and distance from the fp16 path, and where
    timed apart, its Marlin GEMMs' and its float path's."""
    if m.get("marlin_ms") is None:
        return f"failed: {m['marlin_error']}" if m.get("marlin_error") else ""
    out = f"{m['marlin_ms']:.4g} (diff {m['marlin_max_diff']:.1e})"
    if m.get("marlin_float_ms") is not None:
        out += (f"; GEMMs {m['marlin_kernel_ms']:.4g}, float path "
                f"{m['marlin_float_ms']:.4g} (diff {m['marlin_float_max_diff']:.1e})")
    return out


def gguf_gemm_md(run: dict, rows: list[dict]) -> str:
    out = ["# GGUF matrix kernels against fp16 weights through the float kernels", "",
           *header(run), "",
           ("GGUF: vLLM's own path for the layer (MoE: `_fused_moe_gguf`, ggml's MMQ kernel "
            "above 64 tokens where both types have one, else the vector kernel; linear: "
            "`_fused_mul_mat_gguf`). fp16: the same weights dequantized once, through "
            "`fused_experts` (Triton) or `torch.matmul`. Dequantize: all of the layer's "
            "weights to fp16, once. GGUF / fp16 > 1: the GGUF kernel is slower; (dequantize "
            "+ fp16) / GGUF < 1: dequantizing per call would be faster. Engine: the op with "
            "the series' defaults (dequantize + the float kernels from a batch size on); "
            "GGUF / engine: its speed-up over ggml's kernels. MMQ, vector: ggml's two MoE "
            "kernels forced at any batch size. Dequantize (Triton): the series' dequantizer of "
            "the float paths (gguf_dequant.py), with its largest difference from ggml_dequantize's "
            "values relative to the largest value. Fused (Triton): the series' fused MoE "
            "(gguf_fused_moe.py, VLLM_GGUF_KERNELS=fused), which reads the GGUF blocks in its "
            "GEMMs, at its fastest "
            "tile, with its largest difference from the fp16 path's output. Marlin (runs "
            "since it exists): the layer as the engine runs Q4_K, Q4_0 and Q8_0 experts, "
            "repacked for vLLM's Marlin MoE kernel (gguf_marlin_moe.py), with its largest "
            "difference from the fp16 path's output; in runs that timed them apart, above "
            "the graph-timed sizes also its Marlin GEMMs and its float path from the Marlin "
            "weights (the engine's pick on SM90 from FLOAT_MIN_TOKENS). Median ms.")]
    moe = rows_of(rows, "moe")
    for shape in dict.fromkeys(i["shape"] for i, _ in moe):
        first = next(i for i, _ in moe if i["shape"] == shape)
        out += ["", (f"## Routed experts, {shape}: {first['experts']} experts, hidden "
                     f"{first['hidden']}, moe_intermediate {first['moe_intermediate']}, "
                     f"top-{first['top_k']}"), ""]
        marlin = any("marlin_ms" in m for i, m in moe if i["shape"] == shape)
        out += table(
            ["type", "tokens", "kernel", "GGUF", "fp16", "GGUF / fp16", "dequantize",
             "(dequantize + fp16) / GGUF", "GGUF TFLOP/s", "engine", "GGUF / engine",
             "MMQ", "vector", "dequantize (Triton)", "fused (Triton)",
             *(["Marlin"] if marlin else []), "notes"],
            "lrlrrrrrrrrrrrr" + ("r" if marlin else "") + "l",
            [[i["type"], f"{i['tokens']:,}", fmt(m.get("kernel")), fmt(m.get("gguf_ms"), ".4g"),
              fmt(m.get("f16_fused_ms"), ".4g"),
              fmt(m["gguf_ms"] / m["f16_fused_ms"] if m.get("gguf_ms") else None, ".2f"),
              fmt(m.get("dequant_all_ms"), ".4g"),
              fmt((m["dequant_all_ms"] + m["f16_fused_ms"]) / m["gguf_ms"]
                  if m.get("gguf_ms") else None, ".2f"),
              fmt(m.get("gguf_tflops"), ".1f"), fmt(m.get("engine_ms"), ".4g"),
              fmt(m["gguf_ms"] / m["engine_ms"] if m.get("engine_ms") and m.get("gguf_ms")
                  else None, ".2f"),
              fmt(m.get("mmq_ms"), ".4g"), fmt(m.get("vec_ms"), ".4g"),
              _triton_dequant(m), _fused(m), *([_marlin(m)] if marlin else []),
              "; ".join(m.get("notes") or [])]
             for i, m in moe if i["shape"] == shape],
        )  # fmt: skip
        graphed = [(i, m) for i, m in moe if i["shape"] == shape and m.get("vec_graph_ms")]
        if graphed:
            also = " and the Marlin repack" if marlin else ""
            out += ["", (f"Decode batches of {shape}: ggml's MMQ and vector kernels{also} "
                         "replayed in a CUDA graph, as the engine runs them. Median ms."), ""]
            out += table(
                ["type", "tokens", "MMQ", "vector", "vector / MMQ",
                 *(["Marlin"] if marlin else [])], "lrrrr" + ("r" if marlin else ""),
                [[i["type"], f"{i['tokens']:,}", fmt(m.get("mmq_graph_ms"), ".4g"),
                  fmt(m["vec_graph_ms"], ".4g"),
                  fmt(m["vec_graph_ms"] / m["mmq_graph_ms"] if m.get("mmq_graph_ms") else None,
                      ".2f"),
                  *([fmt(m.get("marlin_graph_ms"), ".4g")] if marlin else [])]
                 for i, m in graphed],
            )  # fmt: skip
    dense = rows_of(rows, "dense")
    if dense:
        out += ["", "## Linear layers (one TP rank: GLM-5 TP-8 unless named)", ""]
        def taken(*keys: str, note: str) -> bool:
            """Whether the run took a column's figures (runs since it was
            added): any row with one of keys; its note then goes above the
            table."""
            found = any(k in m for _, m in dense for k in keys)
            if found:
                out.extend([note, ""])
            return found

        graphed = taken("engine_graph_ms", note=(
            "Engine (graph): the engine's choice replayed in a CUDA graph, as decode "
            "batches run it (up to 256 tokens)."))
        floated = taken("float_graph_ms", note=(
            "Float (graph): gguf_dequant's weight and torch.matmul replayed in a CUDA "
            "graph, whichever path the engine takes (up to 256 tokens)."))
        chained = taken("f16_chain_ms", note=(
            "Chained: one call among calls on distinct copies of the weight (256 MiB of "
            "them) back to back in one CUDA graph, as a step's layers run: no launch gap "
            "of the host, which the (graph) columns hold, and each weight read from memory "
            "(up to 32 tokens): the engine's choice, the float path, torch.matmul on the "
            "fp16 weight."))
        sharded = taken("shards_chain_ms", note=(
            "Shard by shard (chained): a fused layer (q_a+kv_a, gate_up) as vLLM 0.23 runs "
            "it, the engine's choice a shard and their concatenation; the series runs "
            "shards of one type as one weight (0035), the engine (chained) column."))
        marlin = taken("marlin_ms", "marlin_error", note=(
            "Marlin: vLLM's dense Marlin GEMM on the weight repacked as "
            "gguf_marlin_linear repacks it (the engine's path with "
            "VLLM_GGUF_MARLIN_LINEARS=1; runs before it: 0028's expert repack, a "
            "candidate), with its distance from the fp16 product; Marlin (graph) "
            "replayed in a CUDA graph."))
        marlin_chained = taken("marlin_chain_ms", note=(
            "Marlin (chained): Marlin's GEMM as the chained columns above."))
        out += table(
            ["layer", "type", "tokens", "GGUF", "fp16 matmul", "GGUF / fp16", "dequantize",
             "(dequantize + fp16) / GGUF", "engine", "GGUF / engine", "dequantize (Triton)",
             *(["engine (graph)"] if graphed else []),
             *(["float (graph)"] if floated else []),
             *(["engine (chained)", "float (chained)", "fp16 (chained)"] if chained else []),
             *(["shard by shard (chained)"] if sharded else []),
             *(["Marlin", "Marlin (graph)"] if marlin else []),
             *(["Marlin (chained)"] if marlin_chained else [])],
            "llrrrrrrrrr" + ("r" if graphed else "") + ("r" if floated else "")
            + ("rrr" if chained else "") + ("r" if sharded else "") + ("rr" if marlin else "")
            + ("r" if marlin_chained else ""),
            [[i["shape"], i["type"], f"{i['tokens']:,}", fmt(m.get("gguf_ms"), ".4g"),
              fmt(m.get("f16_matmul_ms"), ".4g"), fmt(m["gguf_ms"] / m["f16_matmul_ms"], ".2f"),
              fmt(m.get("dequant_ms"), ".4g"),
              fmt((m["dequant_ms"] + m["f16_matmul_ms"]) / m["gguf_ms"], ".2f"),
              fmt(m.get("engine_ms"), ".4g"),
              fmt(m["gguf_ms"] / m["engine_ms"] if m.get("engine_ms") else None, ".2f"),
              _triton_dequant(m),
              *([fmt(m.get("engine_graph_ms"), ".4g")] if graphed else []),
              *([fmt(m.get("float_graph_ms"), ".4g")] if floated else []),
              *([fmt(m.get(f"{k}_chain_ms"), ".4g") for k in ("engine", "float", "f16")]
                if chained else []),
              *([fmt(m.get("shards_chain_ms"), ".4g")] if sharded else []),
              *([_marlin(m), fmt(m.get("marlin_graph_ms"), ".4g")] if marlin else []),
              *([fmt(m.get("marlin_chain_ms"), ".4g")] if marlin_chained else [])]
             for i, m in dense],
        )  # fmt: skip
    return "\n".join(out + footer("gguf_gemm")) + "\n"


# bench -> {file name: renderer}
RENDERERS = {
    "sparse_mla": {
        "sparse_mla.md": sparse_mla_md,
        "sparse_mla_accuracy.md": sparse_mla_accuracy_md,
        "sparse_mla.png": sparse_mla_png,
    },
    "sparse_mla_paths": {"sparse_mla_paths.md": sparse_mla_paths_md},
    "sparse_mla_decode_bounds": {"sparse_mla_decode_bounds.md": sparse_mla_decode_bounds_md},
    "dsa_indexer": {"dsa_indexer.md": dsa_indexer_md},
    "gguf_gemm": {"gguf_gemm.md": gguf_gemm_md},
}


def renderers() -> dict:
    """RENDERERS and the engine benchmark's (make bench-engine), which
    builds on this module's helpers (so it is imported late)."""
    from engine.record import RENDERERS as engine

    return {**RENDERERS, **engine}


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def other_series(run: dict, checked_out: str) -> str | None:
    """A note when a record was measured on a series other than the one
    checked out (its figures describe that series, not this one)."""
    measured = run.get("series") or run.get("env", {}).get("series")
    if measured and measured != checked_out:
        return f"measured with series {measured}; the checked-out series is {checked_out}"
    return None


def render_all(root: Path, check: bool, png: bool) -> list[str]:
    """Render (or with ``check`` compare) every card's data under ``root``.
    Returns the problems found (check) or an empty list. Records of another
    series than the checked-out one are named on stderr."""
    problems = []
    checked_out = repo_state()["series"]
    sources = sorted(root.glob("*/*.jsonl"))
    if not sources:
        problems.append(f"{root}: no <card>/<bench>.jsonl files")
    for src in sources:
        bench = src.stem
        if bench not in renderers():
            problems.append(f"{src}: unknown bench {bench!r} (known: {sorted(renderers())})")
            continue
        run, rows = read(src)
        if note := other_series(run, checked_out):
            print(f"note: {src}: {note}", file=sys.stderr)
        if run.get("bench") != bench:
            problems.append(f"{src}: run record names bench {run.get('bench')!r}, file {bench!r}")
            continue
        for name, fn in renderers()[bench].items():
            target = src.parent / name
            if name.endswith(".png"):
                if not png:
                    print(f"skipped {target} (matplotlib not installed or --no-png)")
                    continue
                if not any(r["table"] == "timings" for r in rows):
                    continue
                content = fn(run, rows)
            else:
                content = fn(run, rows).encode("utf-8")
            if check:
                if not target.exists():
                    problems.append(f"{target}: missing (render it: python bench/render.py)")
                elif target.read_bytes() != content:
                    problems.append(f"{target}: differs from what {src.name} renders")
            elif not target.exists() or target.read_bytes() != content:
                target.write_bytes(content)
                print(f"wrote {target}")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="results root (default bench/results)")
    ap.add_argument("--check", action="store_true",
                    help="compare, write nothing; exit 1 on a difference")
    ap.add_argument("--no-png", action="store_true", help="leave the plots out")
    args = ap.parse_args()
    png = not args.no_png and has_matplotlib()
    if not png and not args.no_png:
        print("note: matplotlib is not installed: plots not rendered "
              "(pip install -r tests/requirements.txt)", file=sys.stderr)  # fmt: skip
    problems = render_all(args.results, args.check, png)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
