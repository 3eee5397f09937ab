"""Shared fixtures. Tests import vLLM from the installed wheel (see
scripts/run-tests.sh) and the series tools from scripts/."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter. Triton reads this when
# a kernel is defined, so it is set before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `make test-gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture
def git_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A git identity for commits tests make, whatever the machine has."""
    for key, value in {
        "GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@localhost.invalid",
        "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@localhost.invalid",
    }.items():
        monkeypatch.setenv(key, value)
