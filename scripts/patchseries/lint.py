"""vLLM's own ruff rules on the Python files the series adds or changes.

The repository's `ruff check .` leaves vllm-src/ out: its files follow
vLLM's configuration (vllm-src/pyproject.toml: line length 88, its rule
set, ruff format), which is what upstream's pre-commit holds a pull
request to. Here those rules run in vllm-src/ on every .py file that
upstream..HEAD adds or modifies; ruff's format check covers whole files,
so a changed upstream file must stay formatted as a whole.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from . import WORK_TREE
from .tree import series_files


def series_python_files(tree: Path = WORK_TREE) -> list[str]:
    """The .py files the series adds or modifies (deleted ones are not linted)."""
    return series_files("AM", "*.py", tree)


def lint(python: str, tree: Path = WORK_TREE) -> int:
    """ruff check and ruff format --check, vLLM's configuration, on the
    series' files; the exit status of the first that fails, else 0."""
    files = series_python_files(tree)
    if not files:
        return 0
    status = 0
    for args in (["check"], ["format", "--check"]):
        cmd = [python, "-m", "ruff", *args, *files]
        print(f"$ (cd {tree.name}) ruff {' '.join(args)} <{len(files)} files of the series>",
              flush=True)
        r = subprocess.run(cmd, cwd=tree)
        status = status or r.returncode
    return status
