"""`make wheelhouse WHEELHOUSE_SKIP=...` (patchseries/wheelhouse.py): pip's
resolution for the target split into the pins to download and those the
target Python must already have."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from patchseries import SeriesError, wheelhouse

REPO = Path(__file__).resolve().parents[1]


def report(*pins: str) -> dict:
    """A `pip install --report` of these name==version pins, as pip writes it."""
    return {"version": "1", "install": [
        {"download_info": {"url": f"https://example.invalid/{p}.whl"},
         "metadata": dict(zip(("name", "version"), p.split("==")))} for p in pins]}


RESOLVED = report("vllm==0.23.0+dsa.sm120.abcdef12", "torch==2.11.0", "Triton==3.6.0",
                  "nvidia_cublas==13.1.0.3", "nvidia-nccl-cu13==2.28.9", "PyYAML==6.0.4",
                  "numpy==2.3.5", "transformers==5.17.0")


def test_skipped_pins_are_split_off_with_their_versions():
    keep, left = wheelhouse.split_report(
        RESOLVED, wheelhouse.patterns("torch, triton nvidia-*"), "vllm")
    assert left == ["nvidia-cublas==13.1.0.3", "nvidia-nccl-cu13==2.28.9", "torch==2.11.0",
                    "triton==3.6.0"]
    # the series' own wheel is copied in, not downloaded
    assert keep == ["numpy==2.3.5", "pyyaml==6.0.4", "transformers==5.17.0"]


def test_names_match_as_pip_compares_them():
    keep, left = wheelhouse.split_report(RESOLVED, wheelhouse.patterns("NVIDIA_CUBLAS pyyaml"),
                                         "vllm")
    assert left == ["nvidia-cublas==13.1.0.3", "pyyaml==6.0.4"]
    assert "nvidia-nccl-cu13==2.28.9" in keep and len(keep) + len(left) == 7


def test_a_pattern_that_matches_nothing_is_an_error():
    with pytest.raises(SeriesError, match=r"WHEELHOUSE_SKIP: tritton matches no requirement"):
        wheelhouse.split_report(RESOLVED, wheelhouse.patterns("torch tritton"), "vllm")


def test_series_cli_writes_both_lists(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps(RESOLVED))
    keep, left = tmp_path / "download.txt", tmp_path / "SKIPPED.txt"
    run = subprocess.run([sys.executable, "scripts/series.py", "wheelhouse-split",
                          str(tmp_path / "report.json"), "torch triton", str(keep), str(left)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "5 to download, 2 left out"
    assert left.read_text() == "torch==2.11.0\ntriton==3.6.0\n"
    assert keep.read_text().splitlines() == ["numpy==2.3.5", "nvidia-cublas==13.1.0.3",
                                             "nvidia-nccl-cu13==2.28.9", "pyyaml==6.0.4",
                                             "transformers==5.17.0"]
    bad = subprocess.run([sys.executable, "scripts/series.py", "wheelhouse-split",
                          str(tmp_path / "report.json"), "torc", str(keep), str(left)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.startswith("error: WHEELHOUSE_SKIP: torc")
    assert "Traceback" not in bad.stderr
