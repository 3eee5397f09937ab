#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Time vLLM's GGUF matrix kernels at the benchmark checkpoints' shapes,
against the same layer with its weights dequantized to fp16 first.

For each GGUF type users' files hold and each batch size (1 token to a 16k
prefill):

- ``moe``: the routed experts of one MoE layer (gate/up, SiLU-and-multiply,
  down, top-k weights) through upstream's choice of ggml's kernels
  (``_fused_moe_gguf`` with VLLM_GGUF_KERNELS=upstream: the MMQ kernel above
  64 tokens where the type has one, else the vector kernel; also each of
  the two forced at every batch size), against the same layer with fp16
  experts through vLLM's Triton ``fused_experts``, the cost of
  dequantizing all of the layer's experts to fp16 once, and the engine's
  own choice (the op with the series' defaults: dequantize + the float
  kernels from a batch size on);
- ``dense``: one GGUF linear layer (``_fused_mul_mat_gguf``) likewise:
  ggml's kernels, dequantize + ``torch.matmul``, the dequantize alone and
  the engine's choice (up to GRAPH_MAX_TOKENS also replayed in a CUDA graph,
  as decode batches run it, and so is the float path, whichever the engine
  takes: gguf_dispatch's thresholds come from these two columns; up to
  CHAIN_MAX_TOKENS the engine's choice, the float path and torch.matmul on
  fp16 weights are also timed chained, many calls on distinct weights in
  one graph, as a step's layers run them: no launch gap of the host in the
  figure, each weight read from memory; a fused layer also shard by shard,
  as vLLM 0.23 runs it, against the one weight of 0035), at a TP-8
  rank's shapes and at wider ones (TP-4, TP-2, TP-1; DeepSeek-V3.2's dense
  MLP and lm_head);
  for Q4_K, Q4_0 and Q8_0 also vLLM's dense
  Marlin GEMM on the weight repacked as gguf_marlin_linear.py repacks it
  (the engine runs it with VLLM_GGUF_MARLIN_LINEARS=1), with its distance
  from the fp16 product, also in a graph and chained.

Both also time the series' Triton dequantizer of the float paths
(gguf_dequant.py: Q8_0, Q4_K, Q6_K) and record how far its values are from
ggml_dequantize's;
``moe`` also the series' fused MoE that reads GGUF blocks itself
(gguf_fused_moe.py, VLLM_GGUF_KERNELS=fused: K-quants, Q8_0 and the IQ
types of the low-bit files; the fastest of a few tiles, named, and its
output's distance from the fp16 path's on the same values), where the
installed wheel has it; the layer as the engine runs Q4_K, Q4_0 and Q8_0
experts, repacked for vLLM's Marlin MoE kernel (gguf_marlin_moe.py, 0028;
its distance from the fp16 path's output), where the wheel has it, and
above GRAPH_MAX_TOKENS both of its ways apart: the Marlin GEMMs and the
float path from the Marlin weights (the engine picks by FLOAT_MIN_TOKENS
on SM90); and up
to GRAPH_MAX_TOKENS ggml's MMQ and vector kernels (and the Marlin layer)
replayed in a CUDA graph, as the engine runs decode batches.

Weights are random GGUF blocks with every block scale set to a finite
value (the kernels' speed does not depend on the values); routing is
uniform over the experts. Times: median of triton.testing.do_bench after
a warm-up, CUDA graphs off (these are prefill-size calls; the decode
sizes are dominated by launch overhead there, hence their graph-timed
columns). Writes bench/results/<card>/gguf_gemm.jsonl (or under
--results).

    PYTHONPATH=tests python bench/bench_gguf_gemm.py [--quick] [--results DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import sys
import time

import gguf
import numpy as np
import torch
import triton.testing
from gguf import GGMLQuantizationType as T

from benchdata import BenchData, environment, results_dir
from support.gguf_moe_ref import F16_FIELDS, gguf_moe_layer

# (gate/up type, down type) as users' files pair them: Q4_K_M's experts
# take Q6_K for some layers' down projections (use_more_bits); the dynamic
# mixtures keep down one step above gate/up
EXPERT_TYPES = [
    ("f16", None, None),
    ("q8_0", T.Q8_0, T.Q8_0),
    ("q6_k", T.Q6_K, T.Q6_K),  # also IQ3_S tensors, which load as Q6_K (0027)
    ("q5_k_m", T.Q5_K, T.Q6_K),
    ("q4_k_m", T.Q4_K, T.Q6_K),
    ("q4_k", T.Q4_K, T.Q4_K),
    ("q3_k", T.Q3_K, T.Q3_K),
    ("q2_k", T.Q2_K, T.Q3_K),
    ("iq4_xs", T.IQ4_XS, T.IQ4_XS),
    ("iq3_xxs", T.IQ3_XXS, T.IQ3_XXS),
    ("iq2_xxs", T.IQ2_XXS, T.IQ3_XXS),
]
DENSE_TYPES = [T.Q8_0, T.Q6_K, T.Q5_K, T.Q4_K, T.IQ4_XS]
# (name, experts, hidden, moe_intermediate, top_k): one TP rank's routed experts
MOE_SHAPES = [
    ("glm5-tp8", 256, 6144, 256, 8),
    ("glm5-tp4", 256, 6144, 512, 8),
    ("dsv32-tp8", 256, 7168, 256, 8),
]
# (name, out, in): a TP rank's linears that run as GGUF GEMMs; GLM-5 TP-8
# unless named
DENSE_SHAPES = [
    ("q_a+kv_a (6144 -> 2048+576)", 2624, 6144),
    ("q_b (2048 -> 8 x 256)", 2048, 2048),
    ("o_proj (8 x 256 -> 6144)", 6144, 2048),
    ("dense gate_up (6144 -> 2 x 1536)", 3072, 6144),
    ("dense down (1536 -> 6144)", 6144, 1536),
    # a TP-8 rank's eighth of the vocabulary: run outside the CUDA graphs,
    # dequantized every step from 32 tokens
    ("lm_head (6144 -> 154,880 / 8)", 19360, 6144),
    # wider weights: other TP sizes and DeepSeek-V3.2, around where
    # gguf_dispatch's float path from 8 tokens stops (DENSE_SMALL_ROWS)
    ("TP-4 o_proj (16 x 256 -> 6144)", 6144, 4096),
    ("DeepSeek-V3.2 TP-8 dense gate_up (7168 -> 2 x 2304)", 4608, 7168),
    ("TP-4 dense gate_up (6144 -> 2 x 3072)", 6144, 6144),
    ("TP-1 o_proj (64 x 256 -> 6144)", 6144, 16384),
    ("TP-2 q_b (2048 -> 32 x 256)", 8192, 2048),
    ("DeepSeek-V3.2 TP-4 dense gate_up (7168 -> 2 x 4608)", 9216, 7168),
    ("TP-2 dense gate_up (6144 -> 2 x 6144)", 12288, 6144),
    ("DeepSeek-V3.2 lm_head (7168 -> 129,280 / 8)", 16160, 7168),
    ("TP-1 q_b (2048 -> 64 x 256)", 16384, 2048),
]
# the fused layers among them: their shards' rows, which vLLM 0.23 runs one
# call a shard (the series as one weight where they share a type, 0035)
FUSED_SHARDS = {
    "q_a+kv_a (6144 -> 2048+576)": (2048, 576),
    "dense gate_up (6144 -> 2 x 1536)": (1536, 1536),
    "DeepSeek-V3.2 TP-8 dense gate_up (7168 -> 2 x 2304)": (2304, 2304),
    "TP-4 dense gate_up (6144 -> 2 x 3072)": (3072, 3072),
    "DeepSeek-V3.2 TP-4 dense gate_up (7168 -> 2 x 4608)": (4608, 4608),
    "TP-2 dense gate_up (6144 -> 2 x 6144)": (6144, 6144),
}
TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
QUICK_TOKENS = [1, 8, 32, 128, 512, 2048, 8192, 16384]


def random_blocks(qtype: T, rows: int, cols: int, gen: torch.Generator,
                  lead: tuple[int, ...] = (), device: str = "cuda",
                  rms: float | None = None) -> torch.Tensor:
    """[*lead, rows, bytes] uint8 of random blocks, block scales finite: 0.001,
    or with ``rms`` the scale that gives weights of about that rms (every
    type's weights are linear in its fp16 scales)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert cols % block == 0, (qtype.name, cols)
    nb = cols // block
    n = 1
    for d in lead:
        n *= d
    raw = torch.randint(0, 256, (n * rows * nb, size), dtype=torch.uint8, device=device,
                        generator=gen)
    value = 0.001 if rms is None else rms / unit_rms(qtype)
    scale = torch.tensor([value], dtype=torch.float16).view(torch.uint8).to(device)
    for off in F16_FIELDS[qtype.name]:
        raw[:, off:off + 2] = scale
    return raw.view(*lead, rows, nb * size)


@functools.cache
def unit_rms(qtype: T) -> float:
    """The rms of random blocks' weights with every fp16 scale 1 (gguf-py's
    decoder on 256 blocks)."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = np.random.default_rng(int(qtype)).integers(0, 256, (256, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype.name]:
        raw[:, off:off + 2] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
    w = gguf.quants.dequantize(raw.reshape(-1), qtype).astype(np.float64)
    return float(np.sqrt(np.mean(w * w)))


def dequant(w: torch.Tensor, qtype: T, cols: int) -> torch.Tensor:
    from vllm import _custom_ops as ops

    rows = w.numel() // w.shape[-1]
    return ops.ggml_dequantize(w.reshape(rows, -1), int(qtype), rows, cols,
                               torch.float16).view(*w.shape[:-1], cols)


@contextlib.contextmanager
def ggml_only():
    """The GGUF ops with upstream's choice of kernels (the series'
    VLLM_GGUF_KERNELS=upstream; a wheel without the switch has only that)."""
    old = os.environ.get("VLLM_GGUF_KERNELS")
    os.environ["VLLM_GGUF_KERNELS"] = "upstream"
    try:
        yield
    finally:
        if old is None:
            del os.environ["VLLM_GGUF_KERNELS"]
        else:
            os.environ["VLLM_GGUF_KERNELS"] = old


def has_dequant_switch() -> bool:
    import importlib.util

    return importlib.util.find_spec(
        "vllm.model_executor.layers.quantization.gguf_dispatch") is not None


# ggml_moe_a8_vec fails to launch (CUDA "invalid argument") from 65,536
# token-expert rows (8,192 tokens at top-8), and the error poisons the context
VEC_MAX_ROWS = 65535


def moe_kernel(kind: str, x, q13, q2, wts, ids, t13: int, t2: int) -> torch.Tensor:
    """The routed experts through one kernel at any batch size: ggml's, what
    _fused_moe_gguf runs above 64 tokens ("mmq", ggml_moe_a8) and at or
    below ("vec", ggml_moe_a8_vec), or the series' choice of vector kernels
    ("vec_series", gguf_dispatch.moe_vec: gguf_moe_vec's Triton kernel for
    the IQ rows it takes, ggml's for the others)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe.fused_moe import moe_align_block_size

    n, top_k = ids.shape
    e, rows, _ = q13.shape
    hidden = q2.shape[1]
    vec = ops.ggml_moe_a8_vec
    if kind == "vec_series":
        choice = series_module("gguf_dispatch").moe_vec

        def vec(inp, w, topk_ids, k, qtype, out_rows, _tokens):
            return choice(inp, w, topk_ids, k, qtype, out_rows)

    if kind == "mmq":  # one alignment for both GEMMs, by the gate/up type, as upstream
        aligned = moe_align_block_size(ids, ops.ggml_moe_get_block_size(t13), e)
        up = ops.ggml_moe_a8(x, q13, *aligned, t13, rows, top_k, n)
    else:
        up = vec(x, q13, ids, top_k, t13, rows, n)
    h = torch.empty(up.shape[0], rows // 2, dtype=up.dtype, device=up.device)
    torch.ops._C.silu_and_mul(h, up)
    if kind == "mmq":
        down = ops.ggml_moe_a8(h, q2, *aligned, t2, hidden, 1, n * top_k)
    else:
        down = vec(h, q2, ids, 1, t2, hidden, n * top_k)
    down = down.view(n, top_k, hidden).mul_(wts.view(n, top_k, 1))
    out = torch.empty_like(x)
    ops.moe_sum(down, out)
    return out


def ms(fn, *args) -> float:
    """Median ms of ``fn(*args)``."""
    fn(*args)
    torch.cuda.synchronize()
    return triton.testing.do_bench(lambda: fn(*args), warmup=3, rep=30,
                                   return_mode="median")


def _dequant_layer(q13, t13, h, q2, t2, inter):
    return dequant(q13, t13, h), dequant(q2, t2, inter)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b| (NaN counts as a difference)."""
    d = (a.float() - b.float()).abs().nan_to_num(float("inf")).max().item()
    return d / max(b.float().abs().max().item(), 1e-30)


def series_module(name: str):
    """The series' module ``name`` of vLLM's quantization layers (the Triton
    dequantizer gguf_dequant, the fused MoE gguf_fused_moe), None where the
    installed wheel lacks it."""
    import importlib

    try:
        return importlib.import_module(f"vllm.model_executor.layers.quantization.{name}")
    except ImportError:
        return None


def _triton_dequant_layer(tdq, q13, t13, q2, t2):
    return (tdq.dequantize(q13, t13, torch.float16),
            tdq.dequantize(q2, t2, torch.float16))


# the fused MoE's tiles: (BLOCK_M, BLOCK_N, warps)
FUSED_TILES = [(16, 32, 4), (16, 64, 4), (32, 32, 4), (64, 32, 4), (64, 64, 4),
               (128, 64, 8), (128, 32, 8)]


def _fused(fmoe, x, q13, t13, q2, t2, wts, ids, reference) -> dict:
    """The fused MoE at its fastest tile: ms, the tile, and its distance
    from ``reference`` (the fp16 path)."""
    n, top_k = ids.shape
    best = None
    try:
        for tile in FUSED_TILES:
            if tile[0] > 16 * max(1, n * top_k // q13.shape[0]):
                continue  # blocks mostly padding
            fn = functools.partial(fmoe.fused_moe, x, q13, int(t13), q2, int(t2), wts, ids,
                                   tile=tile)
            t = ms(fn)
            if best is None or t < best[0]:
                best = (t, "m{} n{} w{}".format(*tile), fn)
    except Exception as e:  # a candidate's failure is a finding, not the run's end
        return {"fused_error": f"{type(e).__name__}: {str(e)[:200]}"}
    if not torch.isfinite(reference).all():
        return {"fused_ms": best[0], "fused_config": best[1],
                "fused_error": "the fp16 path's result is not finite: no distance"}
    return {"fused_ms": best[0], "fused_config": best[1],
            "fused_max_diff": _max_diff(best[2](), reference)}


def marlin_layer(gm, q13, t13, q2, t2):
    """The layer of these experts as the engine runs them, repacked by the
    series' gguf_marlin_moe, or None where it does not repack them."""
    # the repack replaces the blocks it is given: a copy, the others still time them
    layer = gguf_moe_layer(q13.clone(), t13, q2.clone(), t2, torch.float16)
    return layer if gm.repack_layer(layer) else None


@contextlib.contextmanager
def marlin_float(gm, on: bool):
    """Every batch of the Marlin layer on its float path (on) or on the
    Marlin GEMMs (off), whatever gguf_marlin_moe.use_float would pick."""
    saved = gm.use_float
    gm.use_float = lambda tokens, groups=1: on
    try:
        yield
    finally:
        gm.use_float = saved


def graph_ms(fn) -> float:
    """Median ms of replaying ``fn()`` captured in a CUDA graph (after a
    run outside one: kernels compiled, tables made)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return ms(graph.replay)


def chain_graph_ms(fn, *args) -> float:
    """Median ms of one ``fn(*args)`` among calls on distinct copies of its
    weight (the first tensor among ``args`` after the activations, args[0])
    captured back to back in one CUDA graph, as a step's layers
    run: graph_ms's figure holds the host's launch of the replay (about
    7 us: torch.matmul of an 8 MB fp16 weight and one token measures 9 us
    there), and here each call reads its weight from memory (CHAIN_BYTES of
    copies, past the L2 cache)."""
    at = next(i for i, a in enumerate(args) if i > 0 and isinstance(a, torch.Tensor))
    weight = args[at]
    copies = [weight.clone() for _ in range(
        min(CHAIN_MAX_COPIES, max(8, -(-CHAIN_BYTES // weight.nbytes))))]
    calls = [functools.partial(fn, *args[:at], w, *args[at + 1:]) for w in copies]
    calls[0]()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return ms(graph.replay) / len(calls)


# the copies chain_graph_ms cycles through: twice the L2 cache of an RTX PRO
# 6000 (128 MB; the H200's is 50 MB)
CHAIN_BYTES = 256 << 20
CHAIN_MAX_COPIES = 256
# batches up to which the chained figures are taken (decode steps of a few
# sequences: the ones the host's launch gap distorts)
CHAIN_MAX_TOKENS = 32

# batches up to which ggml's kernels are also timed in CUDA graphs (decode)
GRAPH_MAX_TOKENS = 256


def bench_moe(data: BenchData, tokens: list[int], gen: torch.Generator,
              shapes: list[str], types: list[str], skip: set[str]) -> None:
    import vllm.model_executor.layers.quantization.gguf  # noqa: F401  registers the op
    from vllm.model_executor.layers.fused_moe import fused_experts
    from vllm.model_executor.layers.quantization.gguf import MMQ_QUANT_TYPES

    switch = has_dequant_switch()
    fmoe = series_module("gguf_fused_moe")
    tdq = series_module("gguf_dequant")
    gm = series_module("gguf_marlin_moe")
    vec_triton = series_module("gguf_moe_vec")
    for shape, e, h, inter, top_k in MOE_SHAPES:
        if shapes and shape not in shapes:
            continue
        for name, t13, t2 in EXPERT_TYPES:
            if types and name not in types:
                continue
            if name == "f16":
                w13 = torch.randn(e, 2 * inter, h, device="cuda", generator=gen,
                                  dtype=torch.float16) / h**0.5
                w2 = torch.randn(e, h, inter, device="cuda", generator=gen,
                                 dtype=torch.float16) / inter**0.5
                q13 = q2 = None
            else:
                # weights of rms 1/sqrt(K), as trained layers have: outputs of
                # the size of the inputs, no fp16 overflow in the reference
                q13 = random_blocks(t13, 2 * inter, h, gen, (e,), rms=h**-0.5)
                q2 = random_blocks(t2, h, inter, gen, (e,), rms=inter**-0.5)
                w13, w2 = dequant(q13, t13, h), dequant(q2, t2, inter)
            dq_ms = tdq_ms = tdq_exact = None
            marlin = None
            if q13 is not None and gm and "marlin" not in skip:
                marlin = marlin_layer(gm, q13, t13, q2, t2)
            if q13 is not None:
                dq_ms = ms(_dequant_layer, q13, t13, h, q2, t2, inter)
                if tdq and tdq.supported(t13) and tdq.supported(t2):
                    tdq_exact = max(_max_diff(tdq.dequantize(q13, t13, torch.float16), w13),
                                    _max_diff(tdq.dequantize(q2, t2, torch.float16), w2))
                    tdq_ms = ms(_triton_dequant_layer, tdq, q13, t13, q2, t2)
            for n in tokens:
                x = torch.randn(n, h, device="cuda", generator=gen, dtype=torch.float16)
                ids = torch.rand(n, e, device="cuda", generator=gen).argsort(-1)[:, :top_k]
                ids = ids.to(torch.int32).contiguous()
                wts = torch.rand(n, top_k, device="cuda", generator=gen).softmax(-1)
                f16_ms = ms(fused_experts, x, w13, w2, wts, ids)
                gguf_ms = kernel = engine_ms = mmq_ms = vec_ms = None
                notes = []
                fused = {}
                if (q13 is not None and fmoe and "fused" not in skip
                        and fmoe.supported(t13, t2, h, inter)):
                    fused = _fused(fmoe, x, q13, t13, q2, t2, wts, ids,
                                   fused_experts(x, w13, w2, wts, ids))
                    if "fused_error" in fused:
                        notes.append(f"fused MoE: {fused.pop('fused_error')}")
                graphs = {}
                if marlin is not None:
                    ref = fused_experts(x, w13, w2, wts, ids)
                    fused["marlin_ms"] = ms(gm.apply, marlin, x, wts, ids)
                    fused["marlin_max_diff"] = _max_diff(gm.apply(marlin, x, wts, ids), ref)
                    if n <= GRAPH_MAX_TOKENS:
                        graphs["marlin_graph_ms"] = graph_ms(
                            functools.partial(gm.apply, marlin, x, wts, ids))
                    elif hasattr(gm, "use_float"):
                        for way, on in (("kernel", False), ("float", True)):
                            with marlin_float(gm, on):
                                fused[f"marlin_{way}_ms"] = ms(gm.apply, marlin, x, wts, ids)
                                if on:
                                    fused["marlin_float_max_diff"] = _max_diff(
                                        gm.apply(marlin, x, wts, ids), ref)
                if q13 is not None:
                    has_mmq = t13 in MMQ_QUANT_TYPES and t2 in MMQ_QUANT_TYPES
                    kinds = ["mmq", "vec"] if has_mmq else ["vec"]
                    if vec_triton and any(vec_triton.supported(t, k) for t, k in
                                          ((t13, h), (t2, inter))):
                        kinds.append("vec_series")
                        ref = fused_experts(x, w13, w2, wts, ids)
                        fused["vec_series_max_diff"] = _max_diff(
                            moe_kernel("vec_series", x, q13, q2, wts, ids, int(t13), int(t2)),
                            ref)
                        fused["vec_max_diff"] = _max_diff(
                            moe_kernel("vec", x, q13, q2, wts, ids, int(t13), int(t2)), ref)
                    if n <= GRAPH_MAX_TOKENS:
                        for k in kinds:
                            graphs[f"{k}_graph_ms"] = graph_ms(functools.partial(
                                moe_kernel, k, x, q13, q2, wts, ids, int(t13), int(t2)))
                    kernel = "mmq" if n > 64 and has_mmq else "mmvq"  # upstream's choice
                    vec_fits = n * top_k <= VEC_MAX_ROWS
                    args = (x, q13, q2, wts, ids, int(t13), int(t2), "silu")
                    if kernel == "mmq" or vec_fits:
                        with ggml_only():
                            gguf_ms = ms(torch.ops.vllm._fused_moe_gguf, *args)
                    else:
                        notes.append(f"vector kernel not launched: {n * top_k:,} rows")
                    if switch:
                        engine_ms = ms(torch.ops.vllm._fused_moe_gguf, *args)
                    if has_mmq:
                        mmq_ms = ms(moe_kernel, "mmq", *args[:-1])
                    if vec_fits and n <= 2048:
                        vec_ms = ms(moe_kernel, "vec", *args[:-1])
                flop = 2 * n * top_k * 3 * h * inter
                data.row("moe", {"shape": shape, "experts": e, "hidden": h,
                                 "moe_intermediate": inter, "top_k": top_k, "type": name,
                                 "tokens": n},
                         kernel=kernel, gguf_ms=gguf_ms, f16_fused_ms=f16_ms, engine_ms=engine_ms,
                         mmq_ms=mmq_ms, vec_ms=vec_ms, notes=notes,
                         triton_dequant_ms=tdq_ms, triton_dequant_max_diff=tdq_exact,
                         dequant_all_ms=dq_ms, **fused, **graphs,
                         gguf_tflops=flop / gguf_ms / 1e9 if gguf_ms else None,
                         f16_tflops=flop / f16_ms / 1e9)
                print(f"moe {shape} {name:8s} {n:6d} tok: gguf {gguf_ms or 0:8.3f} ms ({kernel}) "
                      f"f16 {f16_ms:8.3f} ms dequant {dq_ms or 0:7.3f} ms "
                      f"engine {engine_ms or 0:8.3f} ms mmq {mmq_ms or 0:8.3f} ms "
                      f"vec {vec_ms or 0:8.3f} ms fused {fused.get('fused_ms') or 0:8.3f} ms "
                      f"graphs: mmq {graphs.get('mmq_graph_ms') or 0:7.3f} "
                      f"vec {graphs.get('vec_graph_ms') or 0:7.3f} ms "
                      f"vec_series {graphs.get('vec_series_graph_ms') or 0:7.3f} ms "
                      f"marlin {fused.get('marlin_ms') or 0:8.3f} ms "
                      f"(graph {graphs.get('marlin_graph_ms') or 0:7.3f} "
                      f"kernel {fused.get('marlin_kernel_ms') or 0:7.3f} "
                      f"float {fused.get('marlin_float_ms') or 0:7.3f})",
                      flush=True)
            w13 = w2 = q13 = q2 = marlin = None
            torch.cuda.empty_cache()


def marlin_dense(q: torch.Tensor, qtype: T, out: int, inp: int):
    """vLLM's dense Marlin GEMM on one GGUF linear weight repacked as the
    series repacks it (gguf_marlin_linear, VLLM_GGUF_MARLIN_LINEARS):
    (gemm, args) with gemm(x, *args) = x @ W.T, args[0] the Marlin weight.
    None where the wheel lacks either or the type has no Marlin format."""
    ml = series_module("gguf_marlin_linear")
    if ml is None or not hasattr(torch.ops._C, "marlin_gemm"):
        return None
    t = int(qtype)
    if not ml.fits(t, out, inp):
        return None
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        marlin_make_workspace_new,
    )

    w, s, zeros = ml.operands(q, t, inp, torch.float16)
    return ml.gemm, (w, s, zeros, marlin_make_workspace_new(q.device, 4), t, out)


def _float_product(x: torch.Tensor, q: torch.Tensor, qtype, tdq) -> torch.Tensor:
    """The float path of a linear layer: gguf_dequant's weight, torch.matmul."""
    return torch.matmul(x, tdq.dequantize(q, qtype, x.dtype).T)


def _f16_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, w.T)


def _shard_by_shard(x: torch.Tensor, q: torch.Tensor, qtype: int,
                    rows: tuple[int, ...], op=None) -> torch.Tensor:
    """vLLM 0.23's fused GGUF linear: the engine's choice (``op``) a shard,
    on the shard's rows of the fused weight, then their concatenation."""
    op = op or torch.ops.vllm._fused_mul_mat_gguf
    starts = [sum(rows[:i]) for i in range(len(rows) + 1)]
    return torch.cat([op(x, q[a:b], qtype) for a, b in zip(starts, starts[1:])], dim=1)


def bench_dense(data: BenchData, tokens: list[int], gen: torch.Generator) -> None:
    import vllm.model_executor.layers.quantization.gguf  # noqa: F401  registers the op

    switch = has_dequant_switch()
    tdq = series_module("gguf_dequant")

    for shape, out, inp in DENSE_SHAPES:
        for qtype in DENSE_TYPES:
            q = random_blocks(qtype, out, inp, gen, rms=inp**-0.5)
            w = dequant(q, qtype, inp)
            dq_ms = ms(dequant, q, qtype, inp)
            tdq_ms = tdq_exact = None
            if tdq and tdq.supported(qtype):
                tdq_exact = _max_diff(tdq.dequantize(q, qtype, torch.float16), w)
                tdq_ms = ms(tdq.dequantize, q, qtype, torch.float16)
            marlin_error = None
            try:
                marlin = marlin_dense(q, qtype, out, inp)
            except Exception as e:  # a candidate's failure is a finding, not the run's end
                marlin, marlin_error = None, f"{type(e).__name__}: {str(e)[:200]}"
            for n in tokens:
                x = torch.randn(n, inp, device="cuda", generator=gen, dtype=torch.float16)
                with ggml_only():
                    gguf_ms = ms(torch.ops.vllm._fused_mul_mat_gguf, x, q, int(qtype))
                engine_ms = (ms(torch.ops.vllm._fused_mul_mat_gguf, x, q, int(qtype))
                             if switch else None)
                f16_ms = ms(torch.matmul, x, w.T)
                graphed = {}
                if n <= GRAPH_MAX_TOKENS and switch:  # as decode batches run it
                    graphed["engine_graph_ms"] = graph_ms(functools.partial(
                        torch.ops.vllm._fused_mul_mat_gguf, x, q, int(qtype)))
                if n <= GRAPH_MAX_TOKENS and tdq_ms is not None:  # the float path there
                    graphed["float_graph_ms"] = graph_ms(functools.partial(
                        _float_product, x, q, qtype, tdq))
                if n <= CHAIN_MAX_TOKENS:  # as a step's layers run, back to back
                    graphed["f16_chain_ms"] = chain_graph_ms(_f16_product, x, w)
                    if switch:
                        graphed["engine_chain_ms"] = chain_graph_ms(
                            torch.ops.vllm._fused_mul_mat_gguf, x, q, int(qtype))
                    if switch and shape in FUSED_SHARDS:
                        graphed["shards_chain_ms"] = chain_graph_ms(
                            _shard_by_shard, x, q, int(qtype), FUSED_SHARDS[shape])
                    if tdq_ms is not None:
                        graphed["float_chain_ms"] = chain_graph_ms(
                            _float_product, x, q, qtype, tdq)
                if marlin is not None:
                    gemm, margs = marlin
                    try:
                        graphed["marlin_ms"] = ms(gemm, x, *margs)
                        graphed["marlin_max_diff"] = _max_diff(gemm(x, *margs),
                                                               torch.matmul(x, w.T))
                        if n <= GRAPH_MAX_TOKENS:
                            graphed["marlin_graph_ms"] = graph_ms(
                                functools.partial(gemm, x, *margs))
                        if n <= CHAIN_MAX_TOKENS:
                            graphed["marlin_chain_ms"] = chain_graph_ms(gemm, x, *margs)
                    except Exception as e:
                        marlin_error = f"{type(e).__name__}: {str(e)[:200]}"
                if marlin_error:
                    graphed["marlin_error"] = marlin_error
                data.row("dense", {"shape": shape, "out": out, "in": inp, "type": qtype.name,
                                   "tokens": n},
                         gguf_ms=gguf_ms, f16_matmul_ms=f16_ms, dequant_ms=dq_ms,
                         engine_ms=engine_ms, triton_dequant_ms=tdq_ms,
                         triton_dequant_max_diff=tdq_exact, **graphed)
                print(f"dense {shape} {qtype.name:7s} {n:6d} tok: gguf {gguf_ms:8.3f} ms "
                      f"f16 {f16_ms:8.3f} ms dequant {dq_ms:7.3f} ms "
                      f"engine {engine_ms or 0:8.3f} ms "
                      f"graph {graphed.get('engine_graph_ms', 0):7.3f} "
                      f"marlin {graphed.get('marlin_ms', 0):7.3f} "
                      f"graph {graphed.get('marlin_graph_ms', 0):7.3f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer batch sizes")
    ap.add_argument("--results", default=None, help="results root (default bench/results)")
    ap.add_argument("--skip", default="",
                    help="comma-separated: moe, dense, fused (the fused MoE's tiles), "
                         "marlin (the Marlin repack of Q4_K/Q4_0/Q8_0 experts)")
    ap.add_argument("--types", default="",
                    help=f"comma-separated expert types (default all: "
                         f"{', '.join(t[0] for t in EXPERT_TYPES)})")
    ap.add_argument("--tokens", default="",
                    help="comma-separated batch sizes (default: by --quick)")
    ap.add_argument("--shapes", default="",
                    help=f"comma-separated MoE shapes (default all: "
                         f"{', '.join(s[0] for s in MOE_SHAPES)})")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_gguf_gemm.py needs a CUDA GPU", file=sys.stderr)
        return 1
    env = environment()
    data = BenchData("gguf_gemm", env)
    tokens = QUICK_TOKENS if args.quick else TOKENS
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.time()
    skip = set(filter(None, args.skip.split(",")))
    # a run stopped by a time limit still writes what it measured (finally below);
    # one killed outright leaves its rows in gguf_gemm.jsonl.partial
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    folder = results_dir(env.get("card", "unknown-card"), args.results)
    data.keep_partial(folder)
    try:
        if "dense" not in skip:
            bench_dense(data, tokens, gen)
        if "moe" not in skip:
            bench_moe(data, tokens, gen, list(filter(None, args.shapes.split(","))),
                      list(filter(None, args.types.split(","))), skip)
    finally:
        data.figures["seconds"] = round(time.time() - t0, 1)
        print(data.write(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
