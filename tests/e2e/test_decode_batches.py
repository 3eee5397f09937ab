"""Decode batches of many sequences, in CUDA graphs (GPU).

test_engine.py sends three prompts: its decode batches hold three
sequences, below gguf_dispatch's DENSE_DEQUANT_MIN_TOKENS, so the linear
layers decode with ggml's vector kernel there. Users' servers decode dozens
of sequences a step, in batches vLLM captured in CUDA graphs at start,
where the linears of the series dequantize and run torch.matmul (a weight's
float path captured only after it ran outside a graph).

On GLM-5, GLM-5.2 and DeepSeek-V3.2 Q4_K_M, batch() prompts of one length
decode together (on GLM-5 and GLM-5.2 also small_batch(): 8, where only a
TP rank's small linears take the float path, 0032, where the linears of
Q4_K and Q8_0 run vLLM's dense Marlin GEMM by default, 0036, and without
it, VLLM_GGUF_MARLIN_LINEARS=0, judged too): the greedy run, then
the greedy text of transformers fp32 on the file's weights forced
(forced_tokens.py), so every path's decode steps are on one text, batch()
sequences a step, a size vLLM captured.
Every file's engines start at once. Those steps against transformers in
fp32 on the file's own weights (both selections, each router near-tie
taken as the engine took it: judging.routed_alternatives): ours within
the suite's decode bars of upstream's peer on the same file
(judging.decode_bar: 1.5x its mean + 0.01, 1.5x its p90 + 0.02).
"""

from __future__ import annotations

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cases import model_paths
from judging import _decode, decode_bar, file_digest, routed_alternatives
from models import FIRST_TEXT_TOKEN, VOCAB
from oracles import greedy, transformers_model
from run_engine import launch
from setups import PEER, TRITON_FP16, TRITON_FP16_NO_MARLIN_LINEARS

pytestmark = pytest.mark.gpu

FILES = [("glm5", "q4_k_m"), ("glm52", "q4_k_m"), ("dsv32", "q4_k_m")]
SMALL_FILES = FILES[:2]  # GLM-5.2's shared layers too (0034)
PROMPT = 160  # past the test models' index_topk (128): the selection is active
GENERATED = 12
PATHS = {"peer": PEER, "fp16": TRITON_FP16}
SMALL_PATHS = {**PATHS, "fp16-no-marlin-linears": TRITON_FP16_NO_MARLIN_LINEARS}


def batch() -> int:
    """Sequences a step: past the installed wheel's threshold for the
    linears' float path, a multiple of 8 (vLLM captures those sizes)."""
    from vllm.model_executor.layers.quantization import gguf_dispatch

    return max(40, -(-(gguf_dispatch.DENSE_DEQUANT_MIN_TOKENS + 1) // 8) * 8)


def small_batch() -> int:
    """Sequences a step where only a TP rank's small linears (every linear
    of the test models) take the float path on SM90: gguf_dispatch's
    threshold for them, below the one for the others (elsewhere the batch
    runs ggml's kernels, judged the same)."""
    from vllm.model_executor.layers.quantization import gguf_dispatch

    return gguf_dispatch.DENSE_DEQUANT_SMALL_MIN_TOKENS


def batch_prompts(n: int) -> list[list[int]]:
    rng = random.Random(4040)
    return [[rng.randint(FIRST_TEXT_TOKEN, VOCAB - 1) for _ in range(PROMPT)]
            for _ in range(n)]


def _case(hf, gguf, setup, prompts, forced) -> dict:
    n = len(prompts)
    llm = {"max_model_len": 512, "kv_cache_memory_bytes": 1 << 30,
           "gpu_memory_utilization": 0.05, "max_num_seqs": n,
           "max_num_batched_tokens": n * PROMPT, "max_logprobs": VOCAB, **setup.llm_args}
    return {"gguf": str(gguf), "hf": str(hf), "prompts": prompts, "max_tokens": GENERATED,
            "llm": llm, "full_logprobs": VOCAB, "forced": forced}


@pytest.fixture(scope="module")
def runs(manifest, tmp_path_factory) -> dict:
    """Every file's engines at once (E2E_PARALLEL at a time): (model, gguf
    type, path) -> engine result; "prompts"; "texts": each file's forced
    text."""
    return _run_batches(manifest, tmp_path_factory, FILES, batch(), PATHS)


@pytest.fixture(scope="module")
def small_runs(manifest, tmp_path_factory) -> dict:
    """runs() for GLM-5 and GLM-5.2 at small_batch() sequences a step."""
    return _run_batches(manifest, tmp_path_factory, SMALL_FILES, small_batch(), SMALL_PATHS)


def _run_batches(manifest, tmp_path_factory, files, n: int, paths: dict) -> dict:
    missing = sorted({m for m, _ in files} - set(manifest["models"]))
    if missing:
        pytest.fail(f"{missing} not among the built models: run `make e2e-models`")
    prompts = batch_prompts(n)
    work = tmp_path_factory.mktemp("batches")
    texts, jobs = {}, {}
    for model, gguf_type in files:
        hf, gguf = model_paths(manifest, model, gguf_type)
        tf = transformers_model(hf, gguf, "cuda")
        texts[(model, gguf_type)] = greedy(tf, prompts, GENERATED)
        del tf
        for name, setup in paths.items():
            jobs[(model, gguf_type, name)] = (
                _case(hf, gguf, setup, prompts, texts[(model, gguf_type)]),
                f"{gguf.stem}-{setup.name}", dict(os.environ, **setup.env))
    torch.cuda.empty_cache()

    def one(item):
        key, (case, stem, env) = item
        return key, launch(case, work, stem, env)

    with ThreadPoolExecutor(int(os.environ.get("E2E_PARALLEL", "6"))) as pool:
        out = dict(pool.map(one, jobs.items()))
    return {**out, "prompts": prompts, "texts": texts, "paths": paths}


def _ran(runs: dict, model: str, gguf_type: str) -> tuple[dict, list[str]]:
    """The file's setups whose engine ran, and the errors of those whose did not."""
    res = {name: runs[(model, gguf_type, name)] for name in runs["paths"]}
    return ({n: r for n, r in res.items() if "error" not in r},
            [r["error"] for r in res.values() if "error" in r])


def _file_runs(runs: dict, model: str, gguf_type: str) -> dict:
    res, errors = _ran(runs, model, gguf_type)
    if errors:
        pytest.fail("\n\n".join(errors))
    return res


def _forced_figures(tf, prompts, res: dict, topk: int) -> dict:
    """The engine's decode steps on the forced text against transformers fp32
    on the same text (judging._decode's figures)."""
    oracle = [routed_alternatives(tf, p + r["forced"],
                                  torch.cat([r["full"]["prompt"], r["full"]["forced"]]),
                                  topk)[0]
              for p, r in zip(prompts, res["prompts"])]
    fig = _decode(res, oracle, None, False, text="forced", prompt_list=prompts)
    return {"steps": fig["n"], "mean": fig["mean"], "p90": fig["p90"], "max": fig["max"]}


PARAMS = pytest.mark.parametrize("model, gguf_type", FILES,
                                 ids=[f"{m}-{t}" for m, t in FILES])


def _captured_on_the_forced_text(runs, model, gguf_type) -> None:
    for name, res in _file_runs(runs, model, gguf_type).items():
        assert res["cuda_graphs"], f"{name}: no CUDA graphs captured"
        assert [r["forced"] for r in res["prompts"]] == runs["texts"][(model, gguf_type)], name


@PARAMS
def test_the_batch_is_past_the_linears_threshold_and_captured(runs, model, gguf_type):
    from vllm.model_executor.layers.quantization import gguf_dispatch

    assert len(runs["prompts"]) >= gguf_dispatch.DENSE_DEQUANT_MIN_TOKENS
    _captured_on_the_forced_text(runs, model, gguf_type)


@pytest.mark.parametrize("model, gguf_type", SMALL_FILES,
                         ids=[f"{m}-{t}" for m, t in SMALL_FILES])
def test_the_small_batch_takes_only_the_small_linears_float_path(small_runs, model,
                                                                 gguf_type):
    from vllm.model_executor.layers.quantization import gguf_dispatch

    n = len(small_runs["prompts"])
    assert n >= gguf_dispatch.DENSE_DEQUANT_SMALL_MIN_TOKENS
    assert n < gguf_dispatch.DENSE_DEQUANT_MIN_TOKENS
    _captured_on_the_forced_text(small_runs, model, gguf_type)


@PARAMS
def test_decode_batches_match_fp32_as_well_as_the_peer(runs, manifest, record, model,
                                                       gguf_type):
    _judge(runs, manifest, record, model, gguf_type)


@pytest.mark.parametrize("model, gguf_type", SMALL_FILES,
                         ids=[f"{m}-{t}" for m, t in SMALL_FILES])
def test_small_decode_batches_match_fp32_as_well_as_the_peer(small_runs, manifest, record,
                                                             model, gguf_type):
    _judge(small_runs, manifest, record, model, gguf_type)


def _judge(runs, manifest, record, model, gguf_type) -> None:
    # the setups that ran are judged (and recorded) though another's engine failed
    res, errors = _ran(runs, model, gguf_type)
    if "peer" not in res:
        pytest.fail("\n\n".join(errors))
    hf, gguf = model_paths(manifest, model, gguf_type)
    topk = json.loads((hf / "config.json").read_text())["index_topk"]
    tf = transformers_model(hf, gguf, "cuda")
    figures = {name: _forced_figures(tf, runs["prompts"], res[name], topk) for name in res}
    del tf
    torch.cuda.empty_cache()
    n, peer = len(runs["prompts"]), figures.pop("peer")
    failed = []
    for name, ours in figures.items():
        failures = decode_bar(ours, peer)
        setup = runs["paths"][name].name
        # the file's digest: a rejudging on another machine must read the same
        # bytes (K-quant files built on another CPU differ)
        record({"model": model, "gguf_type": gguf_type, "decode_batch": n, "setup": setup,
                "ours": ours, "peer": peer, "passed": not failures,
                "gguf_sha256": file_digest(gguf)})
        # the figures of a passing run too (pytest -rA shows them)
        print(f"{model} {gguf_type} decode batch of {n}, {setup}: "
              f"{json.dumps({'ours': ours, 'peer': peer})}")
        failed += [f"{setup}: {f}" for f in failures]
    if errors:
        pytest.fail("\n\n".join([*errors, *failed]))
    assert not failed, f"decode steps of {n} sequences: " + "; ".join(failed)
