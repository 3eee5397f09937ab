#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Plot a sparse MLA timing table (bench_sparse_mla.py --out) as a PNG:
gathered-bytes throughput against s_q, one panel per head count, one line per
kernel, with the roofline of the same run drawn in.

    python bench/plot_sparse_mla.py bench/results/sparse_mla_h200.md [--dtype bf16]

Writes the PNG next to the table (same name, .png). Needs matplotlib.
"""

import argparse
import re
from collections import defaultdict
from pathlib import Path

from sparse_mla_work import work


def roofline(text: str):
    """Gathered TB/s at the roofline, as a function of (h_q, s_q), from the
    ceilings in the table's header (the table's own ratio column is rounded
    to 2 digits, too coarse for the small-s_q points)."""
    copy, mm = re.search(r"copy ([\d.]+) TB/s.*?matmul ([\d.]+) TFLOP/s", text).groups()
    copy_bw, mm_rate = float(copy) * 1e12, float(mm) * 1e12

    def at(h_q: int, s_q: int) -> float:
        flops, nbytes = work(s_q, h_q, elt=2)
        return nbytes / max(nbytes / copy_bw, flops / mm_rate) / 1e12

    return at


def read_table(path: Path, dtype: str):
    """{h_q: {kernel: [(s_q, TB/s)]}} from the first table."""
    rows: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    header = None
    for line in path.read_text().splitlines():
        if not line.startswith("|"):
            if header and rows:
                break  # the timing table is the first one; sweeps follow
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None or cells[0] == "dtype":
            header = cells
            continue
        if set(cells[0]) <= set("-: "):
            continue
        row = dict(zip(header, cells))
        if row["dtype"] != dtype:
            continue
        tbs = float(row["gathered TB/s"])
        rows[int(row["h_q"])][row["kernel"]].append((int(row["s_q"]), tbs))
    if not rows:
        raise SystemExit(f"{path}: no {dtype} rows in the timing table")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("table", type=Path)
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_table(args.table, args.dtype)
    roof = roofline(args.table.read_text())
    heads = sorted(rows)
    fig, axes = plt.subplots(1, len(heads), figsize=(4 * len(heads), 3.8), sharey=True)
    kernels = sorted({k for by_kernel in rows.values() for k in by_kernel})
    colors = {k: f"C{i}" for i, k in enumerate(kernels)}  # same colour in every panel
    for ax, h_q in zip(axes, heads):
        s_qs = set()
        for kernel, points in sorted(rows[h_q].items()):
            points.sort()
            s_qs.update(p[0] for p in points)
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                marker="o",
                ms=3,
                label=kernel,
                color=colors[kernel],
            )
        xs = sorted(s_qs)
        ax.plot(xs, [roof(h_q, x) for x in xs], "k--", lw=1, label="roofline")
        ax.set_xscale("log", base=2)
        ax.set_title(f"h_q = {h_q}")
        ax.set_xlabel("s_q (tokens)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("gathered KV TB/s")
    axes[-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(
        f"Sparse MLA, topk 2048, {args.dtype} — {args.table.name}", fontsize=10
    )
    fig.tight_layout()
    out = args.table.with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
