"""IQ3_S tensors load as Q6_K blocks of the same values (gguf_iq3_s):
vLLM 0.23's compiled kernels decode IQ3_S with llama.cpp's pre-2024 grid
(tests/kernels/test_gguf_dequant.py holds that as a strict xfail). gguf-py,
llama.cpp's own Python reader, is the reference: every value of the Q6_K
blocks equals its value of the IQ3_S blocks, bit for bit, in fp32. The
loader's stream carries the new type and bytes, the layer types follow
(gate and up experts that end up of one type stay fused), the warning
names the tensors and the memory, and VLLM_GGUF_KERNELS=upstream leaves
IQ3_S as vLLM 0.23 loads it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from gguf_checks import run_loader, write_gguf
from support.gguf_moe_ref import random_blocks

IQ3_S_BYTES = gguf.GGML_QUANT_SIZES[QType.IQ3_S][1]
Q6_K_BYTES = gguf.GGML_QUANT_SIZES[QType.Q6_K][1]


def random_iq3_s(rng: np.random.Generator, *lead: int, blocks: int) -> np.ndarray:
    """Fresh random IQ3_S rows [*lead, blocks * 110] (support.gguf_moe_ref's
    random blocks), some block scales d zero or subnormal, some negative."""
    seed = int(rng.integers(2**31))
    raw, _ = random_blocks("IQ3_S", (*lead, blocks * 256), torch.Generator().manual_seed(seed))
    raw = raw.numpy().reshape(*lead, blocks, IQ3_S_BYTES).copy()
    d = raw[..., :2].copy().view(np.float16).reshape(-1)
    d[1::3] = -d[1::3]
    d[1::7] = 0.0
    d[3::11] = np.float16(3e-7)  # subnormal
    raw[..., :2] = d.view(np.uint8).reshape(*lead, blocks, 2)
    return raw.reshape(*lead, blocks * IQ3_S_BYTES)


def values(qtype: QType, rows: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(rows, qtype)


@pytest.mark.parametrize("chunk", [None, 4], ids=["one-chunk", "chunks-of-4-blocks"])
@pytest.mark.parametrize("lead", [(1,), (5,), (3, 4)], ids=["row", "rows", "experts"])
@pytest.mark.parametrize("blocks", [1, 3])
def test_iq3_s_blocks_become_q6_k_blocks_of_the_same_values(monkeypatch, lead, blocks, chunk):
    from vllm.model_executor.model_loader import gguf_iq3_s
    from vllm.model_executor.model_loader.gguf_iq3_s import iq3_s_to_q6_k

    if chunk:  # the conversion goes a chunk of blocks at a time
        monkeypatch.setattr(gguf_iq3_s, "_CHUNK", chunk)

    rng = np.random.default_rng(hash((lead, blocks)) % 2**32)
    rows = random_iq3_s(rng, *lead, blocks=blocks)
    q6_k = iq3_s_to_q6_k(torch.from_numpy(rows), device=torch.device("cpu"))
    assert q6_k.dtype == torch.uint8
    assert tuple(q6_k.shape) == (*lead, blocks * Q6_K_BYTES)
    want, got = values(QType.IQ3_S, rows), values(QType.Q6_K, q6_k.numpy())
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    # bit for bit, signed zeros included
    assert np.array_equal(want.view(np.uint32), got.view(np.uint32))


def test_every_level_sign_and_scale_of_the_grid():
    """Blocks that hold all 512 grid entries, both signs and all 16 scale
    nibbles, so that no level or scale is left out."""
    from vllm.model_executor.model_loader.gguf_iq3_s import iq3_s_to_q6_k

    n = 512 * 16 // 64  # 64 grid entries a block
    blocks = np.zeros((n, IQ3_S_BYTES), np.uint8)
    index = np.arange(n * 64) % 512
    blocks[:, :2] = np.full(n, 0.375, np.float16).view(np.uint8).reshape(n, 2)
    blocks[:, 2:66] = (index & 0xFF).reshape(n, 64)
    high = (index >> 8).reshape(n, 8, 8)
    blocks[:, 66:74] = (high << np.arange(8)).sum(-1)
    blocks[:, 74:106] = np.where(np.arange(n)[:, None] % 2, 0xA5, 0x5A)
    nibble = (np.arange(n) // 2) % 16
    blocks[:, 106:110] = (nibble | (((nibble + 5) % 16) << 4))[:, None]
    q6_k = iq3_s_to_q6_k(torch.from_numpy(blocks), device=torch.device("cpu")).numpy()
    want, got = values(QType.IQ3_S, blocks), values(QType.Q6_K, q6_k)
    assert np.array_equal(want, got)
    levels = np.unique(np.abs(want) / 0.375)
    # levels 1..15 times scales 1..31, all odd
    assert levels.min() == 1 and levels.max() == 15 * 31


def test_a_non_finite_block_scale_stays_non_finite():
    from vllm.model_executor.model_loader.gguf_iq3_s import iq3_s_to_q6_k

    rows = random_iq3_s(np.random.default_rng(3), 2, blocks=2)
    rows[0, :2] = np.array([np.nan], np.float16).view(np.uint8)
    rows[1, IQ3_S_BYTES : IQ3_S_BYTES + 2] = np.array([np.inf], np.float16).view(np.uint8)
    got = values(QType.Q6_K, iq3_s_to_q6_k(torch.from_numpy(rows)).numpy())
    want = values(QType.IQ3_S, rows)
    assert np.isnan(got[0, :256]).all() and np.isfinite(got[0, 256:]).all()
    assert np.array_equal(np.isinf(got), np.isinf(want))
    assert np.array_equal(want, got, equal_nan=True)


@pytest.mark.parametrize("bad", [torch.zeros(2, 109, dtype=torch.uint8),
                                 torch.zeros(2, 110, dtype=torch.int8)],
                         ids=["partial-block", "not-bytes"])
def test_rows_that_are_not_iq3_s_blocks_are_refused(bad):
    from vllm.model_executor.model_loader.gguf_iq3_s import iq3_s_to_q6_k

    with pytest.raises(ValueError, match=r"IQ3_S: rows of whole 110-byte blocks"):
        iq3_s_to_q6_k(bad)


def test_the_stream_retypes_iq3_s_tensors_only(monkeypatch):
    """Types come first in the loader's stream; names keep the loader's
    renaming of every "weight" (weights_proj too)."""
    from vllm.model_executor.model_loader.gguf_iq3_s import iq3_s_as_q6_k

    rows = torch.from_numpy(random_iq3_s(np.random.default_rng(4), 2, blocks=1))
    other = torch.ones(2, 34, dtype=torch.uint8)
    stream = [
        ("a.qweights_proj.qweight_type", torch.tensor(int(QType.IQ3_S))),
        ("b.qweight_type", torch.tensor(int(QType.Q8_0))),
        ("a.qweights_proj.qweight", rows),
        ("b.qweight", other),
        ("c.weight", torch.ones(3)),
    ]
    out = dict(iq3_s_as_q6_k(iter(stream)))
    assert int(out["a.qweights_proj.qweight_type"]) == QType.Q6_K
    assert int(out["b.qweight_type"]) == QType.Q8_0
    assert out["b.qweight"] is other and out["c.weight"] is stream[4][1]
    assert np.array_equal(values(QType.Q6_K, out["a.qweights_proj.qweight"].numpy()),
                          values(QType.IQ3_S, rows.numpy()))
    # a tensor the caller keeps (float-only layers, which gguf-py dequantizes)
    kept = dict(iq3_s_as_q6_k(iter(stream), keep={"a.qweights_proj.qweight_type"}))
    assert int(kept["a.qweights_proj.qweight_type"]) == QType.IQ3_S
    assert kept["a.qweights_proj.qweight"] is rows


# what llama.cpp's IQ2/IQ3 mixtures put in IQ3_S, in the test model: routed
# and shared experts, attention, the indexer, the embedding and the head
IQ3_S_TENSORS = ("blk.1.ffn_gate_exps.weight",
                 "blk.1.ffn_up_shexp.weight", "blk.1.attn_q_a.weight",
                 "blk.1.indexer.attn_k.weight", "token_embd.weight", "output.weight")


def iq3_s_file(path, reader, names, retype=None):
    rng = np.random.default_rng(5)
    blocks = {}
    for tensor in reader.tensors:
        if tensor.name in names:
            shape = [int(d) for d in reversed(tensor.shape)]
            assert shape[-1] % 256 == 0, tensor.name
            blocks[tensor.name] = (QType.IQ3_S,
                                   random_iq3_s(rng, *shape[:-1], blocks=shape[-1] // 256))
    assert set(blocks) == set(names)
    return write_gguf(path, reader, blocks=blocks, retype=retype), blocks


@pytest.mark.parametrize("kernels", ["series", "upstream"])
def test_an_iq3_s_file_loads_as_q6_k_value_for_value(tmp_path, monkeypatch, glm_q8_0,
                                                     glm_config, kernels):
    monkeypatch.setenv("VLLM_GGUF_KERNELS", kernels)
    path, blocks = iq3_s_file(tmp_path / "iq3_s.gguf", glm_q8_0, IQ3_S_TENSORS,
                              retype={"blk.1.ffn_up_exps.weight": QType.Q6_K})
    loaded = run_loader(path, glm_config())
    for gguf_name, (_, rows) in blocks.items():
        name = loaded.name_map[gguf_name]
        tensor = loaded.tensors[name].numpy()
        if name not in loaded.qtypes:  # float-only: gguf-py dequantizes the IQ3_S blocks
            assert np.array_equal(tensor, values(QType.IQ3_S, rows)), name
            continue
        if kernels == "upstream":  # vLLM 0.23's load: the file's bytes
            assert QType(loaded.qtypes[name]) == QType.IQ3_S, name
            assert loaded.weight_types[name] == "IQ3_S", name
            assert np.array_equal(tensor, rows), name
            continue
        assert QType(loaded.qtypes[name]) == QType.Q6_K, name
        assert loaded.weight_types[name] == "Q6_K", name
        assert tensor.shape == (*rows.shape[:-1], rows.shape[-1] // 110 * 210), name
        assert np.array_equal(values(QType.Q6_K, tensor), values(QType.IQ3_S, rows)), name
    from vllm.model_executor.model_loader.gguf_dsa import mla_gguf_split_gate_up

    # gate IQ3_S and up Q6_K: one type once loaded, so one fused w13
    split = mla_gguf_split_gate_up(loaded.weight_types)
    assert split == ([] if kernels == "series" else ["model.layers.1.mlp.experts"])


def test_iq3_s_gate_with_another_up_type_still_runs_split(tmp_path, glm_q8_0, glm_config):
    from vllm.model_executor.model_loader.gguf_dsa import mla_gguf_split_gate_up

    path, _ = iq3_s_file(tmp_path / "mixed.gguf", glm_q8_0, ("blk.1.ffn_gate_exps.weight",),
                         retype={"blk.1.ffn_up_exps.weight": QType.IQ3_XXS})
    loaded = run_loader(path, glm_config())
    assert mla_gguf_split_gate_up(loaded.weight_types) == ["model.layers.1.mlp.experts"]


@pytest.mark.gpu
def test_the_compiled_kernels_read_the_q6_k_blocks_as_llama_cpp_reads_iq3_s(monkeypatch):
    """On the GPU, where the loader converts: vLLM's compiled ggml_dequantize
    of the Q6_K blocks gives gguf-py's IQ3_S values rounded to fp16, exactly
    (it multiplies the block scale in half precision, as for every Q6_K
    tensor; its IQ3_S decoding does not give them:
    tests/kernels/test_gguf_dispatch.py), and its vector kernel (int8
    activations) stays within 3e-2 of fp64 on those values."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.model_loader import gguf_iq3_s
    from vllm.model_executor.model_loader.gguf_iq3_s import iq3_s_to_q6_k

    rows, cols = 64, 1024
    raw = random_iq3_s(np.random.default_rng(6), rows, blocks=cols // 256)
    want = torch.from_numpy(values(QType.IQ3_S, raw))
    # as the loader calls it: CPU tensors, converted on the GPU, a chunk at a time
    monkeypatch.setattr(gguf_iq3_s, "_CHUNK", 7)
    on_cpu = iq3_s_to_q6_k(torch.from_numpy(raw))
    assert on_cpu.device.type == "cpu"
    assert np.array_equal(values(QType.Q6_K, on_cpu.numpy()), want.numpy())
    q6_k = iq3_s_to_q6_k(torch.from_numpy(raw).cuda())
    assert q6_k.is_cuda and q6_k.dtype == torch.uint8
    assert torch.equal(q6_k.cpu(), on_cpu)
    out = ops.ggml_dequantize(q6_k, int(QType.Q6_K), rows, cols, torch.float32)
    assert torch.equal(out.cpu(), want.half().float())
    x = torch.randn(1, cols, dtype=torch.float16, device="cuda")
    y = ops.ggml_mul_mat_vec_a8(q6_k, x, int(QType.Q6_K), rows)
    ref = x.double().cpu() @ want.double().T
    assert torch.isfinite(y).all()
    err = (y.double().cpu() - ref).abs().max().item()
    assert err <= 3e-2 * ref.abs().max().item(), err
