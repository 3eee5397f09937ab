# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GGUF linear layers on vLLM's dense Marlin GEMM (gguf_marlin_linear.py,
VLLM_GGUF_MARLIN_LINEARS, on by default).

CPU: a GGUFLinearMethod layer (one weight, a fused q_a + kv_a, rows not a
multiple of 64, an lm_head) processed after loading as the loader does,
then applied through the method: batches between ggml's vector kernel and
MAX_TOKENS + 1 take Marlin and give x @ W.T of gguf-py's values, the
others keep gguf.py's kernels (an lm_head's float weight, 0037's, from
MAX_TOKENS + 1); the Marlin operands are what marlin_gemm reads:
ops.gptq_marlin_repack and ops.marlin_gemm stand in on the CPU through
vLLM's Python reference of the layout (support/marlin_ref.py).
Q4_K inputs whose 32-value groups sum past 8,192 stay finite in fp16 (the
min-term columns). Which layers repack (types, dtype, the switches, token
embeddings, fused shards of two types), and a repack in row chunks equal
to one in a piece.
GPU (`-m gpu`): the real kernels through the layer's apply, fp16 and bf16,
1-40 tokens, against fp64 of the same blocks, and fp16 group sums past
8,192; a batch captured in a CUDA graph right after loading, replayed on
new inputs.
"""

from __future__ import annotations

import types

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from support.gguf_layers import gguf_layer
from support.gguf_moe_ref import large_group_sums, random_blocks
from support.marlin_ref import install_for_linears

HIDDEN = 512
# Marlin's integer offset of each type: uint4 (zero point 0), uint4b8, uint8b128
OFFSET = {QType.Q4_K: 0, QType.Q4_0: 8, QType.Q8_0: 128}


def _module():
    from vllm.model_executor.layers.quantization import gguf_marlin_linear

    return gguf_marlin_linear


# ---------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------


class GgufKernels:
    """gguf.py's kernels on the CPU, each the fp64 product of gguf-py's
    values, recording which ran."""

    def __init__(self, values):
        self.values, self.ran = values, []

    def install(self, monkeypatch):
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.quantization import gguf_dispatch

        def kernel(name):
            def run(*args):
                x = args[1] if name in ("vector", "mmq") else args[0]
                self.ran.append((name, x.shape[0]))
                return (x.double() @ self.values.T).to(x.dtype)
            return run

        monkeypatch.setattr(ops, "ggml_mul_mat_vec_a8", kernel("vector"))
        monkeypatch.setattr(ops, "ggml_mul_mat_a8", kernel("mmq"))
        monkeypatch.setattr(gguf_dispatch, "dense_dequant", kernel("float"))
        return self


def _relative_error(out, ref):
    assert torch.isfinite(out).all()
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("qtype,rows,cols", [
    ("Q4_K", [200], HIDDEN),       # rows padded to 256 for Marlin
    ("Q8_0", [6000], HIDDEN),      # > 5,120 rows: the vector kernel up to 2 tokens
    ("Q4_0", [640, 192], HIDDEN),  # a fused q_a + kv_a of one type
    ("Q4_K", [640, 192], HIDDEN),
    ("Q8_0", [128], 160),          # K padded to Marlin's 64
    ("Q4_0", [64], 96),
    ("Q4_K", [64], 768),           # min-term columns: K' 864, padded to 896
    ("Q8_0", [300], 832),          # K' 832: no Marlin configuration for N 320
])
def test_batches_between_the_vector_kernel_and_the_float_path_run_marlin(
        qtype, rows, cols, monkeypatch):
    from vllm.model_executor.layers.quantization.gguf import mmvq_max_tokens

    mod = _module()
    marlin = install_for_linears(monkeypatch, mod)
    g = torch.Generator().manual_seed(sum(rows))
    blocks = [random_blocks(qtype, (r, cols), g) for r in rows]
    layer = gguf_layer([(qtype, raw) for raw, _ in blocks])
    assert layer.gguf_marlin_qweight.dtype == torch.int32
    # the GGUF blocks stay, for the vector kernel and the float path
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape[0] == sum(rows)
    values = torch.cat([v for _, v in blocks])
    kernels = GgufKernels(values).install(monkeypatch)
    vector = mmvq_max_tokens(int(QType[qtype]), sum(rows))
    for tokens in (1, 2, 3, 7, 8, 16, 31, 32, 40):
        marlin.calls.clear()
        kernels.ran.clear()
        x = torch.randn(tokens, cols, generator=g).half()
        out = layer.quant_method.apply(layer, x)
        assert out.shape == (tokens, sum(rows)) and out.dtype == torch.float16
        if vector < tokens <= mod.MAX_TOKENS:
            assert marlin.calls == [tokens] and not kernels.ran, tokens
            err = _relative_error(out, x.double() @ values.T)
            # fp16 group scales (Q4_K's d * sc) and Q4_K's fp16 group sums
            assert err < (2e-3 if qtype == "Q4_K" else 1e-3), (tokens, err)
        else:
            assert not marlin.calls, tokens
            want = "vector" if tokens <= vector else "float"
            assert kernels.ran == [(want, tokens)], tokens


def test_q4_k_group_sums_past_8192_stay_finite(monkeypatch):
    mod = _module()
    marlin = install_for_linears(monkeypatch, mod)
    g = torch.Generator().manual_seed(9)
    raw, values = random_blocks("Q4_K", (200, HIDDEN), g)
    layer = gguf_layer([("Q4_K", raw)])
    x = large_group_sums(8, HIDDEN, g).half()
    out = layer.quant_method.apply(layer, x)
    assert marlin.calls == [8]
    assert _relative_error(out, x.double() @ values.T) < 2e-3


def test_an_lm_head_repacks_its_token_embedding_does_not(monkeypatch):
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    mod = _module()
    install_for_linears(monkeypatch, mod)
    raw, _ = random_blocks("Q8_0", (64, HIDDEN), torch.Generator().manual_seed(1))
    assert hasattr(gguf_layer([("Q8_0", raw)], cls=ParallelLMHead), "gguf_marlin_qweight")
    assert not hasattr(gguf_layer([("Q8_0", raw)], cls=VocabParallelEmbedding),
                       "gguf_marlin_qweight")


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
@pytest.mark.parametrize("measured", [True, False], ids=["sm90", "elsewhere"])
def test_an_lm_heads_marlin_copy_runs_before_its_float_weight(qtype, measured,
                                                              monkeypatch):
    """0037 beside 0036: an lm_head with both copies runs Marlin up to
    MAX_TOKENS and its float weight from MAX_TOKENS + 1, on SM90 too (where
    the float weight alone starts at 8)."""
    from vllm.model_executor.layers.quantization import gguf_dispatch
    from vllm.model_executor.layers.quantization.gguf import mmvq_max_tokens
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    mod = _module()
    marlin = install_for_linears(monkeypatch, mod)
    monkeypatch.delenv("VLLM_GGUF_LM_HEAD_FLOAT", raising=False)
    monkeypatch.setattr(gguf_dispatch, "float_measured_faster", lambda: measured)
    g = torch.Generator().manual_seed(36)
    raw, values = random_blocks(qtype, (192, HIDDEN), g)
    head = gguf_layer([(qtype, raw)], cls=ParallelLMHead, embedding=True)
    assert hasattr(head, "gguf_marlin_qweight") and hasattr(head, "gguf_float_weight")
    assert head.gguf_float_min_tokens == mod.MAX_TOKENS + 1
    kernels = GgufKernels(values).install(monkeypatch)
    vector = mmvq_max_tokens(int(QType[qtype]), 192)
    for tokens in (1, vector + 1, 8, mod.MAX_TOKENS, mod.MAX_TOKENS + 1, 40):
        marlin.calls.clear()
        kernels.ran.clear()
        x = torch.randn(tokens, HIDDEN, generator=g).half()
        out = head.quant_method.apply(head, x)
        on_marlin = vector < tokens <= mod.MAX_TOKENS
        assert marlin.calls == ([tokens] if on_marlin else []), tokens
        # the float weight's GEMM is no kernel of gguf.py's
        assert kernels.ran == ([("vector", tokens)] if tokens <= vector else []), tokens
        err = _relative_error(out, x.double() @ values.T)
        assert err < 2e-3, (tokens, err)


@pytest.mark.parametrize("shards,dtype,env,want", [
    ([("Q4_K", 64)], torch.float16, {}, True),
    ([("Q4_0", 64)], torch.bfloat16, {}, True),
    ([("Q8_0", 64)], torch.float16, {}, True),
    ([("Q6_K", 64)], torch.float16, {}, False),    # no Marlin format (16-value scales)
    ([("Q5_K", 64)], torch.float16, {}, False),
    ([("IQ4_XS", 64)], torch.float16, {}, False),
    ([("F16", 64)], torch.float16, {}, False),
    ([("Q4_K", 64)], torch.float32, {}, False),
    ([("Q4_K", 64), ("Q6_K", 64)], torch.float16, {}, False),  # shards one by one
    ([("Q4_K", 64)], torch.float16, {"VLLM_GGUF_MARLIN_LINEARS": "0"}, False),
    ([("Q4_K", 64)], torch.float16, {"VLLM_GGUF_KERNELS": "ggml"}, False),
    ([("Q4_K", 64)], torch.float16, {"VLLM_GGUF_KERNELS": "upstream"}, False),
])
def test_which_layers_repack(shards, dtype, env, want, monkeypatch):
    mod = _module()
    install_for_linears(monkeypatch, mod)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    g = torch.Generator().manual_seed(5)

    def raw(t, r):
        if t == "F16":
            return torch.randn(r, HIDDEN, generator=g).half()
        return random_blocks(t, (r, HIDDEN), g)[0]

    layer = gguf_layer([(t, raw(t, r)) for t, r in shards], dtype=dtype)
    assert hasattr(layer, "gguf_marlin_qweight") is want


def test_on_by_default_and_off_the_gpu(monkeypatch):
    mod = _module()
    monkeypatch.delenv("VLLM_GGUF_MARLIN_LINEARS", raising=False)
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    assert mod.enabled()
    for off in ("0", "false", "False"):
        monkeypatch.setenv("VLLM_GGUF_MARLIN_LINEARS", off)
        assert not mod.enabled()
    monkeypatch.setenv("VLLM_GGUF_MARLIN_LINEARS", "1")
    assert mod.enabled()
    if not torch.cuda.is_available():
        assert not mod.usable(int(QType.Q4_K), 64, HIDDEN, torch.float16)
    raw, _ = random_blocks("Q4_K", (64, HIDDEN), torch.Generator().manual_seed(2))
    install_for_linears(monkeypatch, mod)
    monkeypatch.setattr(mod, "_on_gpu", lambda qweight: qweight.is_cuda)
    assert not hasattr(gguf_layer([("Q4_K", raw)]), "gguf_marlin_qweight")


def test_an_offloaded_model_gets_no_marlin_copy(monkeypatch):
    """Under vLLM's prefetch offloader (--offload-group-size) a Marlin copy
    made while a layer is on the GPU for loading would stay there: with an
    offloader other than the no-op one, no weight counts as on the GPU."""
    from vllm.model_executor.offloader import base as offloader_base

    mod = _module()
    on_gpu = types.SimpleNamespace(is_cuda=True)
    assert mod._on_gpu(on_gpu)
    assert not mod._on_gpu(types.SimpleNamespace(is_cuda=False))
    monkeypatch.setattr(offloader_base, "_instance", object())
    assert not mod._on_gpu(on_gpu)


@pytest.mark.parametrize("qtype,rows", [("Q4_K", 200), ("Q8_0", 130), ("Q4_0", 64)])
def test_a_repack_in_row_chunks_is_the_repack_in_one(qtype, rows, monkeypatch):
    mod = _module()
    install_for_linears(monkeypatch, mod)
    raw, _ = random_blocks(qtype, (rows, HIDDEN), torch.Generator().manual_seed(rows))
    t = int(QType[qtype])
    monkeypatch.setattr(mod, "REPACK_ROWS", 64)
    w, s = mod.repack(raw, t, HIDDEN, torch.float16)
    padded = torch.nn.functional.pad(raw, (0, 0, 0, mod.padded_rows(rows) - rows))
    w1, s1 = mod.gm.repack_experts(padded.unsqueeze(0), t, HIDDEN, torch.float16)
    assert torch.equal(w, w1[0]) and torch.equal(s, s1[0])


@pytest.mark.parametrize("capability,dtype,compiles", [
    ((9, 0), torch.float16, True), ((9, 0), torch.bfloat16, False),
    ((10, 0), torch.bfloat16, True), ((12, 0), torch.float16, False),
    ((8, 6), torch.bfloat16, False),
], ids=str)
def test_the_dense_kernels_ptx_compile_is_told_by_dtype(capability, dtype, compiles,
                                                        monkeypatch):
    """vLLM 0.23 builds its dense Marlin GEMM with code for SM 8.x and 12.x,
    its bf16 kernels for SM 9.x too."""
    from vllm.model_executor.layers.quantization import gguf_marlin_moe as gm

    ml = _module()
    reported = types.SimpleNamespace(major=capability[0], minor=capability[1])
    monkeypatch.setattr(gm, "current_platform",
                        types.SimpleNamespace(get_device_capability=lambda: reported))
    note = gm.ptx_compile_note("vLLM's dense Marlin kernels", ml.MARLIN_CODE_MAJORS[dtype])
    assert (note is not None) is compiles
    if compiles:
        assert f"no code for SM {capability[0]}.{capability[1]}" in note


def test_marlin_takes_the_tokens_up_to_the_float_path():
    from vllm.model_executor.layers.quantization import gguf_dispatch

    mod = _module()
    assert mod.MAX_TOKENS + 1 == gguf_dispatch.DENSE_DEQUANT_MIN_TOKENS
    q4k = int(QType.Q4_K)
    assert [t for t in range(1, 40) if mod.use_marlin(t, q4k, 5121)] == list(range(3, 32))
    assert [t for t in range(1, 40) if mod.use_marlin(t, q4k, 5120)] == list(range(7, 32))


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype,rows,cols", [
    ("Q4_K", [200], HIDDEN), ("Q8_0", [6000], HIDDEN), ("Q4_0", [640, 192], HIDDEN),
    ("Q8_0", [128], 160), ("Q8_0", [300], 832),
    # GLM-5 TP-8: q_a + kv_a, the lm_head's share of the vocabulary (padded to 128)
    ("Q4_K", [2048, 576], 6144), ("Q8_0", [19360], 6144), ("Q4_K", [19360], 6144),
])
def test_marlin_linear_matches_fp64(qtype, rows, cols, dtype, monkeypatch):
    mod = _module()
    monkeypatch.setenv("VLLM_GGUF_MARLIN_LINEARS", "1")
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    g = torch.Generator().manual_seed(sum(rows))
    blocks = [random_blocks(qtype, (r, cols), g) for r in rows]
    layer = gguf_layer([(qtype, raw) for raw, _ in blocks], device="cuda", dtype=dtype)
    assert hasattr(layer, "gguf_marlin_qweight")
    values = torch.cat([v for _, v in blocks])
    for tokens in (1, 2, 3, 8, 16, 24, 31, 32, 40):
        x = torch.randn(tokens, cols, generator=g).to(dtype)
        out = layer.quant_method.apply(layer, x.cuda())
        err = _relative_error(out.cpu(), x.double() @ values.T)
        on_marlin = mod.use_marlin(tokens, int(QType[qtype]), sum(rows))
        # Marlin: fp16 scales and sums; ggml's kernels round x to 8 bits
        bar = (4e-3 if dtype == torch.float16 else 3e-2) if on_marlin else 3e-2
        assert err < bar, (tokens, err)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [8, 31])
def test_marlin_linear_q4_k_group_sums_past_8192(tokens, monkeypatch):
    mod = _module()
    monkeypatch.delenv("VLLM_GGUF_MARLIN_LINEARS", raising=False)
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    g = torch.Generator().manual_seed(tokens)
    raw, values = random_blocks("Q4_K", (2048, 6144), g)
    layer = gguf_layer([("Q4_K", raw)], device="cuda")
    assert mod.use_marlin(tokens, int(QType.Q4_K), 2048)
    x = large_group_sums(tokens, 6144, g).half()
    out = layer.quant_method.apply(layer, x.cuda())
    assert _relative_error(out.cpu(), x.double() @ values.T) < 4e-3


@pytest.mark.gpu
def test_marlin_linear_in_a_cuda_graph(monkeypatch):
    """Captured right after loading (the repack compiled Q4_K's input kernel)."""
    monkeypatch.setenv("VLLM_GGUF_MARLIN_LINEARS", "1")
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    g = torch.Generator().manual_seed(3)
    raw, values = random_blocks("Q4_K", (200, HIDDEN), g)
    layer = gguf_layer([("Q4_K", raw)], device="cuda")
    x = torch.randn(8, HIDDEN, generator=g).half().cuda()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.quant_method.apply(layer, x)
    for seed in (4, 5):
        x.copy_(torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(seed)).half())
        graph.replay()
        torch.cuda.synchronize()
        assert _relative_error(out.cpu(), x.cpu().double() @ values.T) < 4e-3
