"""`make wheelhouse WHEELHOUSE_SKIP=...`: leave out of the wheelhouse what the
target Python already has.

A GPU server's Python often comes with its own CUDA build of torch (a
vendor container, a cluster module); downloading torch, triton and the
nvidia-* libraries again costs several GB, and installing them over the
target's own can break it. pip resolves the wheelhouse's requirements for
the target (`pip install --dry-run --report`); this module splits that
resolution by the patterns of WHEELHOUSE_SKIP into the pins to download and
the pins left out. The wheelhouse lists the second in SKIPPED.txt: the
target must have each, at that version, for `pip install --no-index` to
resolve (or, with WHEELHOUSE_NO_DEPS=1, for vLLM to import).
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

from . import SeriesError


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def patterns(text: str) -> list[str]:
    """WHEELHOUSE_SKIP's patterns (names or globs, space- or comma-separated)."""
    return [canonical(p) for p in re.split(r"[\s,]+", text) if p]


def split_report(report: dict, skip: list[str], local: str) -> tuple[list[str], list[str]]:
    """(pins to download, pins left out) of a `pip install --report`, each
    `name==version`; ``local`` (the series' own wheel, copied in) is in
    neither. A pattern that matches nothing is an error: a misspelt name
    would otherwise download what it meant to leave out."""
    keep, left = [], []
    used = set()
    for item in report.get("install", []):
        meta = item["metadata"]
        name = canonical(meta["name"])
        if name == canonical(local):
            continue
        hit = [p for p in skip if fnmatch.fnmatchcase(name, p)]
        used.update(hit)
        (left if hit else keep).append(f"{name}=={meta['version']}")
    unused = [p for p in skip if p not in used]
    if unused:
        raise SeriesError(f"WHEELHOUSE_SKIP: {', '.join(unused)} matches no requirement of "
                          "the wheelhouse (names as pip writes them, e.g. torch, nvidia-*)")
    return sorted(keep), sorted(left)


def write_split(report_path: Path, skip_text: str, keep_path: Path, left_path: Path,
                local: str = "vllm") -> tuple[int, int]:
    """series.py wheelhouse-split: the two lists as files (requirements
    format); returns their lengths."""
    keep, left = split_report(json.loads(report_path.read_text()), patterns(skip_text), local)
    keep_path.write_text("".join(p + "\n" for p in keep))
    left_path.write_text("".join(p + "\n" for p in left))
    return len(keep), len(left)
