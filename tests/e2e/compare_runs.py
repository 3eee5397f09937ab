"""Run to run: the same engines of two or more runs, bit for bit.

`python tests/e2e/compare_runs.py RUN_A RUN_B [RUN_C ...]`, each RUN a
test_engine.py run's engine folder (its `--basetemp`'s engine0, or that
basetemp), E2E_JUDGE=later enough. For every engine whose whole
log-probabilities (run_engine.py's .logprobs.pt) are in RUN_A and another
run, one line a pair: the largest and mean |difference| of the prompt rows
(nats, over the vocabulary) and per prompt the first row that differs
("none" where the rows are bit-identical). Where the indexer's selection
starts, fp8 index scores that tie may pick other keys from run to run: an
engine deterministic up to there differs first at that row.
"""

from __future__ import annotations

import argparse
from pathlib import Path

SUFFIX = ".out.logprobs.pt"


def engine_dir(run: Path) -> Path:
    return run / "engine0" if (run / "engine0").is_dir() else run


def compare(a: list[dict], b: list[dict]) -> dict:
    """Two runs' vectors of one engine -> max, mean |d| and first differing
    row per prompt (None: identical; NaN where both are NaN counts as equal)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} prompts against {len(b)}")
    first, largest, means = [], 0.0, []
    for x, y in zip(a, b):
        p, q = x["prompt"], y["prompt"]
        if p.shape != q.shape:
            raise ValueError(f"prompt rows {tuple(p.shape)} against {tuple(q.shape)}")
        same = (p == q) | (p.isnan() & q.isnan())
        rows = (~same).any(dim=1).nonzero()
        first.append(int(rows[0]) if len(rows) else None)
        d = (p.double() - q.double()).abs().nan_to_num(nan=float("inf"), posinf=float("inf"))
        d = d.masked_fill(same, 0.0)
        largest = max(largest, float(d.max()) if d.numel() else 0.0)
        means.append(float(d.mean()) if d.numel() else 0.0)
    return {"max": largest, "mean": sum(means) / len(means) if means else 0.0, "first": first}


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    args = ap.parse_args()
    if len(args.runs) < 2:
        ap.error("two runs or more")
    dirs = [engine_dir(r) for r in args.runs]
    for d in dirs:
        if not d.is_dir():
            ap.error(f"{d}: no such folder")
    files = sorted(dirs[0].glob("*" + SUFFIX))
    if not files:
        ap.error(f"{dirs[0]}: no {SUFFIX} files (engines run with whole log-probabilities)")
    for f in files:
        a = torch.load(f, weights_only=False)
        for other in dirs[1:]:
            g = other / f.name
            if not g.is_file():
                continue
            r = compare(a, torch.load(g, weights_only=False))
            first = ", ".join("none" if i is None else str(i) for i in r["first"])
            print(f"{f.name.removesuffix(SUFFIX)} vs {other}: max {r['max']:.4f} "
                  f"mean {r['mean']:.5f} first differing row per prompt: {first}")


if __name__ == "__main__":
    main()
