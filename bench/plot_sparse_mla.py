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
from collections import defaultdict
from pathlib import Path


def read_table(path: Path, dtype: str):
    """{h_q: {kernel: [(s_q, TB/s, roofline TB/s)]}} from the first table."""
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
        roof = tbs / float(row["× roofline"])
        rows[int(row["h_q"])][row["kernel"]].append((int(row["s_q"]), tbs, roof))
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
    heads = sorted(rows)
    fig, axes = plt.subplots(1, len(heads), figsize=(4 * len(heads), 3.8), sharey=True)
    for ax, h_q in zip(axes, heads):
        roof = None
        for kernel, points in sorted(rows[h_q].items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, label=kernel)
            roof = roof or points
        ax.plot([p[0] for p in roof], [p[2] for p in roof], "k--", lw=1, label="roofline")
        ax.set_xscale("log", base=2)
        ax.set_title(f"h_q = {h_q}")
        ax.set_xlabel("s_q (tokens)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("gathered KV TB/s")
    axes[-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Sparse MLA, topk 2048, {args.dtype} — {args.table.name}", fontsize=10)
    fig.tight_layout()
    out = args.table.with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
