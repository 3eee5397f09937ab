# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark results as data: where they live and how they are written.

A helper module (imported by the bench scripts and bench/render.py, never
run). No torch at import: the renderer and the CPU tests use it without a
GPU.

One run of one bench is one JSON-lines file,
``bench/results/<card slug>/<bench>.jsonl``:

- the first line, ``{"record": "run", "bench": ..., "env": {...},
  "figures": {...}, "notes": [...]}``: the environment (card, driver,
  torch, triton, the series label of the vLLM that ran, repo commit,
  command, date) and the run's own figures (e.g. the measured copy
  bandwidth);
- then one line per measured case, ``{"record": "row", "table": ...,
  "inputs": {...}, "figures": {...}}``: what was run and every number
  measured (or derived from the measurements) for it.

bench/render.py turns these files into the markdown tables and the plot
next to them; nothing else writes into bench/results/<card slug>/.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def card_slug(device_name: str) -> str:
    """The folder name of a card's results: its whole device name,
    lower-case, every run of other characters than letters and digits one
    ``-`` ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition" ->
    ``nvidia-rtx-pro-6000-blackwell-workstation-edition``)."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    if not slug:
        raise ValueError(f"device name {device_name!r} gives an empty card slug")
    return slug


def results_dir(device_name: str, root: Path | None = None) -> Path:
    """bench/results/<card slug> (or <root>/<card slug>)."""
    return (RESULTS if root is None else Path(root)) / card_slug(device_name)


def _run(cmd: list[str]) -> str:
    try:
        out = subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, timeout=60, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def repo_state() -> dict[str, str]:
    """The series label (wheel version) and the repo commit of this tree;
    ``-dirty`` when tracked files differ from the commit."""
    commit = _run(["git", "rev-parse", "--short=12", "HEAD"])
    if commit != "unknown" and _run(["git", "status", "--porcelain", "-uno"]):
        commit += "-dirty"
    series = _run([sys.executable, str(REPO / "scripts" / "series.py"), "version"])
    return {"series": series, "commit": commit}


def measured_series(checked_out: str) -> dict[str, str]:
    """The series a run measures: the version of the vLLM this Python
    imports (the servers and kernels run it), which need not be the
    checked-out series (a wheel built from another commit, a branch's
    tree beside main's wheel). ``series_checked_out`` names the tree's
    when the two differ; without an installed vLLM, the tree's."""
    from importlib import metadata

    try:
        installed = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return {"series": checked_out}
    if installed == checked_out:
        return {"series": installed}
    return {"series": installed, "series_checked_out": checked_out}


def environment() -> dict[str, Any]:
    """Where this run happens: date, card (CUDA device 0), driver,
    software, series and commit. Needs torch (and a GPU for the card)."""
    import platform

    import torch
    import triton

    env: dict[str, Any] = {
        "date_utc": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(
            card=p.name,
            sms=p.multi_processor_count,
            capability=f"{p.major}.{p.minor}",
            shared_per_sm=p.shared_memory_per_multiprocessor,
            driver=_run(
                [
                    "nvidia-smi",
                    "-i",
                    "0",
                    "--query-gpu=driver_version",
                    "--format=csv,noheader",
                ]
            ),
        )
    state = repo_state()
    env.update(measured_series(state["series"]), commit=state["commit"])
    env["command"] = command_line(sys.argv)
    return env


def portable_path(arg: str) -> str:
    """An argument as it may be committed: paths inside the repo relative
    to it, inside the Python environment as ``<venv>/…``, other absolute
    paths cut to ``…/<last two parts>`` (no machine's folders in the data)."""
    if "=" in arg and arg.startswith("-"):
        opt, value = arg.split("=", 1)
        return f"{opt}={portable_path(value)}"
    if not os.path.isabs(arg):
        return arg
    path = Path(arg).resolve()
    for root, name in ((Path(sys.prefix).resolve(), "<venv>"), (REPO, None)):
        if path == root or root in path.parents:
            rel = path.relative_to(root).as_posix()
            return rel if name is None else f"{name}/{rel}"
    return "…/" + "/".join(path.parts[-2:])


def command_line(argv: list[str]) -> str:
    return " ".join(portable_path(a) for a in argv)


class BenchData:
    """The records of one run of one bench, written in one go by
    :meth:`write` (a failed run leaves the previous file as it was). With
    :meth:`keep_partial`, each row is also appended to
    ``<bench>.jsonl.partial`` as it is measured, so that a run killed
    before :meth:`write` (a time limit, a machine taken back) keeps what
    it measured beside the previous file."""

    def __init__(self, bench: str, env: dict[str, Any]):
        if not re.fullmatch(r"[a-z0-9_]+", bench):
            raise ValueError(f"bench name {bench!r}: use [a-z0-9_]")
        self.bench = bench
        self.env = dict(env)
        self.figures: dict[str, Any] = {}
        self.notes: list[str] = []
        self.rows: list[dict[str, Any]] = []
        self._partial: Path | None = None

    def keep_partial(self, folder: Path) -> Path:
        """Start <folder>/<bench>.jsonl.partial: the run record (without the
        figures known at the end), then each row as :meth:`row` records it."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._partial = folder / f"{self.bench}.jsonl.partial"
        self._partial.write_text("", encoding="utf-8")
        for r in [self._run_record(), *self.rows]:
            self._append(r)
        return self._partial

    def _append(self, record: dict[str, Any]) -> None:
        with open(self._partial, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")

    def row(self, table: str, inputs: dict[str, Any], **figures: Any) -> None:
        """One measured case of ``table``: what ran and what was measured."""
        record = {"record": "row", "table": table, "inputs": inputs, "figures": figures}
        self.rows.append(record)
        if self._partial is not None:
            self._append(record)

    def _run_record(self) -> dict[str, Any]:
        return {
            "record": "run",
            "bench": self.bench,
            "env": self.env,
            "figures": self.figures,
            "notes": self.notes,
        }

    def lines(self) -> list[str]:
        return [json.dumps(r, ensure_ascii=False) for r in [self._run_record(), *self.rows]]

    def write(self, folder: Path) -> Path:
        """<folder>/<bench>.jsonl, replaced atomically."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.bench}.jsonl"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("\n".join(self.lines()) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        if self._partial is not None:
            self._partial.unlink(missing_ok=True)
            self._partial = None
        return path


def read(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(run record, row records) of one results file, checked for shape."""
    records = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from None
    if not records or records[0].get("record") != "run":
        raise ValueError(f"{path}:1: expected the run record first")
    for n, r in enumerate(records[1:], 2):
        if r.get("record") != "row" or not {"table", "inputs", "figures"} <= set(r):
            raise ValueError(
                f"{path}: record {n}: expected a row with table, inputs, figures; "
                f"found keys {sorted(r)}"
            )
    return records[0], records[1:]
