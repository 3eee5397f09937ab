"""Judge a GPU run's engine outputs again, on any machine:

    python tests/e2e/rejudge.py ENGINE_DIR OUT.jsonl --env RECORD.jsonl

ENGINE_DIR is where test_engine.py's engine runs left their files (pytest's
temporary folder `engine0`: <GGUF stem>-<setup>.out.json and .log). E2E_MODELS
must hold the same models (`make e2e-models` with the same recipe: the
manifests must be equal); a case whose file here differs from the run's (the
record's gguf_sha256; K-quant files built on another CPU do) is not judged.
The oracles run here (transformers fp32, on the CPU
without a GPU; llama.cpp on the CPU) under the suite's own rules
(judging.evaluate). For a GPU run whose device time ran out before its
judging did. --env is that run's E2E_RECORD: the machine's fields (date, card,
driver, versions) come from its first line. A folder without any engine run
is an error; OUT is replaced only once every case is judged.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

from cases import CASES, model_paths, models_dir
from judging import evaluate, file_digest, judge_all
from run_engine import engine_result
from setups import SETUPS

_MACHINE = ("date", "card", "driver", "gpus", "vllm", "torch", "triton")


def engine_runs(engine_dir: Path, manifest: dict, gpus: int) -> dict:
    """What each case's engine left: its result, its error or why it did not run."""
    runs = {}
    for model, gguf_type, path in CASES:
        _, gguf = model_paths(manifest, model, gguf_type)
        case, out, log = (engine_dir / f"{gguf.stem}-{path}{ext}"
                          for ext in (".json", ".out.json", ".log"))
        if out.is_file():
            try:
                runs[(model, gguf_type, path)] = engine_result(out, log.read_text())
            except ValueError as e:  # cut short: that case failed, the others are judged
                runs[(model, gguf_type, path)] = {"error": f"{path}: {e}"}
        elif SETUPS[path].gpus > gpus:
            runs[(model, gguf_type, path)] = {
                "skip": f"{path} needs {SETUPS[path].gpus} GPUs, the run's host had {gpus}"}
        elif not case.is_file():  # written before the engine starts
            runs[(model, gguf_type, path)] = {"skip": f"{path} was not part of the run"}
        else:
            runs[(model, gguf_type, path)] = {
                "error": f"{path}: engine on {gguf.name} left no output (it failed or was "
                         f"stopped; see {log.name if log.is_file() else 'the test log'})"}
    return runs


def differing_files(record: Path, manifest: dict) -> dict:
    """The cases whose GGUF file here is not the one the run's engines read
    (the run record's gguf_sha256), each with why. A record without digests
    (runs before 2026-12-02) is judged as it is, with a warning: quantized
    files rebuilt on another machine may differ."""
    ran = {}
    for line in record.read_text().splitlines():
        row = json.loads(line)
        if "path" in row:
            ran.setdefault((row["model"], row["gguf_type"]), row.get("gguf_sha256"))
    if ran and not any(ran.values()):
        print(f"warning: {record} names no file digests: a quantized file built here may "
              "differ from the run's, and its figures with it", flush=True)
    out = {}
    for model, gguf_type, path in CASES:
        theirs = ran.get((model, gguf_type))
        if not theirs:
            continue
        _, gguf = model_paths(manifest, model, gguf_type)
        if (ours := file_digest(gguf)) != theirs:
            out[(model, gguf_type, path)] = (
                f"not judged: {gguf.name} here (sha256 {ours}) is not the run's ({theirs})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--env", type=Path, required=True, help="the run's E2E_RECORD")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="files judged at once, each in a process (default: half the cores)")
    args = ap.parse_args()

    if not args.engine_dir.is_dir():
        raise SystemExit(f"rejudge.py: {args.engine_dir}: no such folder (pytest's engine0 "
                         "folder of the GPU run)")
    first = json.loads(args.env.read_text().splitlines()[0])
    machine = {k: first[k] for k in _MACHINE if k in first}
    manifest = json.loads((models_dir() / "manifest.json").read_text())
    runs = engine_runs(args.engine_dir, manifest, int(machine.get("gpus", 1)))
    for case, why in differing_files(args.env, manifest).items():
        runs[case] = {"skip": why}
    # Every case "skipped" would read as a judged run.
    if all("skip" in run for run in runs.values()):
        raise SystemExit(f"rejudge.py: {args.engine_dir}: holds no engine run (no "
                         "<GGUF stem>-<path>.json or .out.json of a case); is it pytest's "
                         "engine0 folder of the GPU run?")
    judged = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    judge_all(runs, manifest, args.workers)
    # Written beside the output and moved over it once complete: a rejudge
    # that fails part-way leaves the previous one as it was.
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    try:
        with tmp.open("w") as f:
            for model, gguf_type, path in CASES:
                row, failures = evaluate(runs, manifest, model, gguf_type, path)
                print(f"{model} {gguf_type} {path}: "
                      f"{'skipped' if 'skipped' in row else 'FAIL' if failures else 'pass'}",
                      *failures, sep="\n  ", flush=True)
                f.write(json.dumps({**machine, "judged": f"{judged}, tests/e2e/rejudge.py",
                                    **row}) + "\n")
        os.replace(tmp, args.out)
    finally:
        tmp.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
