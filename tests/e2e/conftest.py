"""Fixtures of the end-to-end engine tests: the models `make e2e-models`
built (E2E_MODELS, default build/e2e), prompts, and the run record."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import threading

import pytest

import run_engine
from cases import models_dir


def pytest_configure(config):
    if threading.current_thread() is threading.main_thread():
        run_engine.stop_on_sigterm()


@pytest.fixture(scope="session")
def manifest() -> dict:
    path = models_dir() / "manifest.json"
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make e2e-models` (on a machine with a "
                    "package index) and copy the folder here, or set E2E_MODELS")
    return json.loads(path.read_text())


def _environment() -> dict:
    import torch

    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True).stdout.strip().splitlines()
        env["card"], env["driver"] = (s.strip() for s in smi[0].split(","))
        env["gpus"] = len(smi)
    except (OSError, subprocess.CalledProcessError):
        pass
    import vllm

    env.update(vllm=vllm.__version__, torch=torch.__version__)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


@pytest.fixture(scope="session")
def record():
    """Appends one JSON line per case to E2E_RECORD (if set)."""
    path = os.environ.get("E2E_RECORD")
    env = _environment()

    def write(case: dict) -> None:
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({**env, **case}) + "\n")

    return write
