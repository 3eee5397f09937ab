"""forced_tokens.ForcedTokens, the logits processor that makes every engine
path decode one text (CPU): rows follow vLLM's batch updates (added,
removed, moved, swapped), each forced row keeps only its next token, rows
past their list or without one are left alone."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from forced_tokens import ForcedTokens

VOCAB = 16


def _params(forced: list[int] | None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8,
                          extra_args={"forced_tokens": forced} if forced is not None else None)


def _update(size: int, removed=(), added=(), moved=()) -> BatchUpdate:
    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added),
                       moved=list(moved))


def _argmax(proc: ForcedTokens, rows: int) -> list[int]:
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows))
    free = logits.argmax(-1).tolist()
    out = proc.apply(logits.clone())
    return [int(r.argmax()) if torch.isinf(r).sum() == VOCAB - 1 else -free[i] - 1
            for i, r in enumerate(out)]


def test_forced_rows_take_their_next_token_and_follow_the_batch():
    proc = ForcedTokens(None, torch.device("cpu"), False)
    out_a, out_b, out_c = [], [], []
    proc.update_state(_update(3, added=[(0, _params([5, 6, 7]), [1], out_a),
                                        (1, _params(None), [1], out_b),
                                        (2, _params([9]), [1], out_c)]))
    got = _argmax(proc, 3)
    assert got[0] == 5 and got[1] < 0 and got[2] == 9  # row 1: untouched
    out_a.append(5)
    out_c.append(9)
    got = _argmax(proc, 3)
    assert got[0] == 6 and got[2] < 0  # row 2 is past its list: free
    # row 0 moves to 1 (1 was freed), then 1 and 2 swap
    proc.update_state(_update(2, removed=[1], moved=[(0, 1, MoveDirectionality.UNIDIRECTIONAL),
                                                     (1, 2, MoveDirectionality.SWAP)]))
    assert set(proc.rows) == {1, 2} and proc.rows[2][0] == [5, 6, 7]
    out_a.append(6)
    logits = proc.apply(torch.zeros(3, VOCAB))
    assert int(logits[2].argmax()) == 7 and torch.isinf(logits[2]).sum() == VOCAB - 1
    assert not torch.isinf(logits[0]).any()
    proc.update_state(_update(0, removed=[1, 2]))
    assert proc.rows == {}
    proc.update_state(None)  # no change to the batch


@pytest.mark.parametrize("forced, temperature", [([1, -2], 0.0), ("12", 0.0), ([1, 2], 0.7)])
def test_bad_forced_tokens_are_refused(forced, temperature):
    params = SamplingParams(temperature=temperature, extra_args={"forced_tokens": forced})
    with pytest.raises(ValueError, match="forced_tokens"):
        ForcedTokens.validate_params(params)


def test_requests_without_forced_tokens_pass():
    ForcedTokens.validate_params(SamplingParams(temperature=0.7))
    ForcedTokens.validate_params(_params([0, 3]))
