# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A vocabulary both servers tokenize alike, at the real size.

`vllm bench serve`'s random dataset sends text: it samples token ids,
decodes them with the client's tokenizer and re-encodes to the target
length. For vLLM (HF tokenizer) and llama-server (the GGUF's vocabulary) to
see the same prompt as the same number of tokens, and for the prompts to
use many distinct tokens (MoE routing spreads as on real text), the
vocabulary is a byte-level BPE (GPT-2's byte alphabet and regex) whose
tokens past the 256 bytes are words: a space and 1-4 ASCII letters, each
built by exactly one merge from its prefix ("Ġab" + "c" -> "Ġabc"). A word
token decodes to " abc" and encodes back to the same single token under
both implementations, so decode/encode is exact for word tokens. The last
id is ``<|endoftext|>`` (EOS, special). No BOS is added.
"""

from __future__ import annotations

import itertools
import json
import string
from functools import lru_cache
from pathlib import Path

LETTERS = string.ascii_lowercase + string.ascii_uppercase
EOS = "<|endoftext|>"


@lru_cache(maxsize=1)
def byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode, in byte order (ids 0-255)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


@lru_cache(maxsize=4)
def build(size: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens in id order, merges in rank order) for a vocabulary of
    ``size`` ids: 256 bytes, words of 1, 2, 3, 4 letters, then EOS."""
    if size < 256 + len(LETTERS) + 1:
        raise ValueError(f"vocabulary of {size}: at least {256 + len(LETTERS) + 1} ids")
    tokens = list(byte_alphabet())
    merges: list[str] = []
    want = size - 1
    space = byte_alphabet()[ord(" ")]  # "Ġ"
    for length in itertools.count(1):
        if length > 5:
            raise ValueError(f"vocabulary of {size} ids is too large for 5-letter words")
        for word in itertools.product(LETTERS, repeat=length):
            if len(tokens) == want:
                break
            prefix = space + "".join(word[:-1])
            tokens.append(prefix + word[-1])
            merges.append(f"{prefix} {word[-1]}")
        if len(tokens) == want:
            break
    tokens.append(EOS)
    return tuple(tokens), tuple(merges)


def tokenizer_json(size: int) -> dict:
    """The HF tokenizers file (tokenizer.json) of the vocabulary."""
    tokens, merges = build(size)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": size - 1, "content": EOS, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": list(merges)},
    }


def write_tokenizer(path: Path, size: int, max_len: int) -> None:
    """tokenizer.json + tokenizer_config.json in ``path`` (an HF model dir)."""
    path = Path(path)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json(size), ensure_ascii=False))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }, indent=1))


def gguf_vocab(size: int) -> dict:
    """What the converter writes as the GGUF's vocabulary (set_vocab):
    tokens, merges, token types (1 normal, 3 control), EOS id."""
    tokens, merges = build(size)
    return {
        "model": "gpt2",
        "pre": "gpt-2",
        "tokens": list(tokens),
        "merges": list(merges),
        "types": [1] * (size - 1) + [3],
        "eos": size - 1,
    }
