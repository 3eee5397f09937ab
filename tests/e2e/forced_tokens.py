"""A vLLM logits processor that makes a request decode given tokens: the
end-to-end tests decode one fixed continuation on every engine path, so
that their decode steps are compared on the same text (each path's own
greedy text parts from the others' at near-ties).

A request asks for it with SamplingParams(extra_args={"forced_tokens":
[...]}) and greedy sampling; at step i every logit but forced_tokens[i]'s
is -inf, so greedy takes it, while the log-probabilities vLLM returns are
the model's own (logprobs_mode "raw_logprobs", vLLM's default, computes
them before any logits processor). Past the list, the request decodes
freely. The engine loads it by name: LLM(logits_processors=
["forced_tokens:ForcedTokens"]) with this folder on sys.path (vLLM refuses
custom logits processors with speculative decoding).
"""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)

KEY = "forced_tokens"


def forced_tokens(params: SamplingParams | None) -> list[int] | None:
    return (params.extra_args or {}).get(KEY) if params is not None else None


class ForcedTokens(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        # batch row -> (the tokens to force, the request's live output tokens)
        self.rows: dict[int, tuple[list[int], list[int]]] = {}

    @classmethod
    def validate_params(cls, params: SamplingParams):
        forced = forced_tokens(params)
        if forced is None:
            return
        if not isinstance(forced, list) or not all(
                isinstance(t, int) and t >= 0 for t in forced):
            raise ValueError(f"{KEY} must be a list of token ids, found {forced!r}")
        if params.temperature != 0.0:
            raise ValueError(f"{KEY} needs greedy sampling (temperature 0)")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        # removed, added, moved: the order BatchUpdate asks for
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _, output in batch_update.added:
            forced = forced_tokens(params)
            if forced:
                self.rows[index] = (forced, output)
            else:
                self.rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if direction == MoveDirectionality.SWAP and row_b is not None:
                self.rows[a] = row_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (forced, output) in self.rows.items():
            step = len(output)
            if step < len(forced):
                token = forced[step]
                logits[index].fill_(float("-inf"))
                logits[index, token] = 0.0
        return logits
