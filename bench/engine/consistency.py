# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Decode against prefill in one running `vllm serve`: an engine-level
check of the tokens at the benchmark checkpoints' width, where no fp32
oracle fits beside the engine (tests/e2e holds the tiny models to
transformers and llama.cpp).

``concurrency`` prompts of random token ids go in at once, greedy, EOS
ignored, ``output_len`` tokens each: after their prefill the steps are
decode batches of that many sequences (CUDA graphs; the decode paths of
the GGUF kernels). Then each prompt with its continuation goes in again
as a prompt (echo, prompt logprobs: prefill chunks, eager, the prefill
paths). For every continuation token after the first (the first comes
from the prefill in both), the decode step's logprob of it against the
prefill's, and whether the prefill's top-1 token is the one decoded. The
two runs share the file, the server and the tokens; they differ in the
kernels, so a decode kernel that computes something else shows as
logprobs far apart and top-1 tokens that disagree.
"""

from __future__ import annotations

import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from .workloads import SERVED_NAME, Workload

TIMEOUT_S = 600


def prompts(w: Workload, vocab: int, seed: int) -> list[list[int]]:
    """``w.concurrency`` prompts of ``w.input_len`` random token ids, clear
    of the lowest ids (special tokens sit there in the real vocabularies)."""
    rng = random.Random(seed)
    low = min(1000, vocab // 2)
    return [[rng.randrange(low, vocab) for _ in range(w.input_len)]
            for _ in range(w.concurrency)]


def _token_id(token: str) -> int:
    # return_tokens_as_token_ids: "token_id:<id>"
    return int(token.rsplit(":", 1)[1])


def decoded(response: dict) -> tuple[list[int], list[float]]:
    """A generation's token ids and the logprob of each when it was decoded."""
    lp = response["choices"][0]["logprobs"]
    return [_token_id(t) for t in lp["tokens"]], [float(v) for v in lp["token_logprobs"]]


def prefilled(response: dict, start: int, count: int) -> tuple[list[float], list[int]]:
    """From an echoed prompt's logprobs, positions start .. start+count-1:
    the logprob of the prompt's token there and the top-1 token id."""
    lp = response["choices"][0]["logprobs"]
    logprobs, top1 = [], []
    for pos in range(start, start + count):
        logprobs.append(float(lp["token_logprobs"][pos]))
        top = lp["top_logprobs"][pos]
        top1.append(_token_id(max(top, key=top.get)))
    return logprobs, top1


def compare(gens: list[tuple[list[int], list[float]]],
            prefills: list[tuple[list[float], list[int]]]) -> dict:
    """Figures over every continuation token after the first; prefills[i]
    holds the prefill's figures at continuation i's positions."""
    diffs, agree = [], 0
    for (ids, dec), (pre, top1) in zip(gens, prefills, strict=True):
        if len(pre) != len(ids):
            raise ValueError(f"{len(ids)} tokens decoded, {len(pre)} prefilled")
        for k in range(1, len(ids)):
            diffs.append(abs(dec[k] - pre[k]))
            agree += int(top1[k] == ids[k])
    if not diffs:
        raise ValueError("no continuation token to compare: output_len must be 2 or more")
    diffs.sort()

    def q(f: float) -> float:
        return diffs[min(len(diffs) - 1, int(f * len(diffs)))]

    return {"compared": len(diffs), "dlogprob_p50": q(0.5), "dlogprob_p90": q(0.9),
            "dlogprob_p99": q(0.99), "dlogprob_max": diffs[-1],
            "dlogprob_mean": sum(diffs) / len(diffs), "top1_agree": agree / len(diffs)}


def _post(base_url: str, body: dict) -> dict:
    req = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
        return json.load(r)


def check(base_url: str, w: Workload, vocab: int, seed: int) -> dict:
    """Both runs against the server at ``base_url``; the figures."""
    ps = prompts(w, vocab, seed)
    common = {"model": SERVED_NAME, "temperature": 0, "logprobs": 1,
              "return_tokens_as_token_ids": True}
    with ThreadPoolExecutor(len(ps)) as pool:
        gens = [decoded(r) for r in pool.map(lambda p: _post(base_url, {
            **common, "prompt": p, "max_tokens": w.output_len, "ignore_eos": True}), ps)]
        again = [p + ids for p, (ids, _) in zip(ps, gens, strict=True)]
        echoed = list(pool.map(lambda p: _post(base_url, {
            **common, "prompt": p, "max_tokens": 1, "echo": True}), again))
    pre = [prefilled(r, w.input_len, len(ids)) for r, (ids, _) in zip(echoed, gens, strict=True)]
    return compare(gens, pre)
