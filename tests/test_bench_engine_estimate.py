"""The whole-model estimate (bench/engine/estimate.py) on CPU: a profiled
step taken apart loses no time, scales as its assumptions say, and renders
with the profile's record."""

from __future__ import annotations

import pytest

from benchdata import BenchData
from engine import estimate, record
from engine import spec as specs

GLM5 = specs.SPECS["glm5-tp8"]
H200 = estimate.CARDS["nvidia-h200"]

DECODE = {"steps": 10, "batch": {"ctx_requests": 0, "ctx_tokens": 0, "gen_requests": 32},
          "step_us": 5000.0, "gpu_busy_us": 4400.0, "not_gpu_us": 600.0,
          "categories_us": {"GGUF dequantize": 1600.0, "GGUF MoE": 1050.0, "dense GEMMs": 900.0,
                            "sparse attention": 180.0, "MoE routing": 30.0, "sampler": 30.0},
          "outside_graphs_us": {"GGUF dequantize": 1200.0, "dense GEMMs": 460.0,
                                "sampler": 30.0},
          "top_kernels": []}
PREFILL = {"steps": 2, "batch": {"ctx_requests": 1, "ctx_tokens": 8192, "gen_requests": 0},
           "step_us": 60000.0, "gpu_busy_us": 53000.0, "not_gpu_us": 7000.0,
           "categories_us": {"sparse attention": 24000.0, "dense GEMMs": 8000.0,
                             "GGUF MoE": 5400.0, "GGUF linears": 500.0},
           "outside_graphs_us": {"sparse attention": 24000.0, "dense GEMMs": 8000.0,
                                 "GGUF MoE": 5400.0, "GGUF linears": 500.0},
           "top_kernels": []}


def _total(t: dict, s=GLM5) -> float:
    return (s.dense_layers * sum(t["dense"].values()) + s.moe_layers * sum(t["moe"].values())
            + t["head_us"] + t["rest_us"])


@pytest.mark.parametrize("figures, head", [(DECODE, None), (PREFILL, 400.0)])
def test_taking_a_step_apart_loses_no_time(figures, head):
    t = estimate.layer_times(GLM5, figures, head)
    assert _total(t) == pytest.approx(sum(figures["categories_us"].values()))
    # routed experts only in MoE layers; the head is the graph's outside
    assert t["dense"]["GGUF MoE"] == 0 and t["moe"]["GGUF MoE"] > 0
    if head is None:
        assert t["head_us"] == pytest.approx(1200 + 460) and t["rest_us"] == 30
    # a dense layer's linears (its MLP) outweigh a MoE layer's (a shared expert)
    assert t["dense"]["dense GEMMs"] > t["moe"]["dense GEMMs"]


def test_same_card_and_layer_count_gives_back_the_profile(monkeypatch):
    monkeypatch.setitem(estimate.REAL_LAYERS, "glm5", (GLM5.dense_layers, GLM5.moe_layers))
    e = estimate.whole_model(GLM5, DECODE, "decode", 32, 0.0, H200, H200, case=None)
    head = 1200 + 460
    assert e["step_us"] == pytest.approx(sum(DECODE["categories_us"].values()) - head
                                         + head / GLM5.tp)
    assert e["allreduce_us"] == 0


def test_scaling_follows_bandwidth_compute_and_layers():
    half_bw = estimate.Card("half", H200.bandwidth_gb_s / 2, H200.fp16_tflops, "test")
    half_fl = estimate.Card("half", H200.bandwidth_gb_s, H200.fp16_tflops / 2, "test")
    base = estimate.whole_model(GLM5, DECODE, "decode", 32, 0.0, H200, H200, case=None)
    slow = estimate.whole_model(GLM5, DECODE, "decode", 32, 0.0, half_bw, H200, case=None)
    assert slow["step_us"] == pytest.approx(2 * base["step_us"])
    fast = estimate.whole_model(GLM5, DECODE, "decode", 32, 0.0, half_bw, H200, case=None,
                                latency_bound=True)
    assert fast["step_us"] == pytest.approx(base["step_us"])
    # prefill: the GEMMs by compute, the rest by bandwidth
    p0 = estimate.whole_model(GLM5, PREFILL, "prefill", 8192, 0.0, H200, H200, 400.0, None)
    p1 = estimate.whole_model(GLM5, PREFILL, "prefill", 8192, 0.0, half_fl, H200, 400.0, None)
    assert p0["layers_us"] < p1["layers_us"] < 2 * p0["layers_us"]
    # GLM-5's 3 dense and 75 MoE layers from a file of 3 and 3
    t = estimate.layer_times(GLM5, DECODE)
    assert base["layers_us"] == pytest.approx(3 * sum(t["dense"].values())
                                              + 75 * sum(t["moe"].values()))


def test_allreduce_model():
    assert estimate.allreduce_us(32, 6144, 1) == 0
    small = estimate.allreduce_us(1, 6144, 8)
    big = estimate.allreduce_us(8192, 6144, 8)
    alpha, busbw = estimate.ALLREDUCE["alpha_us"][1], estimate.ALLREDUCE["busbw_gb_s"][1]
    assert small == pytest.approx(alpha + 1.75 * 6144 * 2 / (busbw * 1e3))
    assert big > 100 * small  # bandwidth-bound at prefill sizes


def _record(card: str) -> tuple[dict, list[dict]]:
    data = BenchData("engine_profile", {"date_utc": "2026-12-03 13:14", "card": card,
                                        "series": "0.23.0+dsa.sm120.test"})
    for scenario, f in (("decode-32-32k", DECODE), ("prefill-16k", PREFILL)):
        for path in ("triton-fp16", "flashmla-bf16"):
            data.row("profile", {"checkpoint": "glm5-tp8", "type": "q4_k_m", "path": path,
                                 "scenario": scenario}, **f, trace="t.json.gz", command="x")
    return {"env": data.env}, data.rows


def test_estimate_renders_with_the_profile(tmp_path):
    run, rows = _record("NVIDIA H200")
    md = estimate.estimate_md(run, rows)
    assert "RTX PRO 6000" in md and "| glm5-tp8 q4_k_m | decode-32-32k |" in md
    summary = md.split("## Per layer")[0]
    assert summary.count("| glm5-tp8 q4_k_m |") == 2  # the series' path only
    # per layer: routed experts in MoE layers only, largest category first
    layers = md.split("## Per layer")[1]
    assert "| glm5-tp8 q4_k_m | decode-32-32k | GGUF MoE | 0.0 | 350.0 |" in layers
    assert layers.index("| decode-32-32k | GGUF MoE |") < layers.index(
        "| decode-32-32k | sparse attention |")
    assert "No card data" in estimate.estimate_md(*_record("Some Other GPU"))
    assert "engine_estimate.md" in record.RENDERERS["engine_profile"]
