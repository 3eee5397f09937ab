"""The committed end-to-end record is generated: re-rendering its data gives
the committed table byte for byte."""

from __future__ import annotations

import json

import pytest

from cases import CASES, HERE
from record import engine_rows, render

RESULTS = sorted((HERE / "results").glob("*/engine.jsonl"))


@pytest.mark.parametrize("data", RESULTS, ids=[p.parent.name for p in RESULTS])
def test_committed_table_is_rendered_from_its_data(data):
    rows = [json.loads(line) for line in data.read_text().splitlines() if line]
    assert rows, f"{data} is empty"
    assert render(rows) == data.with_suffix(".md").read_text()


def _engine_rows() -> list[dict]:
    """A committed record's rows of test_engine.py alone."""
    rows = (json.loads(line) for line in RESULTS[0].read_text().splitlines() if line)
    return engine_rows(rows)


def test_serve_rows_get_their_own_table():
    """test_serve.py's rows (E2E_RECORD) render apart from the engine rows,
    a failing one as such, and leave the engine table as it was."""
    engine = _engine_rows()
    serve = [{"model": "glm5", "gguf_type": "q4_k_m", "serve": "/v1/completions",
              "prompt_tokens": 384, "greedy": 1.0, "greedy_strict": 0.9375,
              "greedy_miss_gaps": [0.042], "near_tie": 0.15, "passed": True},
             {"model": "glm5", "gguf_type": "q4_k_m", "serve": "/v1/chat/completions",
              "prompt_tokens": 99, "greedy": 0.75, "greedy_strict": 0.75,
              "greedy_miss_gaps": [0.3, 0.5, 0.6, 0.9], "near_tie": 0.15, "passed": False}]
    text = render(engine[:3] + serve + engine[3:])
    assert text.startswith(render(engine).rstrip("\n"))
    tail = text.split("## vllm serve", 1)[1]
    assert "| /v1/completions | 384 | 1.000 (0.938) | 0.15 | 0.042 | yes |" in tail
    assert ("| /v1/chat/completions | 99 | 0.750 (0.750) | 0.15 | "
            "0.300, 0.500, 0.600, 0.900 | NO |") in tail


def test_decode_batch_rows_get_their_own_table():
    """test_decode_batches.py's rows render apart, after the engine rows,
    and leave the engine table as it was."""
    engine = _engine_rows()
    figures = {"steps": 480, "mean": 0.0034, "p90": 0.0099, "max": 0.0544}
    row = {"model": "glm5", "gguf_type": "q4_k_m", "decode_batch": 40, "ours": figures,
           "peer": {**figures, "mean": 0.0411}, "passed": False}
    text = render(engine[:2] + [row] + engine[2:])
    assert text.startswith(render(engine).rstrip("\n"))
    tail = text.split("## Decode batches", 1)[1]
    # rows written before the setup was recorded are triton-fp16's
    assert ("| glm5 | q4_k_m | 40 | triton-fp16 | 480 | 0.0034 / 0.0099 / 0.0544 | "
            "0.0411 / 0.0099 / 0.0544 | NO |") in tail
    marlin = render([{**row, "decode_batch": 8, "setup": "triton-fp16-no-marlin-linears"}])
    assert "| glm5 | q4_k_m | 8 | triton-fp16-no-marlin-linears | 480 |" in marlin
    assert render([row]).count("## Decode batches") == 1
    # a row judged after the run says so in its own line
    later = render([row, {**row, "model": "glm52", "judged": "on CPU"}])
    assert "| 0.0411 / 0.0099 / 0.0544 | NO |\n| glm52 |" in later
    assert "| NO (judged after the run: on CPU) |" in later


def test_long_context_rows_get_their_own_table():
    """test_long_context.py's rows render apart, after the engine rows, a
    failing one as such, and leave the engine table as it was."""
    engine = _engine_rows()
    long = [{"long_context": "vs fp32", "model": "glm5-long", "gguf_type": "f16",
             "run": "fp16-whole", "ours": {"active": 0.00447, "all_keys": 0.00187},
             "peer": {"active": 0.02742, "all_keys": 0.01862}, "passed": True},
            {"long_context": "chunked prefill, generated tokens", "model": "glm5-long",
             "gguf_type": "f16", "run": "fp16-chunked", "ours": 0.0313, "peer": 0.0180,
             "passed": False},
            {"long_context": "vs fp32", "model": "glm5-long", "gguf_type": "q4_k_m",
             "run": "q4-ggml", "ours": {"active": 0.00633, "all_keys": 0.00306},
             "peer": {"active": 0.04713, "all_keys": 0.04463},
             "ggml": {"active": 0.00633, "all_keys": 0.00306}, "passed": True}]
    text = render(engine[:1] + long[:1] + engine[1:] + long[1:])
    assert text.startswith(render(engine).rstrip("\n"))
    tail = text.split("## Long context", 1)[1]
    assert ("| glm5-long | f16 | vs fp32 | fp16-whole | 0.0045 / 0.0019 | 0.0274 / 0.0186 |  "
            "| yes |") in tail
    assert ("| glm5-long | f16 | chunked prefill, generated tokens | fp16-chunked | 0.0313 | "
            "0.0180 |  | NO |") in tail
    assert "| q4-ggml | 0.0063 / 0.0031 | 0.0471 / 0.0446 | 0.0063 / 0.0031 | yes |" in tail
    assert render(long).count("## Long context") == 1


def test_rows_of_another_run_name_it():
    """serve and decode-batch rows from another run than the engine rows' (a
    later session with the same wheel) say which run they are; rows of the
    engine rows' own run say nothing more."""
    engine = {"model": "glm5", "gguf_type": "f16", "path": "triton-fp16", "tp": 1,
              "backend": "TRITON_MLA_SPARSE", "dtype": "float16", "indexer": "triton",
              "start_s": 30.5, "unjudged": "later", "date": "2026-12-06T10:44:51Z",
              "vllm": "0.23.0+dsa.sm120.a7e4804c"}
    serve = {"model": "glm5", "gguf_type": "q4_k_m", "serve": "/v1/completions",
             "prompt_tokens": 384, "greedy": 1.0, "greedy_strict": 1.0,
             "greedy_miss_gaps": [], "near_tie": 0.15, "passed": True}
    same = render([engine, {**serve, "date": engine["date"], "vllm": engine["vllm"]}])
    assert "Run of" not in same
    later = render([engine, {**serve, "date": "2026-12-06T14:36:23Z", "vllm": engine["vllm"]}])
    tail = later.split("## vllm serve", 1)[1]
    assert "\nRun of 2026-12-06T14:36:23Z with vLLM 0.23.0+dsa.sm120.a7e4804c.\n" in tail
    assert later.count("Run of") == 1


def test_rows_judged_later_render_as_not_judged():
    """An E2E_JUDGE=later run's record: each case's engine, no figures."""
    row = {"model": "glm5", "gguf_type": "f16", "path": "triton-fp16", "tp": 1,
           "backend": "TRITON_MLA_SPARSE", "dtype": "float16", "indexer": "triton",
           "start_s": 30.5, "unjudged": "E2E_JUDGE=later: judge with tests/e2e/rejudge.py"}
    text = render([row])
    assert ("| glm5 | f16 | triton-fp16 | 1 | TRITON_MLA_SPARSE, float16, triton | "
            "E2E_JUDGE=later: judge with tests/e2e/rejudge.py | | | | 30.5 | not judged |") in text
    # as many cells as the header, beside judged rows split by selection too
    engine = [r for r in (json.loads(line) for line in RESULTS[0].read_text().splitlines()
                          if line) if "path" in r]
    mtp = {**row, "path": "triton-fp16-mtp", "acceptance": 0.775,
           "greedy_equal_to_no_spec": True}
    assert "| | acceptance 0.775, greedy = no-spec: yes | | 30.5 | not judged |" in render([mtp])
    drafts = {"drafts": 150, "near_ties": 4, "disagree": 3, "rate": 0.0205}
    assert "greedy = no-spec: yes; drafts unlike fp32's: 3 of 146 |" in render(
        [{**mtp, "mtp_drafts": drafts}])
    for judged in ([], engine[:2]):
        table = [x for x in render([*judged, row, mtp]).splitlines() if x.startswith("|")]
        assert len(table) == 4 + len(judged) and len({x.count("|") for x in table}) == 1


def fake_manifest() -> dict:
    manifest: dict = {"models": {}}
    for model, gguf_type, _ in CASES:
        entry = manifest["models"].setdefault(model, {"hf": "hf", "gguf": {}, "types": {}})
        entry["gguf"][gguf_type] = f"{model}-{gguf_type}.gguf"
        entry["types"][gguf_type] = ["F32"]
    return manifest


def one_engine_run(engine_dir, out: str | None = None) -> None:
    """What test_engine.py leaves of one finished engine (glm5 f16, the peer path)."""
    out = out or json.dumps({"start_s": 1.0, "dtype": "float16", "prompts": []})
    (engine_dir / "glm5-f16-flashmla-bf16.json").write_text("{}")
    (engine_dir / "glm5-f16-flashmla-bf16.out.json").write_text(out)
    (engine_dir / "glm5-f16-flashmla-bf16.log").write_text(
        "Using FLASHMLA_SPARSE attention backend\nGraph capturing finished in 3 secs\n")


def test_rejudge_reads_what_each_engine_left(tmp_path):
    """rejudge.py tells a finished engine from a failed or stopped one, from a
    case the run did not include and from a TP 2 case on a one-GPU host."""
    from rejudge import engine_runs

    manifest = fake_manifest()
    one_engine_run(tmp_path)
    (tmp_path / "glm5-f16-triton-fp16.json").write_text("{}")
    (tmp_path / "glm5-f16-triton-fp16.log").write_text("Traceback ...\n")
    runs = engine_runs(tmp_path, manifest, gpus=1)
    done = runs[("glm5", "f16", "flashmla-bf16")]
    assert (done["backend"], done["indexer"], done["cuda_graphs"]) == (
        "FLASHMLA_SPARSE", "deepgemm", True)
    assert "left no output" in runs[("glm5", "f16", "triton-fp16")]["error"]
    assert runs[("glm5", "q4_k_m", "triton-fp16-tp2")]["skip"].endswith("the run's host had 1")
    assert runs[("glm5", "f16", "auto-sm120")] == {"skip": "auto-sm120 was not part of the run"}


def test_rejudge_names_a_truncated_engine_output(tmp_path):
    """An engine stopped while writing its output: that case is an error
    naming the file, not a JSON error from the middle of the rejudge."""
    from rejudge import engine_runs

    one_engine_run(tmp_path, out='{"start_s": 1.0, "dty')
    runs = engine_runs(tmp_path, fake_manifest(), gpus=1)
    error = runs[("glm5", "f16", "flashmla-bf16")]["error"]
    assert "glm5-f16-flashmla-bf16.out.json" in error and "not complete JSON" in error


@pytest.fixture
def rejudge_run(tmp_path, monkeypatch):
    """rejudge.py's command line on fake models and a fake judge: returns
    run(engine_dir), the output file and the lines the judge saw."""
    import rejudge

    models = tmp_path / "models"
    models.mkdir()
    (models / "manifest.json").write_text(json.dumps(fake_manifest()))
    monkeypatch.setenv("E2E_MODELS", str(models))
    env = tmp_path / "record.jsonl"
    env.write_text(json.dumps({"card": "NVIDIA H200", "gpus": 1}) + "\n")
    out = tmp_path / "rejudged.jsonl"
    judged = []

    def evaluate(runs, manifest, model, gguf_type, path):
        judged.append((model, gguf_type, path))
        if len(judged) == 3:
            raise RuntimeError("the oracle ran out of memory")
        row = {"model": model, "gguf_type": gguf_type, "path": path}
        res = runs[(model, gguf_type, path)]
        return ({**row, "skipped": res["skip"]} if "skip" in res else row), []

    monkeypatch.setattr(rejudge, "evaluate", evaluate)

    def run(engine_dir):
        monkeypatch.setattr("sys.argv", ["rejudge.py", str(engine_dir), str(out), "--env",
                                         str(env)])
        rejudge.main()

    return run, out, judged


@pytest.mark.parametrize("folder", ["missing", "empty"])
def test_rejudge_of_a_folder_without_engine_runs_fails(rejudge_run, tmp_path, folder):
    """Every case "skipped" and exit status 0 would read as a judged run."""
    run, out, judged = rejudge_run
    engine_dir = tmp_path / "engine0"
    if folder == "empty":
        engine_dir.mkdir()
    with pytest.raises(SystemExit, match=rf"{engine_dir}: (no such folder|holds no engine run)"):
        run(engine_dir)
    assert not out.exists() and judged == []


def test_rejudge_that_fails_part_way_leaves_its_output_file_as_it_was(rejudge_run, tmp_path):
    run, out, judged = rejudge_run
    one_engine_run(tmp_path)
    out.write_text("the previous rejudge\n")
    with pytest.raises(RuntimeError, match="out of memory"):
        run(tmp_path)
    assert len(judged) == 3
    assert out.read_text() == "the previous rejudge\n"
    assert sorted(p.name for p in tmp_path.glob("rejudged*")) == ["rejudged.jsonl"]


def test_rejudge_judges_only_the_files_the_run_read(tmp_path, monkeypatch, capsys):
    """A GGUF built here that is not the run's (by the record's sha256) is not
    judged: its oracle would not be the engine's weights."""
    from judging import file_digest
    from rejudge import differing_files

    models = tmp_path / "models"
    (models / "glm5").mkdir(parents=True)
    monkeypatch.setenv("E2E_MODELS", str(models))
    manifest = fake_manifest()
    for gguf_type in ("f16", "q4_k_m"):
        (models / "glm5" / f"glm5-{gguf_type}.gguf").write_bytes(gguf_type.encode())
    same = file_digest(models / "glm5" / "glm5-f16.gguf")
    record = tmp_path / "record.jsonl"
    rows = [{"model": "glm5", "gguf_type": "f16", "path": "triton-fp16", "gguf_sha256": same},
            {"model": "glm5", "gguf_type": "q4_k_m", "path": "flashmla-bf16",
             "gguf_sha256": "0123456789abcdef"}]
    record.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = differing_files(record, manifest)
    assert {c for c in out} == {c for c in CASES if c[:2] == ("glm5", "q4_k_m")}
    assert all("glm5-q4_k_m.gguf here" in why and "0123456789abcdef" in why
               for why in out.values())
    # a record from before the digests: judged, with a warning
    record.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "gguf_sha256"})
                              + "\n" for r in rows))
    assert differing_files(record, manifest) == {}
    assert "names no file digests" in capsys.readouterr().out
