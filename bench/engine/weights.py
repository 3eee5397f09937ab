# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seeded random tensors of a benchmark checkpoint, and the check that its
random router spreads tokens over the experts as a trained one does.

A tensor is generated in row blocks, each from its own generator seeded by
(spec seed, tensor name, block): any rows can be regenerated alone (the
routing check reads a few embedding rows of a 154,880-row table), and the
blocks run on a thread pool (torch's RNG releases the GIL). Values are made
in float32 and stored in bfloat16, the published checkpoints' dtype.

Imported by the converter's process (convert.py): torch and the standard
library only — no vllm, no gguf.
"""

from __future__ import annotations

import hashlib
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

BLOCK_ELEMENTS = 1 << 22  # 4 Mi values per generator


def _seed(spec_seed: int, name: str, block: int) -> int:
    h = hashlib.blake2b(f"{spec_seed}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def _rows_per_block(shape: tuple[int, ...]) -> int:
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMENTS // row)


# Most values are windows of one long random sequence per spec (a window at
# a seeded offset per block): a copy instead of a normal draw, ~10x faster,
# and as good for a speed benchmark (kernels do not read values; windows at
# different offsets are as uncorrelated as independent draws). The routers
# are drawn for real: the routing check and the load depend on them.
BASE_LEN = (1 << 24) + 43
_BASE: dict = {}


def _base(spec_seed: int) -> torch.Tensor:
    if spec_seed not in _BASE:
        g = torch.Generator().manual_seed(_seed(spec_seed, "<base>", 0))
        x = torch.randn(BASE_LEN, generator=g)
        _BASE[spec_seed] = torch.cat([x, x[:BLOCK_ELEMENTS]])
    return _BASE[spec_seed]


def _block(spec_seed: int, t, b: int, rows: int, dtype) -> torch.Tensor:
    shape = (rows, *t.shape[1:]) if len(t.shape) > 1 else (rows,)
    if t.std == 0.0:
        return torch.full(shape, t.mean, dtype=dtype)
    n = math.prod(shape)
    if not t.name.endswith("mlp.gate.weight") and n <= BLOCK_ELEMENTS:
        off = _seed(spec_seed, t.name, b) % BASE_LEN
        x = _base(spec_seed)[off:off + n].view(shape).clone()
    else:
        g = torch.Generator().manual_seed(_seed(spec_seed, t.name, b))
        x = torch.randn(shape, generator=g, dtype=torch.float32)
    if t.std != 1.0:
        x.mul_(t.std)
    if t.mean:
        x.add_(t.mean)
    return x.to(dtype)


_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        threads = int(os.environ.get("BENCH_ENGINE_THREADS", os.cpu_count() or 1))
        _POOL = ThreadPoolExecutor(max(1, threads))
    return _POOL


def make(spec, t, dtype=torch.bfloat16, rows: slice | None = None) -> torch.Tensor:
    """Tensor ``t`` (spec.Tensor) of ``spec``, or only ``rows`` of its first
    dimension."""
    if t.kind == "router_bias":
        layer = int(t.name.split(".")[2])
        out = router_bias(spec, layer).to(dtype)
        return out if rows is None else out[rows]
    spec_seed = spec.seed
    n = t.shape[0]
    per = _rows_per_block(t.shape)
    if rows is None:
        start, stop = 0, n
    else:
        start, stop = rows.start or 0, n if rows.stop is None else rows.stop
    blocks = range(start // per, (stop - 1) // per + 1) if stop > start else range(0)

    def one(b: int) -> torch.Tensor:
        return _block(spec_seed, t, b, min(per, n - b * per), dtype)

    parts = list(_pool().map(one, blocks)) if len(blocks) > 1 else [one(b) for b in blocks]
    out = torch.cat(parts) if len(parts) != 1 else parts[0]
    first = blocks[0] * per if len(blocks) else start
    return out[start - first: stop - first]


# ---------------------------------------------------------------------------
# Routing spread
# ---------------------------------------------------------------------------


def route(hidden: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int,
          n_group: int = 1, topk_group: int = 1) -> torch.Tensor:
    """Expert ids [tokens, top_k] as DeepSeek-V3 / GLM-5 choose them
    (``noaux_tc``): sigmoid scores, plus the correction bias for the choice
    only, the best ``topk_group`` of ``n_group`` groups (a group scored by
    the sum of its two best), then the top ``top_k`` experts in them."""
    scores = torch.sigmoid(hidden.float() @ gate_w.float().T)
    return _choose(scores + bias.float(), top_k, n_group, topk_group)


def _choose(choice: torch.Tensor, top_k: int, n_group: int, topk_group: int) -> torch.Tensor:
    t, e = choice.shape
    if n_group > 1:
        grouped = choice.view(t, n_group, e // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = group_scores.topk(topk_group, dim=-1).indices
        mask = torch.zeros(t, n_group, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // n_group, dim=1), float("-inf"))
    return choice.topk(top_k, dim=-1).indices


def load_stats(ids: torch.Tensor, experts: int) -> dict:
    """How evenly ``ids`` [tokens, top_k] load ``experts`` experts: max and
    min load over the mean, coefficient of variation, normalised entropy
    (1: uniform), experts used."""
    load = torch.bincount(ids.flatten(), minlength=experts).double()
    mean = load.mean()
    p = load / load.sum()
    nz = p[p > 0]
    return {
        "tokens": ids.shape[0],
        "experts_used": int((load > 0).sum()),
        "experts": experts,
        "max_over_mean": round(float(load.max() / mean), 3),
        "min_over_mean": round(float(load.min() / mean), 3),
        "cv": round(float(load.std() / mean), 3),
        "entropy": round(float(-(nz * nz.log()).sum() / math.log(experts)), 4),
    }


# Balanced-ish: what a uniform multinomial gives at >= ~100 tokens per
# expert is max/mean ~1.3, min/mean ~0.7; a collapsed router (a few experts
# take everything) is far outside. The bounds leave room for sampling noise.
MAX_OVER_MEAN = 1.6
MIN_OVER_MEAN = 0.4
MIN_ENTROPY = 0.97


def balanced(stats: dict) -> list[str]:
    """Problems with a load (empty: balanced-ish)."""
    bad = []
    if stats["experts_used"] < stats["experts"]:
        bad.append(f"{stats['experts'] - stats['experts_used']} experts never chosen")
    if stats["max_over_mean"] > MAX_OVER_MEAN:
        bad.append(f"busiest expert {stats['max_over_mean']}x the mean (> {MAX_OVER_MEAN})")
    if stats["min_over_mean"] < MIN_OVER_MEAN:
        bad.append(f"idlest expert {stats['min_over_mean']}x the mean (< {MIN_OVER_MEAN})")
    if stats["entropy"] < MIN_ENTROPY:
        bad.append(f"load entropy {stats['entropy']} (< {MIN_ENTROPY})")
    return bad


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


CALIBRATION_TOKENS = 4096


def _tensor(spec, name: str):
    from .spec import hf_tensors

    return next(t for t in hf_tensors(spec) if t.name == name)


def _embedded(spec, start: int, count: int) -> torch.Tensor:
    """RMS-normed embedding rows [start, start + count) (the MoE layers'
    input is the embedding plus O(1/sqrt(layers)) sub-layer outputs here)."""
    emb = _tensor(spec, "model.embed_tokens.weight")
    return rms_norm(make(spec, emb, torch.float32, slice(start, start + count)))


_BIAS: dict = {}


def router_bias(spec, layer: int, iters: int = 100) -> torch.Tensor:
    """The correction bias that balances layer ``layer``'s random router on
    calibration tokens (embedding rows 0..CALIBRATION_TOKENS): aux-loss-free
    balancing (the bias of the busier experts lowered, of the idler raised,
    in shrinking steps), what training leaves in e_score_correction_bias.
    Deterministic (no random draws)."""
    key = (repr(spec), layer)
    if key in _BIAS:
        return _BIAS[key]
    n = min(CALIBRATION_TOKENS, (spec.vocab - 1) // 2)
    hidden = _embedded(spec, 0, n)
    w = make(spec, _tensor(spec, f"model.layers.{layer}.mlp.gate.weight"), torch.float32)
    scores = torch.sigmoid(hidden @ w.T)
    bias = torch.zeros(spec.experts)
    target = n * spec.experts_used / spec.experts
    for i in range(iters):
        ids = _choose(scores + bias, spec.experts_used, spec.n_group, spec.topk_group)
        load = torch.bincount(ids.flatten(), minlength=spec.experts).float()
        step = 0.03 * (1 - i / iters) + 1e-4
        bias -= step * torch.tanh((load - target) / target * 4)
    _BIAS[key] = bias
    return bias


def routing_check(spec, tensors: list | None = None, tokens: int = 4096) -> dict:
    """Each MoE layer's router (sigmoid + its correction bias, grouped top-k)
    on ``tokens`` held-out tokens (embedding rows after the calibration
    rows): per-layer load stats and the problems found."""
    n_cal = min(CALIBRATION_TOKENS, (spec.vocab - 1) // 2)
    tokens = min(tokens, spec.vocab - 1 - n_cal)
    hidden = _embedded(spec, n_cal, tokens)
    out = {}
    for layer in range(spec.dense_layers, spec.layers):
        m = f"model.layers.{layer}.mlp.gate."
        w = make(spec, _tensor(spec, m + "weight"), torch.float32)
        b = router_bias(spec, layer)
        stats = load_stats(route(hidden, w, b, spec.experts_used, spec.n_group,
                                 spec.topk_group), spec.experts)
        stats["problems"] = balanced(stats)
        out[str(layer)] = stats
    return out
