"""The real engine (vllm.LLM: default settings, CUDA graphs on, multiprocess
engine) on GGUF files of GLM-5, GLM-5.2 and DeepSeek-V3.2: every case of
cases.py (an engine setup of setups.py on one file) runs in its own process,
and is judged against transformers in fp32 and llama.cpp on the same weights
under judging.py's rules, held to upstream's peer on the same file.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from cases import (
    CASES,
    HERE,
    MAX_TOKENS,
    MTP_STEP_TOKENS,
    model_paths,
    mtp_step_prompts,
    prompts,
)
from judging import evaluate, judge_all, judge_later
from models import VOCAB
from oracles import fp32_greedy
from run_engine import launch
from setups import SETUPS, EngineSetup

pytestmark = pytest.mark.gpu


def run_engine(tmp_path: Path, hf: Path, gguf: Path, setup: EngineSetup,
               forced: list[list[int]] | None = None) -> dict:
    case = {
        "gguf": str(gguf), "hf": str(hf), "prompts": prompts(), "max_tokens": MAX_TOKENS,
        # Several engines (and other test files) share the GPU in one test
        # session: size the KV cache instead of profiling a share of the GPU's
        # memory, and ask for 5 % of it free at start (vLLM checks that share
        # even when the KV cache is sized).
        # max_num_seqs: the tests send 3 prompts; fewer CUDA graph sizes to
        # capture, CUDA graphs still on.
        "llm": {"max_model_len": 512, "kv_cache_memory_bytes": 1 << 30,
                "gpu_memory_utilization": 0.05, "max_num_seqs": 4,
                "max_logprobs": VOCAB, **setup.llm_args},
        # every position's whole distribution, for the scale-free error
        "full_logprobs": VOCAB,
    }
    if forced and not setup.speculative:  # vLLM: no logits processors with drafts
        case["forced"] = forced
    if setup.speculative:  # prompts one step at a time (the drafts' check)
        case.update(step_prompts=mtp_step_prompts(), step_tokens=MTP_STEP_TOKENS)
    env = dict(os.environ, **setup.env)
    if "E2E_REPORT_SM" in setup.env:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(HERE / "report_sm"), env.get("PYTHONPATH")) if p)
    if "forced" in case:  # the engine's processes load forced_tokens.py by name
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
    # rejudge.py finds a case's files by these names
    return launch(case, tmp_path, f"{gguf.stem}-{setup.name}", env)


@pytest.fixture(scope="session")
def engine_runs(manifest, tmp_path_factory) -> dict:
    """Every case's engine run, E2E_PARALLEL (default 6) at a time: tiny
    models leave the GPU mostly idle, and each engine is its own process."""
    tmp = tmp_path_factory.mktemp("engine")

    gpus = torch.cuda.device_count()
    # Per model (its HF folder), the text every path on its files decodes
    # after its own greedy run (forced_tokens.py): the fp32 checkpoint's greedy
    # continuation of each prompt, on this GPU (TF32 off: torch's default).
    # E2E_FORCED_DECODE=0 leaves it out.
    forced: dict[Path, list[list[int]]] = {}
    if os.environ.get("E2E_FORCED_DECODE", "1") != "0":
        for model, gguf_type, _ in CASES:
            hf, _ = model_paths(manifest, model, gguf_type)
            if hf not in forced:
                forced[hf] = fp32_greedy(hf, prompts(), MAX_TOKENS, "cuda")

    def one(case):
        model, gguf_type, path = case
        setup = SETUPS[path]
        if setup.gpus > gpus:
            return case, {"skip": f"{path} needs {setup.gpus} GPUs, this host has {gpus}"}
        hf, gguf = model_paths(manifest, model, gguf_type)
        return case, run_engine(tmp, hf, gguf, setup, forced.get(hf))

    workers = int(os.environ.get("E2E_PARALLEL", "6"))
    with ThreadPoolExecutor(workers) as pool:
        runs = dict(pool.map(one, CASES))
    # the oracles of every file at once, E2E_PARALLEL processes (one at a
    # time, they took longer than the engines)
    if not judge_later():
        judge_all(runs, manifest, workers)
    return runs


@pytest.mark.parametrize("model, gguf_type, path", CASES,
                         ids=[f"{m}-{t}-{p}" for m, t, p in CASES])
def test_engine_matches_oracles(engine_runs, manifest, record, model, gguf_type, path):
    row, failures = evaluate(engine_runs, manifest, model, gguf_type, path,
                             oracles=not judge_later())
    record(row)
    if "skipped" in row:
        pytest.skip(row["skipped"])
    assert not failures, f"{model} {gguf_type} {path}:\n" + "\n".join(failures)
    if "unjudged" in row:
        pytest.skip("E2E_JUDGE=later: the engine ran and chose as expected; judge its "
                    "output (pytest's engine0 folder) with tests/e2e/rejudge.py")
