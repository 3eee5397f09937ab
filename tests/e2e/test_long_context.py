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
    jobs = {}
    for name, setup in PATHS.items():
        jobs[f"{name}-whole"] = _case(hf, gguf, setup, long_prompts())
        jobs[f"{name}-chunked"] = _case(hf, gguf, setup, long_prompts(),
                                        llm={"max_num_batched_tokens": CHUNK})
        # vLLM reads no cached prefix for a request that asks prompt log-probabilities
        jobs[f"{name}-cached"] = _case(hf, gguf, setup, [a, b], prompt_logprobs=False,
                                       llm={"enable_prefix_caching": True})
        jobs[f"{name}-fresh"] = _case(hf, gguf, setup, [b], prompt_logprobs=False,
                                      llm={"enable_prefix_caching": False})

    def one(item):
        name, case = item
        setup = PATHS[name.split("-")[0]]
        return name, launch(case, work, name, dict(os.environ, **setup.env))

    with ThreadPoolExecutor(int(os.environ.get("E2E_PARALLEL", "6"))) as pool:
        out = dict(pool.map(one, jobs.items()))
    errors = [r["error"] for r in out.values() if "error" in r]
    if errors:
        pytest.fail("\n\n".join(errors))
    out["hf"], out["gguf"] = hf, gguf
    return out


@pytest.fixture(scope="module")
def oracle(runs) -> list[torch.Tensor]:
    """transformers fp32 (both selections) over each prompt, [2, positions,
    vocab] per prompt."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = transformers_model(runs["hf"], runs["gguf"], "cuda")
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


def test_long_prompts_match_fp32_as_well_as_the_peer(runs, oracle):
    topk = json.loads((runs["hf"] / "config.json").read_text())["index_topk"]
    assert topk == 2048, f"{MODEL}: index_topk {topk}, not the real models' 2048"
    ours = _vs_oracle(runs["fp16-whole"], oracle, topk)
    peer = _vs_oracle(runs["peer-whole"], oracle, topk)
    _show("vs fp32", ours=ours, peer=peer)
    for part in ("active", "all_keys"):
        assert ours[part] <= _bar(peer[part]), (
            f"{part}: scale-free {ours[part]:.4f} > {RATIO} x the peer's {peer[part]:.4f}")
    assert peer["active"] < 0.1, f"peer {peer}: model or oracle broken"


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
def test_chunked_prefill_across_the_boundary_changes_nothing(runs, against, key):
    ours = _drift(runs["fp16-whole"], runs[f"fp16-{against}"], key)
    peer = _drift(runs["peer-whole"], runs[f"peer-{against}"], key)
    _show(f"{against} {key}", ours=ours.mean().item(), peer=peer.mean().item())
    assert ours.mean() <= _bar(peer.mean()), (
        f"{key}: chunked moves ours {ours.mean():.4f}, the peer {peer.mean():.4f}")


def test_a_cached_prefix_changes_nothing(runs):
    for name in PATHS:
        cached, fresh = runs[f"{name}-cached"]["prompts"][1], runs[f"{name}-fresh"]["prompts"][0]
        assert len(cached["generated"]) == len(fresh["generated"]) == GENERATED, name
    ours = _drift({"prompts": [runs["fp16-cached"]["prompts"][1]]}, runs["fp16-fresh"],
                  "generated")
    peer = _drift({"prompts": [runs["peer-cached"]["prompts"][1]]}, runs["peer-fresh"],
                  "generated")
    _show("cached prefix", ours=ours.mean().item(), peer=peer.mean().item())
    assert ours.mean() <= _bar(peer.mean()), (
        f"prefix cache moves ours {ours.mean():.4f}, the peer {peer.mean():.4f}")
    mine, theirs = runs["fp16-cached"]["prompts"][1], runs["fp16-fresh"]["prompts"][0]
    parted = next((i for i, (s, t) in enumerate(zip(mine["generated"], theirs["generated"]))
                   if s != t), None)
    if parted is not None:  # only at a near-tie of the fresh run's own step
        row = theirs["full"]["generated"][parted]
        top2 = row.topk(2).values
        assert top2[0] - top2[1] < 0.05, (
            f"cached prefix: greedy parts at step {parted} where the fresh run's margin is "
            f"{(top2[0] - top2[1]).item():.3f} nats")
