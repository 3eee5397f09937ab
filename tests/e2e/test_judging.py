"""The engine tests' judging on made-up numbers (CPU): what compare() reports
for the prompt tokens, the greedy tokens and the decode steps."""

from __future__ import annotations

import pytest
import torch
from cases import prompts
from test_engine import MAX_TOKENS, compare

VOCAB = 512


def _case(decode_error: float, flip_at: int | None = None):
    """An engine result, the oracle over each prompt and over prompt +
    generated (log-probabilities); the engine
    result that is off by 0.05 nats on every prompt token and by
    decode_error on every generated one; flip_at: a greedy token that is
    the oracle's second choice, 0.3 nats below its first."""
    gen = torch.Generator().manual_seed(0)
    result, over_prompt, oracle = {"prompts": []}, [], []
    for prompt in prompts():
        n = len(prompt) + MAX_TOKENS
        lp = torch.log_softmax(torch.randn(n, VOCAB, generator=gen) * 3, dim=-1)
        generated = lp[len(prompt) - 1 : n - 1].argmax(-1).tolist()
        if flip_at is not None:
            row = lp[len(prompt) - 1 + flip_at]
            first, second = row.topk(2).indices.tolist()
            row[second] = row[first] - 0.3
            generated[flip_at] = second
        target = torch.tensor(prompt[1:])
        ref = lp[: len(prompt) - 1].gather(1, target[:, None])[:, 0]
        chosen = lp[len(prompt) - 1 : n - 1].gather(1, torch.tensor(generated)[:, None])[:, 0]
        result["prompts"].append({
            "prompt_logprob": (ref + 0.05).tolist(),
            "prompt_top1": lp[: len(prompt) - 1].argmax(-1).tolist(),
            "generated": generated,
            "generated_logprob": (chosen - decode_error).tolist(),
        })
        over_prompt.append(lp[: len(prompt)])
        oracle.append(lp)
    return result, over_prompt, oracle


def test_decode_error_is_measured_apart_from_the_prompt():
    result, over_prompt, oracle = _case(decode_error=0.4)
    out = compare(result, over_prompt, oracle, near_tie=0.1)
    assert abs(out["mean"] - 0.05) < 1e-4 and out["top1"] == 1.0
    assert abs(out["decode"]["mean"] - 0.4) < 1e-4 and abs(out["decode"]["p90"] - 0.4) < 1e-4
    assert out["greedy"] == out["greedy_strict"] == 1.0


def test_greedy_miss_counts_only_within_the_near_tie():
    result, over_prompt, oracle = _case(decode_error=0.0, flip_at=5)
    tight = compare(result, over_prompt, oracle, near_tie=0.1)
    loose = compare(result, over_prompt, oracle, near_tie=0.35)
    share = 1 - 2 / (2 * MAX_TOKENS)  # one miss in each prompt
    assert abs(tight["greedy"] - share) < 1e-4 and tight["greedy_miss_gaps"] == [0.3, 0.3]
    assert loose["greedy"] == 1.0 and abs(loose["greedy_strict"] - share) < 1e-4


def test_non_finite_engine_logprobs_fail():
    result, over_prompt, oracle = _case(decode_error=0.0)
    result["prompts"][0]["generated_logprob"][3] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        compare(result, over_prompt, oracle)
