"""compare_runs.py: two runs' engines compared bit for bit (CPU)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from compare_runs import compare

from cases import HERE


def _vectors(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt": torch.randn(rows, 64, generator=g).log_softmax(-1)} for rows in (7, 12)]


def test_identical_runs_have_no_differing_row():
    a = _vectors()
    r = compare(a, [{"prompt": v["prompt"].clone()} for v in a])
    assert r == {"max": 0.0, "mean": 0.0, "first": [None, None]}


@pytest.mark.parametrize("row", [0, 5, 11])
def test_the_first_differing_row_and_its_size(row):
    a = _vectors()
    b = [{"prompt": v["prompt"].clone()} for v in a]
    b[1]["prompt"][row, 3] += 0.25
    b[1]["prompt"][11, 7] += 2**-20  # one ulp-sized change counts too
    r = compare(a, b)
    assert r["first"] == [None, row]
    assert r["max"] == pytest.approx(0.25, rel=1e-6)
    assert 0 < r["mean"] < 0.25


def test_nan_where_both_have_it_is_equal_and_where_one_has_it_is_not():
    a = _vectors()
    b = [{"prompt": v["prompt"].clone()} for v in a]
    a[0]["prompt"][2, :] = float("nan")
    b[0]["prompt"][2, :] = float("nan")
    assert compare(a, b)["first"] == [None, None]
    b[0]["prompt"][4, 0] = float("nan")
    r = compare(a, b)
    assert r["first"] == [4, None] and math.isinf(r["max"])


def test_runs_of_other_prompts_are_refused():
    a = _vectors()
    with pytest.raises(ValueError, match="prompts"):
        compare(a, a[:1])
    with pytest.raises(ValueError, match="prompt rows"):
        compare(a, [{"prompt": v["prompt"][:-1]} for v in a])


def test_the_command_compares_each_engine_of_the_first_run(tmp_path):
    runs = [tmp_path / n / "engine0" for n in ("a", "b")]
    for d in runs:
        d.mkdir(parents=True)
    a = _vectors()
    b = [{"prompt": v["prompt"].clone()} for v in a]
    b[0]["prompt"][3, 1] -= 0.5
    torch.save(a, runs[0] / "glm5-q8_0-triton-fp16.out.logprobs.pt")
    torch.save(b, runs[1] / "glm5-q8_0-triton-fp16.out.logprobs.pt")
    torch.save(a, runs[0] / "glm5-f16-triton-fp16.out.logprobs.pt")  # not in b: left out
    out = subprocess.run([sys.executable, str(HERE / "compare_runs.py"), str(tmp_path / "a"),
                          str(tmp_path / "b")], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("glm5-q8_0-triton-fp16 vs ")
    assert "max 0.5000" in lines[0] and lines[0].endswith("per prompt: 3, none")
    empty = tmp_path / "c"
    empty.mkdir()
    bad = subprocess.run([sys.executable, str(HERE / "compare_runs.py"), str(empty),
                          str(tmp_path / "b")], capture_output=True, text=True)
    assert bad.returncode == 2 and "no .out.logprobs.pt files" in bad.stderr
