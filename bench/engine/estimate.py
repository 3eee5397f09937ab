# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The whole model on another card, estimated from a measured engine
profile (``engine_profile.jsonl`` of one benchmark file): what one rank's
step would take at the real layer count, scaled to the card by its
bandwidth and compute, with tensor-parallel all-reduce over PCIe modeled.
An estimate with its assumptions in CARDS, REAL_LAYERS and ALLREDUCE, to be
replaced by measurement the day a card runs the benchmark.

How a profiled step is taken apart (decode: per captured-graph layer work
and what runs outside the graph; prefill has no graph):

- outside the graph, the output head's categories (the logits' projection:
  GGUF linears, GGUF dequantize, dense GEMMs) are the head; the file keeps
  the whole vocabulary, a real rank an 1/TP of it, so the head is divided
  by the checkpoint's TP; the rest outside the graph is per step;
- in prefill, the head is the one-stream decode's (one token a prompt);
- the routed experts' categories (GGUF MoE, MoE routing) belong to the
  MoE layers, split evenly among them;
- the linear categories belong to every layer in proportion to its linear
  weights' parameters per rank (a dense layer's MLP is wider than a MoE
  layer's shared expert); everything else (attention, indexer, norms) is
  split evenly over the layers;
- times then scale to the real model's layers and to the card: a
  compute-bound category (GEMMs and the float-path MoE in prefill) by the
  ratio of dense fp16 tensor throughput, the rest by the ratio of memory
  bandwidth (decode kernels that run below the memory's roofline are
  latency-bound and may scale better: the estimate is on the slow side);
- the step adds two all-reduces a layer and one for the embedding (vLLM's
  row-parallel attention output and MLP/MoE output), each ``alpha +
  2 (N-1)/N * bytes / busbw``, and the host's per-step time measured
  without the profiler (ITL minus GPU time).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import spec as specs


@dataclass(frozen=True)
class Card:
    name: str
    bandwidth_gb_s: float  # memory bandwidth, datasheet
    fp16_tflops: float  # dense fp16/bf16 tensor throughput, fp32 accumulate
    source: str


CARDS = {
    "nvidia-h200": Card("NVIDIA H200", 4800.0, 989.0, "datasheet (SXM)"),
    "rtx-pro-6000": Card(
        "RTX PRO 6000 Blackwell Workstation Edition", 1792.0, 500.0,
        "datasheet bandwidth; fp16 dense taken as its 4,000 sparse FP4 TOPS / 8 (assumed)"),
}

# the real models' (dense, MoE) layer counts, by the checkpoint's model
REAL_LAYERS = {"glm5": (3, 75), "glm52": (3, 75), "dsv32": (3, 58)}

# NCCL ring all-reduce over PCIe 5.0 x16 without NVLink (assumed): per-call
# latency and bus bandwidth, with a low and a high case
ALLREDUCE = {"alpha_us": (10.0, 20.0, 40.0), "busbw_gb_s": (40.0, 25.0, 15.0)}

HEAD_CATS = ("GGUF linears", "GGUF dequantize", "dense GEMMs")
LINEAR_CATS = HEAD_CATS
MOE_CATS = ("GGUF MoE", "MoE routing")
# prefill categories that run tensor-core GEMMs (the float path)
COMPUTE_CATS = ("dense GEMMs", "GGUF MoE")


def linear_params(s: specs.Spec) -> tuple[int, int]:
    """Parameters of one rank's linear weights (not routed experts) in a
    dense and in a MoE layer: attention projections, indexer, dense MLP or
    shared experts."""
    attn = (s.hidden * s.q_lora + s.hidden * (s.kv_lora + s.qk_rope)  # q_a, kv_a (replicated)
            + s.q_lora * s.heads * (s.qk_nope + s.qk_rope)  # q_b
            + s.kv_lora * s.heads * (s.qk_nope + s.v_head)  # kv_b
            + s.heads * s.v_head * s.hidden  # o_proj
            + s.q_lora * s.index_heads * s.index_dim  # indexer wq_b
            + s.hidden * s.index_dim + s.hidden * s.index_heads)  # indexer wk, weights
    return (attn + 3 * s.hidden * s.intermediate,
            attn + 3 * s.hidden * s.moe_intermediate * s.shared_experts)


def allreduce_us(tokens: int, hidden: int, tp: int, case: int = 1) -> float:
    if tp <= 1:
        return 0.0
    nbytes = tokens * hidden * 2  # fp16 activations
    alpha, busbw = ALLREDUCE["alpha_us"][case], ALLREDUCE["busbw_gb_s"][case]
    return alpha + 2 * (tp - 1) / tp * nbytes / (busbw * 1e3)


def layer_times(s: specs.Spec, figures: dict, head_us: float | None = None) -> dict:
    """One profiled step taken apart (µs, the profiled card): per dense
    layer, per MoE layer, the head, and the rest of the step's kernels."""
    cats = figures["categories_us"]
    outside = figures.get("outside_graphs_us", {})
    if head_us is None:
        head_us = sum(outside.get(c, 0.0) for c in HEAD_CATS)
        body = {c: us - outside.get(c, 0.0) for c, us in cats.items()}
        rest = sum(us for c, us in outside.items() if c not in HEAD_CATS)
    else:  # prefill: nothing graphed, the head is given
        body = dict(cats)
        body["GGUF linears"] = max(body.get("GGUF linears", 0.0) - head_us, 0.0)
        rest = 0.0
    dense_p, moe_p = linear_params(s)
    lin_w = s.dense_layers * dense_p + s.moe_layers * moe_p
    dense = {c: 0.0 for c in body}
    moe = {c: 0.0 for c in body}
    for c, us in body.items():
        if c in MOE_CATS:
            moe[c] = us / s.moe_layers
        elif c in LINEAR_CATS:
            dense[c], moe[c] = us * dense_p / lin_w, us * moe_p / lin_w
        else:
            dense[c] = moe[c] = us / s.layers
    return {"dense": dense, "moe": moe, "head_us": head_us, "rest_us": rest}


def whole_model(s: specs.Spec, figures: dict, kind: str, tokens: int, host_us: float,
                card: Card, measured: Card, head_us: float | None = None,
                case: int | None = 1, latency_bound: bool = False) -> dict:
    """One real rank's step on ``card`` (µs) from a profile measured on
    ``measured``: GPU kernels at the real layer count, all-reduces (``case``
    of ALLREDUCE; None: none), host. ``latency_bound``: decode kernels take
    the measured card's time (they run far below its bandwidth), the fast
    bound; otherwise every kernel scales by bandwidth or compute."""
    model = s.name.split("-")[0]
    n_dense, n_moe = REAL_LAYERS[model]
    t = layer_times(s, figures, head_us)
    bw = measured.bandwidth_gb_s / card.bandwidth_gb_s
    fl = measured.fp16_tflops / card.fp16_tflops
    if latency_bound and kind == "decode":
        bw = 1.0

    def scale(c: str, us: float) -> float:
        return us * (fl if kind == "prefill" and c in COMPUTE_CATS else bw)

    layers = (n_dense * sum(scale(c, us) for c, us in t["dense"].items())
              + n_moe * sum(scale(c, us) for c, us in t["moe"].items()))
    head = t["head_us"] / s.tp * bw
    rest = t["rest_us"] * bw
    comm = 0.0 if case is None else (
        (2 * (n_dense + n_moe) + 1) * allreduce_us(tokens, s.hidden, s.tp, case))
    total = layers + head + rest + comm + host_us
    return {"layers_us": layers, "head_us": head, "rest_us": rest, "allreduce_us": comm,
            "host_us": host_us, "step_us": total}


# The host's time per decode step, which a CUDA-graphed step does not
# multiply by layers: one stream's ITL without the profiler minus its GPU
# time (2.54 - 1.46 ms, H200 host, 2026-12-03c). Assumed for the card's host.
HOST_US = 1080.0
TARGET = "rtx-pro-6000"
PATH = "triton-fp16"  # the series' path: what runs on SM120


def estimate_md(run: dict, rows: list[dict]) -> str:
    """engine_estimate.md: the series' profiled steps as a whole model's
    rank on the target card (rendered with engine_profile.md)."""
    from benchdata import card_slug
    from render import fmt, table

    target = CARDS[TARGET]
    measured_name = run["env"].get("card", "?")
    measured = CARDS.get(card_slug(measured_name)) if measured_name != "?" else None
    out = [f"# Estimate: the whole model on one {target.name} of TP 8, from this card's profile",
           ""]
    out += [(f"Generated from `engine_profile.jsonl` (measured on {measured_name}, series "
             f"{run['env'].get('series', '?')}) by bench/engine/estimate.py; its docstring "
             "says how a step is taken apart and scaled. An estimate, not a measurement."), ""]
    if measured is None:
        return "\n".join(out + [f"No card data for {measured_name} in estimate.CARDS.", ""])
    out += [(f"Cards: {measured.name} {measured.bandwidth_gb_s:,.0f} GB/s, "
             f"{measured.fp16_tflops:,.0f} TFLOP/s fp16 ({measured.source}); {target.name} "
             f"{target.bandwidth_gb_s:,.0f} GB/s, {target.fp16_tflops:,.0f} TFLOP/s "
             f"({target.source}). All-reduce over PCIe per call: alpha "
             f"{'/'.join(f'{a:g}' for a in ALLREDUCE['alpha_us'])} µs, bus bandwidth "
             f"{'/'.join(f'{b:g}' for b in ALLREDUCE['busbw_gb_s'])} GB/s (low/mid/high "
             f"cost); host {HOST_US:g} µs a step (decode)."), ""]
    prof = [r for r in rows if r["table"] == "profile" and r["inputs"]["path"] == PATH]
    lines, per_layer = [], []
    for r in prof:
        i, f = r["inputs"], r["figures"]
        s = specs.SPECS.get(i["checkpoint"])
        if s is None or s.name.split("-")[0] not in REAL_LAYERS:
            continue
        decode1 = next((q["figures"] for q in prof if q["inputs"]["checkpoint"] == s.name
                        and q["inputs"]["scenario"].startswith("decode-1-")), None)
        kind = "prefill" if f["batch"]["ctx_requests"] else "decode"
        if kind == "prefill":
            tokens = int(f["batch"]["ctx_tokens"])
            head = (sum(decode1.get("outside_graphs_us", {}).get(c, 0.0) for c in HEAD_CATS)
                    if decode1 else 0.0)
            host = 0.0
        else:
            tokens, head, host = int(f["batch"]["gen_requests"]), None, HOST_US
        here = whole_model(s, f, kind, tokens, host, measured, measured, head, case=None)
        t = layer_times(s, f, head)
        n_dense, n_moe = REAL_LAYERS[s.name.split("-")[0]]
        for c in sorted(t["moe"], key=lambda c: -(n_dense * t["dense"][c] + n_moe * t["moe"][c])):
            total = n_dense * t["dense"][c] + n_moe * t["moe"][c]
            if total >= 0.01 * here["layers_us"]:
                per_layer.append([f"{s.name} {i['type']}", i["scenario"], c,
                                  fmt(t["dense"][c], ".1f"), fmt(t["moe"][c], ".1f"),
                                  fmt(total / 1e3, ".2f"),
                                  f"{100 * total / here['layers_us']:.0f} %"])
        # fastest: latency-bound decode kernels, cheap all-reduce; slowest:
        # everything scaled by bandwidth, dear all-reduce
        fast = whole_model(s, f, kind, tokens, host, target, measured, head, 0, True)
        slow = whole_model(s, f, kind, tokens, host, target, measured, head, 2, False)
        mid = whole_model(s, f, kind, tokens, host, target, measured, head, 1, False)
        gpu = [e["layers_us"] + e["head_us"] + e["rest_us"] for e in (fast, slow)]
        lines.append([
            f"{s.name} {i['type']}", i["scenario"], f"{here['step_us'] / 1e3:.1f}",
            f"{gpu[0] / 1e3:.1f}–{gpu[1] / 1e3:.1f}",
            f"{fast['allreduce_us'] / 1e3:.1f}–{slow['allreduce_us'] / 1e3:.1f}",
            f"{fast['step_us'] / 1e3:.1f}–{slow['step_us'] / 1e3:.1f}",
            f"{tokens / (slow['step_us'] / 1e6):,.0f}–{tokens / (fast['step_us'] / 1e6):,.0f}",
            f"{tokens / (mid['step_us'] / 1e6):,.0f}"])
    out += table(["file", "scenario", f"{measured.name}: step ms (real layers, no all-reduce)",
                  "GPU ms", "all-reduce ms", "step ms", "tok/s",
                  "tok/s, bandwidth-scaled, mid all-reduce"], "llrrrrrr", lines)
    out += ["", ("Per rank of TP 8 at the real layer count. Ranges run from the fast bound "
                 "(decode kernels as fast as on the measured card, being latency-bound; the "
                 "cheap all-reduce) to the slow one (every kernel scaled by bandwidth or "
                 "compute; the dear all-reduce). Decode tok/s: the batch's tokens a step; "
                 "prefill: the chunk's tokens a step. The third column is the measured card "
                 "at the real layer count, without communication (its host time included).")]
    out += ["", f"## Per layer on {measured.name} (the layers' share of a real rank's step)", ""]
    out += table(["file", "scenario", "category", "dense layer µs", "MoE layer µs",
                  "all layers ms", "share"], "lllrrrr", per_layer)
    out += ["", ("Categories of at least 1 % of the layers' time, largest first; the "
                 "profiled card's kernel times, taken apart as the module's docstring says.")]
    return "\n".join(out) + "\n"
