"""The installed wheel is the patched tree, labelled with the series."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from patchseries.pin import load_pin
from patchseries.tree import read_series, series_digest, series_files

VLLM_SRC = Path(__file__).resolve().parents[1] / "vllm-src"


@pytest.fixture(scope="module")
def installed() -> Path:
    dist = importlib.metadata.distribution("vllm")
    return Path(dist.locate_file("vllm"))


def test_import_reports_the_series_version(repo):
    pin = load_pin()
    expected = f"{pin.version}+dsa.sm120.{series_digest(read_series(repo / 'patches'))[:8]}"
    # A fresh interpreter, as a user would import it.
    out = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[-1] == expected
    assert importlib.metadata.version("vllm") == expected


def test_changed_files_are_installed_byte_identical(installed):
    assert (VLLM_SRC / ".git").exists(), "vllm-src/ is missing: run `make test`"
    changed = series_files("AM", "vllm/", VLLM_SRC)
    for name in changed:
        ours = (VLLM_SRC / name).read_bytes()
        theirs = installed.parent / name
        assert theirs.exists(), f"{name} is not in the installed package"
        assert theirs.read_bytes() == ours, f"{name} differs from vllm-src/"


def test_compiled_ops_come_from_the_pinned_wheel(installed):
    # The precompiled build ships upstream's ops (with sm_120 code); make sure
    # they are in the package users install.
    for so in ("_C.abi3.so", "_C_stable_libtorch.abi3.so", "_moe_C.abi3.so", "_flashmla_C.abi3.so"):
        assert (installed / so).stat().st_size > 1_000_000, so


def test_every_module_the_series_adds_imports_first():
    """Each module the series adds, and the GGUF op module whose imports
    they join, imported first in a fresh interpreter, as a script or a
    benchmark imports it: no import cycle (0027's top-level import of
    gguf_dispatch made `import ...quantization.gguf` fail so)."""
    from concurrent.futures import ThreadPoolExecutor

    assert (VLLM_SRC / ".git").exists(), "vllm-src/ is missing: run `make test`"
    added = series_files("A", "vllm/*.py", VLLM_SRC)
    modules = [p.removesuffix(".py").replace("/", ".") for p in added
               if not p.endswith("__init__.py")]
    modules.append("vllm.model_executor.layers.quantization.gguf")
    assert len(modules) > 5

    def first_import(module):
        run = subprocess.run([sys.executable, "-c", f"import {module}"],
                             capture_output=True, text=True)
        return module, run.returncode, run.stderr.strip().splitlines()[-1:]

    with ThreadPoolExecutor(2) as pool:
        failed = [r for r in pool.map(first_import, modules) if r[1] != 0]
    assert not failed, failed
