"""What the end-to-end tests share: where the models are, the prompts."""

from __future__ import annotations

import os
from pathlib import Path

import models

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def models_dir() -> Path:
    return Path(os.environ.get("E2E_MODELS", REPO / "build" / "e2e"))


def model_paths(manifest: dict, model: str, gguf_type: str) -> tuple[Path, Path]:
    """(Hugging Face dir, GGUF file) of one model and type."""
    entry = manifest["models"][model]
    root = models_dir() / model
    return root / entry["hf"], root / entry["gguf"][gguf_type]


def prompts() -> list[list[int]]:
    """A long prompt (3x index_topk: the indexer's selection matters) and a
    short one (top-k covers the whole context)."""
    import random

    rng = random.Random(2026)
    lo, hi = models.FIRST_TEXT_TOKEN, models.VOCAB - 1
    return [[rng.randint(lo, hi) for _ in range(384)], [rng.randint(lo, hi) for _ in range(96)]]


def index_topk(manifest: dict, model: str) -> int:
    """The model's index_topk, from the config the engine reads."""
    import json

    hf, _ = model_paths(manifest, model, next(iter(manifest["models"][model]["gguf"])))
    return json.loads((hf / "config.json").read_text())["index_topk"]
