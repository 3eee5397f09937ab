"""The real index_topk (2048) at 8-12k tokens, in the engine (GPU).

The long-context GLM-5 test model (models.py "glm5-long": RECIPE 9's graded
top-k with index_topk 2048 and a 32k context, F16) on upstream's peer and
the series' fp16 path, each in its own process:

- against transformers in fp32 (TF32 off) on the same weights, both of its
  selections (judging.transformers_alternatives), apart for positions that
  see more than 2048 keys and those that do not: ours within 1.5x the
  peer's error in each part;
- chunked prefill in 1536-token steps (chunks across the 2048 boundary)
  against one step per prompt, on each path: ours moves no further than
  1.5x the peer does;
- a request whose first 10,240 tokens another request left in the prefix
  cache against the same request in an engine without prefix caching:
  the same greedy tokens up to a near-tie, the decode distributions moved
  no further than 1.5x the peer's.

The same model as Q4_K_M (Q4_K gate/up experts; down experts Q4_K in one
MoE layer, Q6_K in the other), both prompts at once: the series' fp16 path
with its routed experts on vLLM's Marlin MoE (0028) in 1536-token chunks
and in steps of 16,384 tokens (on SM90 the float path from the repacked
weights), and on ggml's kernels, each within 1.5x the peer's error against
transformers in fp32 on the file's dequantized weights, and the Marlin
runs within 1.5x the error of the run on ggml's kernels (the same values).

The bars are the suite's (judging.py): relative to the peer, a floor of
0.002 against a peer at exactly 0.
"""

from __future__ import annotations

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cases import model_paths
from judging import scale_free, transformers_alternatives
from models import FIRST_TEXT_TOKEN, VOCAB
from oracles import transformers_model
from run_engine import launch
from setups import PEER, TRITON_FP16

pytestmark = pytest.mark.gpu

MODEL = "glm5-long"
LENGTHS = (8192, 12288)
GENERATED = 8
CHUNK = 1536  # prefill steps that cross the 2048 boundary
SHARED = 10240  # the prefix the second request finds in the cache
RATIO, FLOOR = 1.5, 0.002
PATHS = {"peer": PEER, "fp16": TRITON_FP16}
# The Q4_K_M file's runs: the Marlin MoE (the series' default) and ggml's
# kernels. Both prompts at once: a first step of 16,384 tokens (the float
# path's batches on SM90), then one of 4,096.
QUANT = "q4_k_m"
QUANT_RUNS = {"q4-peer": (PEER, {}, {}),
              "q4-fp16": (TRITON_FP16, {}, {}),
              "q4-fp16-chunked": (TRITON_FP16, {}, {"max_num_batched_tokens": CHUNK}),
              "q4-ggml": (TRITON_FP16, {"VLLM_GGUF_KERNELS": "ggml"}, {})}


def long_prompts() -> list[list[int]]:
    rng = random.Random(2048)
    return [[rng.randint(FIRST_TEXT_TOKEN, VOCAB - 1) for _ in range(n)] for n in LENGTHS]


def prefix_prompts() -> tuple[list[int], list[int]]:
    """A (the longest prompt) and B (A's first SHARED tokens, then others)."""
    a = long_prompts()[-1]
    rng = random.Random(4096)
    return a, a[:SHARED] + [rng.randint(FIRST_TEXT_TOKEN, VOCAB - 1) for _ in range(2048)]


def _case(hf, gguf, setup, prompts, **options) -> dict:
    llm = {"max_model_len": 32768, "kv_cache_memory_bytes": 2 << 30,
           "gpu_memory_utilization": 0.05, "max_num_seqs": 4, "max_logprobs": VOCAB,
           "max_num_batched_tokens": 16384, **setup.llm_args, **options.pop("llm", {})}
    return {"gguf": str(gguf), "hf": str(hf), "prompts": prompts, "max_tokens": GENERATED,
            "llm": llm, "full_logprobs": VOCAB, "sequential": True, **options}


@pytest.fixture(scope="module")
def runs(manifest, tmp_path_factory) -> dict:
    if MODEL not in manifest["models"]:
        pytest.fail(f"{MODEL} is not among the built models: run `make e2e-models`")
    hf, gguf = model_paths(manifest, MODEL, "f16")
    work = tmp_path_factory.mktemp("long")
    a, b = prefix_prompts()
    jobs = {}  # name: (setup, extra environment, case)
    for name, setup in PATHS.items():
        jobs[f"{name}-whole"] = setup, {}, _case(hf, gguf, setup, long_prompts())
        jobs[f"{name}-chunked"] = setup, {}, _case(hf, gguf, setup, long_prompts(),
                                                   llm={"max_num_batched_tokens": CHUNK})
        # vLLM reads no cached prefix for a request that asks prompt log-probabilities
        jobs[f"{name}-cached"] = setup, {}, _case(hf, gguf, setup, [a, b],
                                                  prompt_logprobs=False,
                                                  llm={"enable_prefix_caching": True})
        jobs[f"{name}-fresh"] = setup, {}, _case(hf, gguf, setup, [b], prompt_logprobs=False,
                                                 llm={"enable_prefix_caching": False})
    _, quant = model_paths(manifest, MODEL, QUANT)
    for name, (setup, env, llm) in QUANT_RUNS.items():
        jobs[name] = setup, env, _case(hf, quant, setup, long_prompts(), sequential=False,
                                       llm=llm)

    def one(item):
        name, (setup, env, case) = item
        return name, launch(case, work, name, dict(os.environ, **setup.env, **env))

    with ThreadPoolExecutor(int(os.environ.get("E2E_PARALLEL", "6"))) as pool:
        out = dict(pool.map(one, jobs.items()))
    errors = [r["error"] for r in out.values() if "error" in r]
    if errors:
        pytest.fail("\n\n".join(errors))
    out["hf"], out["gguf"], out["quant"] = hf, gguf, quant
    return out


@pytest.fixture(scope="module")
def oracle(runs) -> list[torch.Tensor]:
    """transformers fp32 (both selections) over each prompt, [2, positions,
    vocab] per prompt."""
    return _fp32(runs["hf"], runs["gguf"])


@pytest.fixture(scope="module")
def quant_oracle(runs) -> list[torch.Tensor]:
    """The same on the Q4_K_M file's dequantized weights."""
    return _fp32(runs["hf"], runs["quant"])


def _fp32(hf, gguf) -> list[torch.Tensor]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = transformers_model(hf, gguf, "cuda")
    out = [transformers_alternatives(model, p) for p in long_prompts()]
    del model
    torch.cuda.empty_cache()
    return out


def _show(what: str, **figures) -> None:
    # the figures of a passing run too (pytest -rA shows them)
    print(f"{MODEL} {what}: {json.dumps(figures)}")


def _bar(peer: float) -> float:
    return RATIO * max(peer, FLOOR)


def _vs_oracle(run: dict, oracle: list[torch.Tensor], topk: int) -> dict:
    """Scale-free error per prompt position (the closer selection), apart for
    positions that see more than topk keys."""
    active, rest = [], []
    for p, r, lp in zip(long_prompts(), run["prompts"], oracle):
        err = torch.stack([scale_free(r["full"]["prompt"], alt[: len(p) - 1])
                           for alt in lp]).min(0).values
        keys = torch.arange(1, len(p))  # row i predicts token i + 1 from keys 0..i
        active.append(err[keys > topk])
        rest.append(err[keys <= topk])
    return {"active": torch.cat(active).mean().item(), "all_keys": torch.cat(rest).mean().item()}


def _record(record, check: str, gguf_type: str, run: str, failures: list[str],
            **figures) -> None:
    """The run record's row (E2E_RECORD), then the test's verdict."""
    record({"long_context": check, "model": MODEL, "gguf_type": gguf_type, "run": run,
            **figures, "passed": not failures})
    assert not failures, "; ".join(failures)


def test_long_prompts_match_fp32_as_well_as_the_peer(runs, oracle, record):
    topk = json.loads((runs["hf"] / "config.json").read_text())["index_topk"]
    assert topk == 2048, f"{MODEL}: index_topk {topk}, not the real models' 2048"
    ours = _vs_oracle(runs["fp16-whole"], oracle, topk)
    peer = _vs_oracle(runs["peer-whole"], oracle, topk)
    _show("vs fp32", ours=ours, peer=peer)
    failures = [f"{part}: scale-free {ours[part]:.4f} > {RATIO} x the peer's {peer[part]:.4f}"
                for part in ("active", "all_keys") if not ours[part] <= _bar(peer[part])]
    if not peer["active"] < 0.1:
        failures.append(f"peer {peer}: model or oracle broken")
    _record(record, "vs fp32", "f16", "fp16-whole", failures, ours=ours, peer=peer)


def _drift(a: dict, b: dict, key: str) -> torch.Tensor:
    """Per position: the scale-free distance of two runs' vectors (key:
    "prompt" or "generated", over the steps both runs share)."""
    out = []
    for x, y in zip(a["prompts"], b["prompts"]):
        n = len(x["full"][key])
        if key == "generated":
            n = next((i + 1 for i, (s, t) in enumerate(zip(x["generated"], y["generated"]))
                      if s != t), len(x["generated"]))
        out.append(scale_free(x["full"][key][:n], y["full"][key][:n]))
    return torch.cat(out)


@pytest.mark.parametrize("against, key", [("chunked", "prompt"), ("chunked", "generated")])
def test_chunked_prefill_across_the_boundary_changes_nothing(runs, against, key, record):
    ours = _drift(runs["fp16-whole"], runs[f"fp16-{against}"], key).mean().item()
    peer = _drift(runs["peer-whole"], runs[f"peer-{against}"], key).mean().item()
    _show(f"{against} {key}", ours=ours, peer=peer)
    failures = [] if ours <= _bar(peer) else [
        f"{key}: chunked moves ours {ours:.4f}, the peer {peer:.4f}"]
    _record(record, f"{against} prefill, {key} tokens", "f16", f"fp16-{against}", failures,
            ours=ours, peer=peer)


def test_a_cached_prefix_changes_nothing(runs, record):
    for name in PATHS:
        cached, fresh = runs[f"{name}-cached"]["prompts"][1], runs[f"{name}-fresh"]["prompts"][0]
        assert len(cached["generated"]) == len(fresh["generated"]) == GENERATED, name
    ours = _drift({"prompts": [runs["fp16-cached"]["prompts"][1]]}, runs["fp16-fresh"],
                  "generated")
    peer = _drift({"prompts": [runs["peer-cached"]["prompts"][1]]}, runs["peer-fresh"],
                  "generated")
    ours, peer = ours.mean().item(), peer.mean().item()
    _show("cached prefix", ours=ours, peer=peer)
    failures = [] if ours <= _bar(peer) else [
        f"prefix cache moves ours {ours:.4f}, the peer {peer:.4f}"]
    mine, theirs = runs["fp16-cached"]["prompts"][1], runs["fp16-fresh"]["prompts"][0]
    parted = next((i for i, (s, t) in enumerate(zip(mine["generated"], theirs["generated"]))
                   if s != t), None)
    if parted is not None:  # only at a near-tie of the fresh run's own step
        row = theirs["full"]["generated"][parted]
        top2 = row.topk(2).values
        margin = (top2[0] - top2[1]).item()
        if not margin < 0.05:
            failures.append(f"cached prefix: greedy parts at step {parted} where the fresh "
                            f"run's margin is {margin:.3f} nats")
    _record(record, "cached prefix, generated tokens", "f16", "fp16-cached", failures,
            ours=ours, peer=peer, greedy_parted_at=parted)


@pytest.mark.parametrize("run, marlin", [("q4-fp16", True), ("q4-fp16-chunked", True),
                                         ("q4-ggml", False)])
def test_q4_k_m_experts_match_fp32_as_well_as_the_peer(runs, quant_oracle, run, marlin,
                                                      record):
    assert runs[run]["marlin_moe"] == marlin, (
        f"{run}: the routed experts {'did not run' if marlin else 'ran'} on the Marlin MoE")
    ours = _vs_oracle(runs[run], quant_oracle, 2048)
    peer = _vs_oracle(runs["q4-peer"], quant_oracle, 2048)
    # the series on ggml's kernels: the same values, ~7x nearer fp32 than the peer
    ggml = _vs_oracle(runs["q4-ggml"], quant_oracle, 2048)
    _show(f"{QUANT} {run} vs fp32", ours=ours, peer=peer, ggml=ggml)
    failures = []
    for part in ("active", "all_keys"):
        if not ours[part] <= _bar(peer[part]):
            failures.append(f"{run} {part}: scale-free {ours[part]:.4f} > {RATIO} x the "
                            f"peer's {peer[part]:.4f}")
        if not ours[part] <= _bar(ggml[part]):
            failures.append(f"{run} {part}: scale-free {ours[part]:.4f} > {RATIO} x ggml's "
                            f"kernels' {ggml[part]:.4f}")
    if not peer["active"] < 0.1:
        failures.append(f"peer {peer}: model or oracle broken")
    _record(record, "vs fp32", QUANT, run, failures, ours=ours, peer=peer, ggml=ggml)
