"""Request validation in the engine's input processor raises vLLM's
validation error, which `vllm serve` answers with a 400 through its own
handler: a plain ValueError reached the server's catch-all handler, which
answers 400 too but logs a traceback for every bad request (seen in the soak:
`make soak` fails on a traceback in the server log). Negative token ids are
refused before they reach the embedding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.input_processor import InputProcessor

VOCAB, MAX_LEN = 512, 64


def _processor() -> InputProcessor:
    # Only what _validate_model_input reads: building the real one needs a model.
    p = object.__new__(InputProcessor)
    p.model_config = SimpleNamespace(max_model_len=MAX_LEN, runner_type="generate",
                                     get_vocab_size=lambda: VOCAB)
    p.renderer = SimpleNamespace(tokenizer=SimpleNamespace(max_token_id=VOCAB - 1))
    p.skip_prompt_length_check = False
    p.supports_mm_inputs = False
    p.mm_encoder_cache_size = 0
    return p


@pytest.mark.parametrize("ids, message", [
    ([1, VOCAB, 2], f"Token id {VOCAB} is out of vocabulary"),
    ([1, 10**9], "Token id 1000000000 is out of vocabulary"),
    ([3, -1, 2], "Token id -1 is negative"),
    ([], "prompt cannot be empty"),
    (list(range(MAX_LEN + 1)), f"longer than the maximum model length of {MAX_LEN}"),
    (list(range(MAX_LEN)), "plus the number of requested output tokens"),
])
def test_bad_prompts_raise_the_validation_error(ids, message):
    with pytest.raises(VLLMValidationError, match=message):
        _processor()._validate_model_input(
            {"type": "token", "prompt_token_ids": ids}, prompt_type="decoder")


@pytest.mark.parametrize("ids", [[0], [VOCAB - 1, 0, 5], list(range(MAX_LEN - 1))])
def test_good_prompts_pass(ids):
    _processor()._validate_model_input({"type": "token", "prompt_token_ids": ids},
                                       prompt_type="decoder")

