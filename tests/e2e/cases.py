"""The end-to-end engine cases: which engine setups run on which model files
(GROUPS, as CASES), and what every case shares: where the models are, the
prompts and how many tokens each generates."""

from __future__ import annotations

import os
from pathlib import Path

import models
from setups import (
    AUTO_SM120,
    PEER,
    PEER_MTP,
    TRITON_BF16,
    TRITON_FP16,
    TRITON_FP16_EAGER,
    TRITON_FP16_MTP,
    TRITON_FP16_TP2,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

MAX_TOKENS = 24
# the MTP setups' one-step-at-a-time pass (run_engine.step_counts): about 50
# drafts a prompt (384 + 96 tokens fit max_model_len 512)
MTP_STEP_TOKENS = 96

# (model, GGUF type) -> the series' setups run on it; upstream's peer runs on
# every one of them.
GROUPS = {
    ("glm5", "f16"): [TRITON_FP16, TRITON_BF16, AUTO_SM120, TRITON_FP16_MTP, PEER_MTP],
    ("glm5", "bf16"): [TRITON_FP16, TRITON_BF16],
    ("glm5", "q8_0"): [TRITON_FP16, TRITON_BF16],
    ("glm5", "q4_k_m"): [TRITON_FP16, TRITON_BF16, AUTO_SM120, TRITON_FP16_TP2],
    ("glm5", "q5_k_m"): [TRITON_FP16, TRITON_BF16],
    ("glm5", "q6_k"): [TRITON_FP16, TRITON_BF16],
    # GLM-5.2's greedy tokens on triton-fp16 missed fp32's by up to 0.53 nats
    # on 2026-11-30 and 12-01 (docs/e2e.md): bf16 and eager tell the dtype,
    # the kernels and CUDA graphs apart
    ("glm52", "f16"): [TRITON_FP16, TRITON_BF16, AUTO_SM120, TRITON_FP16_EAGER,
                       TRITON_FP16_MTP, PEER_MTP],
    ("glm52", "q4_k_m"): [TRITON_FP16, TRITON_BF16],
    ("dsv32", "f16"): [TRITON_FP16, TRITON_BF16, AUTO_SM120, TRITON_FP16_TP2],
    ("dsv32", "q8_0"): [TRITON_FP16, TRITON_BF16],
    ("dsv32", "q4_k_m"): [TRITON_FP16],
    # The files users download, made by llama.cpp's own tools (models.TOOL_FILES):
    # K and IQ types (the IQ ones with the model's importance matrix), a
    # dynamic mixture (also as users start it), and a split set given by its
    # first shard.
    ("glm5", "q2_k"): [TRITON_FP16, TRITON_BF16],
    ("glm5", "q3_k_m"): [TRITON_FP16, TRITON_BF16],
    ("glm5", "iq4_xs"): [TRITON_FP16, TRITON_BF16],
    ("glm5", "iq3_xxs"): [TRITON_FP16, TRITON_BF16],
    ("glm5", "iq2_xxs"): [TRITON_FP16, TRITON_BF16],
    ("glm5", "iq1_m"): [TRITON_FP16, TRITON_BF16],
    ("glm5", "iq2_xxs-dynamic"): [TRITON_FP16, TRITON_BF16, AUTO_SM120],
    ("glm5", "q4_k_m-split"): [TRITON_FP16, TRITON_BF16],
    ("glm52", "iq2_xxs-dynamic"): [TRITON_FP16, TRITON_BF16],
    ("dsv32", "iq2_xxs-dynamic"): [TRITON_FP16, TRITON_BF16],
    # the same types on GLM-5.2 and DeepSeek-V3.2, the product's path alone
    **{(model, t): [TRITON_FP16] for model in ("glm52", "dsv32")
       for t in ("q2_k", "q3_k_m", "iq4_xs", "iq3_xxs", "iq2_xxs", "iq1_m", "q4_k_m-split")},
}
if os.environ.get("E2E_GROUPS"):  # e.g. "glm5:f16,dsv32:q8_0"
    _wanted = set(filter(None, os.environ["E2E_GROUPS"].split(",")))
    _unknown = sorted(_wanted - {f"{m}:{t}" for m, t in GROUPS})
    if _unknown:  # a group left out without a word would read as one that passed
        raise ValueError(f"E2E_GROUPS: no such group in tests/e2e/cases.py: "
                         f"{', '.join(_unknown)}")
    GROUPS = {k: v for k, v in GROUPS.items() if f"{k[0]}:{k[1]}" in _wanted}
# e.g. "triton-fp16,triton-fp16-mtp": only these setups, and the peer they are
# held to
_SETUPS = set(filter(None, os.environ.get("E2E_SETUPS", "").split(",")))
# (model, GGUF type, setup name), the peer first on each file
CASES = [(m, t, s.name) for (m, t), setups in GROUPS.items() for s in [PEER, *setups]
         if not _SETUPS or s is PEER or s.name in _SETUPS]


def models_dir() -> Path:
    return Path(os.environ.get("E2E_MODELS", REPO / "build" / "e2e"))


def model_paths(manifest: dict, model: str, gguf_type: str) -> tuple[Path, Path]:
    """(Hugging Face dir, GGUF file) of one model and type."""
    entry = manifest["models"][model]
    root = models_dir() / model
    return root / entry["hf"], root / entry["gguf"][gguf_type]


def prompts() -> list[list[int]]:
    """A long prompt (3x index_topk: the indexer's selection matters), a
    short one (top-k covers the whole context) and a middle one. Together
    (672 tokens, one prefill step) they pass gguf_dispatch's
    MOE_DEQUANT_MIN_TOKENS (512): the float paths of every GGUF type run in
    the engine, as in users' prefills, not only ggml's kernels."""
    import random

    rng = random.Random(2026)
    lo, hi = models.FIRST_TEXT_TOKEN, models.VOCAB - 1
    return [[rng.randint(lo, hi) for _ in range(n)] for n in (384, 96, 192)]


def mtp_step_prompts() -> list[list[int]]:
    """The MTP setups' one-step-at-a-time prompts: prompts() and four more of
    64 tokens, about 350 drafts in all (a defect that changes 1 draft in 50
    shows in several)."""
    import random

    rng = random.Random(2027)
    lo, hi = models.FIRST_TEXT_TOKEN, models.VOCAB - 1
    return prompts() + [[rng.randint(lo, hi) for _ in range(64)] for _ in range(4)]


def index_topk(manifest: dict, model: str) -> int:
    """The model's index_topk, from the config the engine reads."""
    import json

    hf, _ = model_paths(manifest, model, next(iter(manifest["models"][model]["gguf"])))
    return json.loads((hf / "config.json").read_text())["index_topk"]
