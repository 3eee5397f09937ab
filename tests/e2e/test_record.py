"""The committed end-to-end record is generated: re-rendering its data gives
the committed table byte for byte."""

from __future__ import annotations

import json

import pytest
from cases import HERE
from record import render

RESULTS = sorted((HERE / "results").glob("*/engine.jsonl"))


@pytest.mark.parametrize("data", RESULTS, ids=[p.parent.name for p in RESULTS])
def test_committed_table_is_rendered_from_its_data(data):
    rows = [json.loads(line) for line in data.read_text().splitlines() if line]
    assert rows, f"{data} is empty"
    assert render(rows) == data.with_suffix(".md").read_text()


def test_rejudge_reads_what_each_engine_left(tmp_path):
    """rejudge.py tells a finished engine from a failed or stopped one, from a
    case the run did not include and from a TP 2 case on a one-GPU host."""
    from rejudge import engine_runs
    from test_engine import CASES

    manifest: dict = {"models": {}}
    for model, gguf_type, _ in CASES:
        entry = manifest["models"].setdefault(model, {"hf": "hf", "gguf": {}})
        entry["gguf"][gguf_type] = f"{model}-{gguf_type}.gguf"
    out = {"start_s": 1.0, "dtype": "float16", "prompts": []}
    (tmp_path / "glm5-f16-flashmla-bf16.json").write_text("{}")
    (tmp_path / "glm5-f16-flashmla-bf16.out.json").write_text(json.dumps(out))
    (tmp_path / "glm5-f16-flashmla-bf16.log").write_text(
        "Using FLASHMLA_SPARSE attention backend\nGraph capturing finished in 3 secs\n")
    (tmp_path / "glm5-f16-triton-fp16.json").write_text("{}")
    (tmp_path / "glm5-f16-triton-fp16.log").write_text("Traceback ...\n")
    runs = engine_runs(tmp_path, manifest, gpus=1)
    done = runs[("glm5", "f16", "flashmla-bf16")]
    assert (done["backend"], done["indexer"], done["cuda_graphs"]) == (
        "FLASHMLA_SPARSE", "deepgemm", True)
    assert "left no output" in runs[("glm5", "f16", "triton-fp16")]["error"]
    assert runs[("glm5", "q4_k_m", "triton-fp16-tp2")]["skip"].endswith("the run's host had 1")
    assert runs[("glm5", "f16", "auto-sm120")] == {"skip": "auto-sm120 was not part of the run"}
