"""bench/bench_gguf_gemm.py on CPU: its random GGUF blocks decode (llama.cpp's
own numpy dequantizer, gguf-py) to finite weights whose size follows the
block scale it sets, for every type it times."""

from __future__ import annotations

import contextlib

import bench_gguf_gemm as bench
import gguf
import numpy as np
import pytest
import torch

from support.gguf_moe_ref import F16_FIELDS

TYPES = sorted({t for _, a, b in bench.EXPERT_TYPES for t in (a, b) if t is not None}
               | set(bench.DENSE_TYPES), key=lambda t: t.name)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks_have_finite_scaled_weights(qtype):
    gen = torch.Generator().manual_seed(int(qtype))
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    q = bench.random_blocks(qtype, 4, 2 * block, gen, (3,), device="cpu")
    assert q.shape == (3, 4, 2 * gguf.GGML_QUANT_SIZES[qtype][1])
    w = gguf.quants.dequantize(q.numpy().reshape(-1), qtype)
    assert w.size == 3 * 4 * 2 * block
    assert np.isfinite(w).all() and np.abs(w).max() > 0
    # every fp16 block scale is one the bench set: doubling them doubles the weights
    raw = q.numpy().reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1]).copy()
    for off in F16_FIELDS[qtype.name]:
        assert (raw[:, off:off + 2].view(np.float16) == np.float16(0.001)).all()
        raw[:, off:off + 2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    w2 = gguf.quants.dequantize(raw.reshape(-1), qtype)
    np.testing.assert_allclose(w2, 2 * w, rtol=1e-2, atol=1e-7)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks_take_the_rms_asked_for(qtype):
    """With rms=1/sqrt(K) the fp16 reference of a K-long dot product stays
    near 1 (the MoE's fp16 path overflowed with the fixed scale)."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    cols = 24 * block if block == 32 else 3 * block
    q = bench.random_blocks(qtype, 64, cols, torch.Generator().manual_seed(3), device="cpu",
                            rms=cols**-0.5)
    w = gguf.quants.dequantize(q.numpy().reshape(-1), qtype).astype(np.float64)
    assert np.isfinite(w).all()
    assert np.sqrt(np.mean(w * w)) == pytest.approx(cols**-0.5, rel=0.1)


def test_the_graph_table_holds_the_graph_timed_rows():
    """Rows timed in CUDA graphs get the decode table (the vector kernel
    over MMQ); rows without (prefill sizes) do not."""
    import render

    inputs = {"shape": "glm5-tp8", "experts": 256, "hidden": 6144, "moe_intermediate": 256,
              "top_k": 8, "type": "q4_k_m"}
    rows = [{"record": "row", "table": "moe", "inputs": {**inputs, "tokens": 32},
             "figures": {"kernel": "mmvq", "gguf_ms": 1.2, "f16_fused_ms": 0.4,
                         "dequant_all_ms": 2.8, "mmq_graph_ms": 0.4, "vec_graph_ms": 1.2}},
            {"record": "row", "table": "moe", "inputs": {**inputs, "tokens": 2048},
             "figures": {"kernel": "mmq", "gguf_ms": 9.3, "f16_fused_ms": 0.9,
                         "dequant_all_ms": 2.8}}]
    text = render.gguf_gemm_md({"env": {}}, rows)
    graphed = text.split("Decode batches of glm5-tp8")[1]
    assert [line for line in graphed.splitlines() if line.startswith("| q4_k_m |")] == [
        "| q4_k_m | 32 | 0.4 | 1.2 | 3.00 |"]
    assert text.count("Decode batches of glm5-tp8") == 1


def _dense_row(type_name: str = "Q4_K", tokens: int = 8, **figures) -> dict:
    """One o_proj row of the linear table, with the figures every run has."""
    return {"record": "row", "table": "dense",
            "inputs": {"shape": "o_proj", "out": 6144, "in": 2048, "type": type_name,
                       "tokens": tokens},
            "figures": {"gguf_ms": 0.1, "f16_matmul_ms": 0.02, "dequant_ms": 0.03,
                        "engine_ms": 0.05, **figures}}


def _o_proj_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| o_proj |")]


def test_the_linear_table_shows_graph_timed_rows_only_in_runs_that_have_them():
    import render

    old = [_dense_row(tokens=32)]
    assert "engine (graph)" not in render.gguf_gemm_md({"env": {}}, old)
    new = old + [_dense_row(engine_graph_ms=0.0297)]
    rows = _o_proj_lines(render.gguf_gemm_md({"env": {}}, new))
    assert rows[0].endswith("|  |") and rows[1].endswith("| 0.0297 |")


def test_the_linear_table_shows_the_graphed_float_path_only_in_runs_that_timed_it():
    import render

    old = [_dense_row(engine_graph_ms=0.03)]
    assert "float (graph)" not in render.gguf_gemm_md({"env": {}}, old)
    new = old + [_dense_row("Q6_K", engine_graph_ms=0.03, float_graph_ms=0.0221)]
    text = render.gguf_gemm_md({"env": {}}, new)
    assert "| engine (graph) | float (graph) |" in text
    rows = _o_proj_lines(text)
    assert rows[0].endswith("| 0.03 |  |") and rows[1].endswith("| 0.03 | 0.0221 |")


def test_the_linear_table_shows_the_chained_figures_only_in_runs_that_took_them():
    import render

    old = [_dense_row(engine_graph_ms=0.03, float_graph_ms=0.02)]
    assert "(chained)" not in render.gguf_gemm_md({"env": {}}, old)
    new = old + [_dense_row(engine_graph_ms=0.03, float_graph_ms=0.02, engine_chain_ms=0.0041,
                            float_chain_ms=0.0093, f16_chain_ms=0.0038),
                 _dense_row("Q5_0", engine_graph_ms=0.03, engine_chain_ms=0.005,
                            f16_chain_ms=0.0038)]
    text = render.gguf_gemm_md({"env": {}}, new)
    assert "| float (graph) | engine (chained) | float (chained) | fp16 (chained) |" in text
    rows = _o_proj_lines(text)
    assert rows[0].endswith("| 0.02 |  |  |  |")
    assert rows[1].endswith("| 0.02 | 0.0041 | 0.0093 | 0.0038 |")
    assert rows[2].endswith("|  | 0.005 |  | 0.0038 |")


def test_the_linear_table_shows_fused_layers_shard_by_shard_only_in_runs_that_took_them():
    import render

    chained = dict(engine_graph_ms=0.03, float_graph_ms=0.02, engine_chain_ms=0.0041,
                   float_chain_ms=0.0093, f16_chain_ms=0.0038)
    old = [_dense_row(**chained)]
    assert "shard by shard" not in render.gguf_gemm_md({"env": {}}, old)
    new = old + [_dense_row(**chained, shards_chain_ms=0.0097)]
    text = render.gguf_gemm_md({"env": {}}, new)
    assert "| fp16 (chained) | shard by shard (chained) |" in text
    rows = _o_proj_lines(text)
    assert rows[0].endswith("| 0.0038 |  |") and rows[1].endswith("| 0.0038 | 0.0097 |")


@pytest.mark.parametrize("shape", sorted(bench.FUSED_SHARDS))
def test_shard_by_shard_computes_the_fused_layer(shape):
    """The shards add up to their layer's rows, and one call a shard on its
    rows, concatenated, is the fused weight's product (a CPU stand-in of the
    engine's op: gguf-py's dequantizer, then the product)."""
    (out,) = [o for name, o, _ in bench.DENSE_SHAPES if name == shape]
    rows = bench.FUSED_SHARDS[shape]
    assert sum(rows) == out
    calls = []

    def op(x, q, qtype):
        calls.append(q.shape[0])
        w = gguf.quants.dequantize(q.numpy(), gguf.GGMLQuantizationType(qtype))
        return x @ torch.from_numpy(w).T

    gen = torch.Generator().manual_seed(35)
    small = [r // 64 for r in rows]  # the layer's proportions, few rows
    q = bench.random_blocks(gguf.GGMLQuantizationType.Q8_0, sum(small), 64, gen, device="cpu")
    x = torch.randn(2, 64, generator=gen)
    got = bench._shard_by_shard(x, q, int(gguf.GGMLQuantizationType.Q8_0), tuple(small), op)
    assert calls == small
    assert torch.allclose(got, op(x, q, int(gguf.GGMLQuantizationType.Q8_0)))


def test_the_linear_table_shows_the_marlin_candidate_only_in_runs_that_timed_it():
    import render

    old = [_dense_row(engine_graph_ms=0.03)]
    assert "Marlin" not in render.gguf_gemm_md({"env": {}}, old).split("Linear layers")[1]
    new = old + [_dense_row("Q8_0", engine_graph_ms=0.03, marlin_ms=0.0121,
                            marlin_max_diff=6e-4, marlin_graph_ms=0.0093)]
    rows = _o_proj_lines(render.gguf_gemm_md({"env": {}}, new))
    assert rows[0].endswith("| 0.03 |  |  |")
    assert rows[1].endswith("| 0.03 | 0.0121 (diff 6.0e-04) | 0.0093 |")
    failed = old + [_dense_row(engine_graph_ms=0.03, marlin_error="RuntimeError: no kernel")]
    rows = _o_proj_lines(render.gguf_gemm_md({"env": {}}, failed))
    assert rows[1].endswith("| 0.03 | failed: RuntimeError: no kernel |  |")


def test_marlin_chained_has_its_column_in_runs_that_timed_it():
    import render

    timed = [_dense_row("Q8_0", engine_graph_ms=0.03, marlin_ms=0.0121,
                        marlin_max_diff=6e-4, marlin_graph_ms=0.0093),
             _dense_row("Q8_0", engine_graph_ms=0.03, marlin_ms=0.0121,
                        marlin_max_diff=6e-4, marlin_graph_ms=0.0093,
                        marlin_chain_ms=0.0071)]
    text = render.gguf_gemm_md({"env": {}}, timed)
    assert "Marlin (chained)" in text
    rows = _o_proj_lines(text)
    assert rows[0].endswith("| 0.0093 |  |") and rows[1].endswith("| 0.0093 | 0.0071 |")
    assert "Marlin (chained)" not in render.gguf_gemm_md({"env": {}}, timed[:1])


def test_the_marlin_columns_appear_only_in_runs_that_measured_it():
    """Runs before 0028 render as they did; a run with the Marlin repack
    gets its column in both MoE tables, empty for types it does not take."""
    import render

    inputs = {"shape": "glm5-tp8", "experts": 256, "hidden": 6144, "moe_intermediate": 256,
              "top_k": 8, "tokens": 32}
    figures = {"kernel": "mmvq", "gguf_ms": 1.2, "f16_fused_ms": 0.4, "dequant_all_ms": 2.8,
               "mmq_graph_ms": 0.4, "vec_graph_ms": 1.2}
    old = [{"record": "row", "table": "moe", "inputs": {**inputs, "type": "q4_k_m"},
            "figures": figures}]
    assert "Marlin" not in render.gguf_gemm_md({"env": {}}, old).split("Median ms.")[1]
    new = old + [{"record": "row", "table": "moe", "inputs": {**inputs, "type": "q4_k"},
                  "figures": {**figures, "marlin_ms": 0.336, "marlin_max_diff": 5e-4,
                              "marlin_graph_ms": 0.216}}]
    text = render.gguf_gemm_md({"env": {}}, new)
    main, graphed = text.split("Decode batches of glm5-tp8")
    q4_k = [line for line in main.splitlines() if line.startswith("| q4_k |")]
    assert q4_k and q4_k[0].endswith("| 0.336 (diff 5.0e-04) |  |")
    q4_k_m = [line for line in main.splitlines() if line.startswith("| q4_k_m |")]
    assert q4_k_m[0].endswith("|  |  |")
    assert [line for line in graphed.splitlines() if line.startswith("| q4_k |")] == [
        "| q4_k | 32 | 0.4 | 1.2 | 3.00 | 0.216 |"]


def test_the_marlin_cell_shows_its_two_ways_where_they_were_timed_apart():
    import render

    inputs = {"shape": "glm5-tp8", "experts": 256, "hidden": 6144, "moe_intermediate": 256,
              "top_k": 8, "type": "q4_k"}
    figures = {"kernel": "mmq", "gguf_ms": 32.5, "f16_fused_ms": 2.1, "dequant_all_ms": 2.8,
               "marlin_ms": 3.3, "marlin_max_diff": 8e-4}
    rows = [{"record": "row", "table": "moe", "inputs": {**inputs, "tokens": 2048},
             "figures": figures},
            {"record": "row", "table": "moe", "inputs": {**inputs, "tokens": 8192},
             "figures": {**figures, "marlin_kernel_ms": 4.43, "marlin_float_ms": 3.3,
                         "marlin_float_max_diff": 6e-4}}]
    lines = [line for line in render.gguf_gemm_md({"env": {}}, rows).splitlines()
             if line.startswith("| q4_k |")]
    assert lines[0].endswith("| 3.3 (diff 8.0e-04) |  |")
    assert lines[1].endswith("| 3.3 (diff 8.0e-04); GEMMs 4.43, float path 3.3 "
                             "(diff 6.0e-04) |  |")


@pytest.mark.parametrize("nbytes, copies", [(256, 256), (3 << 10, 22), (100 << 10, 8)])
def test_a_chained_figure_is_one_call_of_many_on_distinct_weights(monkeypatch, nbytes, copies):
    """chain_graph_ms captures calls on copies of the weight (CHAIN_BYTES of
    them, 8 to 256), every other argument as given, and divides the
    replay's time by their count. On CPU: the graph a stand-in that runs
    what was captured when replayed."""
    captured, calls = [], []

    class Graph:
        def replay(self):
            for call in captured:
                call()

    @contextlib.contextmanager
    def capture(graph):
        recording = calls.copy()
        yield
        captured.extend(calls[len(recording):])
        del calls[len(recording):]

    def fn(x, weight, qtype):
        calls.append(lambda: seen.append((x, weight, qtype)))

    seen = []
    monkeypatch.setattr(bench, "CHAIN_BYTES", 64 << 10)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def timed(replay):
        replay()
        return 2.0

    monkeypatch.setattr(bench, "ms", timed)
    x = torch.ones(2, 4)
    weight = torch.arange(nbytes, dtype=torch.uint8)
    assert bench.chain_graph_ms(fn, x, weight, 12) == pytest.approx(2.0 / copies)
    assert len(seen) == copies
    assert all(a is x and q == 12 for a, _, q in seen)
    ptrs = {w.data_ptr() for _, w, _ in seen}
    assert len(ptrs) == copies and weight.data_ptr() not in ptrs
    assert all(torch.equal(w, weight) for _, w, _ in seen[:2])
