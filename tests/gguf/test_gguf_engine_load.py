"""GGUF files written by llama.cpp's converter load into the model vLLM
builds for them, through the real loader (GGUFModelLoader.load_model):
the quant method each layer gets, fused layers laid out the way their
forward splits them, GLM-5.2's shared indexers (patches 0008-0010), routed
gate and up experts of different types kept apart (0020), tensor-parallel
ranks holding their part of each weight, read from the file's map (0033).

No GPU here: the platform stands in as CUDA SM 12.0 with tensors on the
CPU (support/gguf_engine_load.py). Layers look their kernels up when they
are built; loading runs none of them.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from gguf_checks import SMALL_GGUF_TOKENS, q8_0_bound, write_small_gguf
from support.gguf_engine_load import engine_loader, load_ranks


@pytest.fixture(scope="module")
def load_model(monkeypatch_module):
    """(GGUF path, HF checkpoint dir) -> the model vLLM builds and loads."""
    with engine_loader(monkeypatch_module) as load:
        yield load


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _layers(model):
    return model.model.layers


@pytest.mark.parametrize("name, variant", [("glm", "f16"), ("dsv3", "f32-legacy")])
def test_float_experts_load_unquantized(
    checkpoints, gguf_files, load_model, name, variant
):
    """#15.1: float GGUF experts (F16/BF16/F32) need the unquantized MoE
    method; GGUFMoEMethod has only *_qweight parameters (KeyError)."""
    from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod

    checkpoint = checkpoints[name]
    model = load_model(gguf_files[(name, variant)], checkpoint.path)
    state = load_file(checkpoint.path / "model.safetensors")
    moe_layers = 0
    for i, layer in enumerate(_layers(model)):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        moe_layers += 1
        assert isinstance(experts.quant_method, UnquantizedFusedMoEMethod)
        prefix = f"model.layers.{i}.mlp.experts"
        for e in range(experts.w13_weight.shape[0]):
            w13 = torch.cat(
                [
                    state[f"{prefix}.{e}.gate_proj.weight"],
                    state[f"{prefix}.{e}.up_proj.weight"],
                ]
            )
            w2 = state[f"{prefix}.{e}.down_proj.weight"]
            assert torch.equal(experts.w13_weight[e], w13.half()), (prefix, e)
            assert torch.equal(experts.w2_weight[e], w2.half()), (prefix, e)
    assert moe_layers == checkpoint.num_hidden_layers - 1  # first layer dense


def _q8_0_dequant(data: torch.Tensor, qtype: int) -> torch.Tensor:
    import gguf

    return torch.from_numpy(
        gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType(qtype))
    )


def _cpu_mul_mat(x: torch.Tensor, qweight: torch.Tensor, qweight_type: int):
    """GGUF matmul on the CPU: dequantize with gguf-py, then multiply."""
    weight = _q8_0_dequant(qweight, qweight_type).to(x.dtype)
    return x @ weight.T


class CpuMulMat:
    """_cpu_mul_mat, recording each call's (weight rows, type)."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    def __call__(self, x, qweight, qweight_type):
        self.calls.append((qweight.shape[0], qweight_type))
        return _cpu_mul_mat(x, qweight, qweight_type)


def test_the_lm_head_keeps_its_float_weight(checkpoints, gguf_files, load_model):
    """0037: the real loader's quantized lm_head keeps its weight dequantized
    (the file's values in the model's dtype) for the float path's batches;
    the token embedding keeps its GGUF blocks alone."""
    from vllm.model_executor.layers.quantization import gguf_dispatch

    model = load_model(gguf_files[("glm", "q8_0")], checkpoints["glm"].path)
    head = model.lm_head
    kept = head.gguf_float_weight
    values = _q8_0_dequant(head.qweight.data, head.qweight_type.weight_type)
    assert kept.shape == values.shape and torch.isfinite(kept).all()
    assert torch.equal(kept, values.to(kept.dtype))
    assert head.gguf_float_min_tokens == gguf_dispatch.lm_head_float_min_tokens()
    assert not hasattr(model.model.embed_tokens, "gguf_float_weight")


def test_marlin_linears_are_added_at_load(
    checkpoints, gguf_files, load_model, monkeypatch
):
    """VLLM_GGUF_MARLIN_LINEARS (0036, on by default): the real loader gives every Q8_0
    linear of the file a Marlin copy beside its GGUF blocks (the fused
    q_a + kv_a as one weight, the lm_head too, rows padded to 64 where
    short), the token embedding none; the lm_head's product at a decode
    batch is that of the file's values. Marlin's ops on the CPU
    (support/marlin_ref.py)."""
    from vllm.model_executor.layers.quantization import gguf_marlin_linear

    from support.marlin_ref import install_for_linears

    marlin = install_for_linears(monkeypatch, gguf_marlin_linear)
    model = load_model(gguf_files[("glm", "q8_0")], checkpoints["glm"].path)
    attn = _layers(model)[0].self_attn
    for layer in (attn.fused_qkv_a_proj, attn.q_b_proj, attn.o_proj, model.lm_head):
        assert layer.qweight.dtype == torch.uint8, layer
        assert layer.gguf_marlin_qweight.dtype == torch.int32, layer
        padded = gguf_marlin_linear.padded_rows(layer.qweight.shape[0])
        assert layer.gguf_marlin_scales.shape[1] == padded, layer
    assert not hasattr(model.model.embed_tokens, "gguf_marlin_qweight")
    head = model.lm_head
    hidden = head.qweight.shape[1] // 34 * 32  # Q8_0: 34 bytes a block of 32
    dtype = head.gguf_marlin_scales.dtype  # the model's
    x = torch.randn(8, hidden, generator=torch.Generator().manual_seed(8)).to(dtype)
    out = head.quant_method.apply(head, x)
    assert marlin.calls == [8] and out.dtype == dtype
    values = _q8_0_dequant(head.qweight.data, head.qweight_type.weight_type).double()
    want = x.double() @ values.T
    assert torch.isfinite(out).all()
    # the output's rounding to the model's dtype
    bar = 2e-3 if dtype == torch.float16 else 1e-2
    assert (out.double() - want).abs().max() / want.abs().max() < bar


@pytest.mark.parametrize("name", ["glm", "dsv3", "glm52"])
def test_fused_qkv_a_follows_declared_shard_order(
    checkpoints, gguf_files, load_model, monkeypatch, name
):
    """#15.2: llama.cpp stores attn_kv_a_mqa before attn_q_a; the fused
    q_a/kv_a layer must still hold and compute [q_a | kv_a], the order
    DeepSeek-V2's MLA forward splits."""
    from vllm.model_executor.layers.quantization import gguf as gguf_quant

    checkpoint = checkpoints[name]
    path = gguf_files[(name, "q8_0")]
    model = load_model(path, checkpoint.path)
    state = load_file(checkpoint.path / "model.safetensors")
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    for i, layer in enumerate(_layers(model)):
        mul_mat = CpuMulMat()
        monkeypatch.setattr(gguf_quant, "fused_mul_mat_gguf", mul_mat)
        fused = layer.self_attn.fused_qkv_a_proj
        prefix = f"model.layers.{i}.self_attn."
        refs = [
            state[prefix + "q_a_proj.weight"],
            state[prefix + "kv_a_proj_with_mqa.weight"],
        ]
        qweight = fused.qweight
        assert list(qweight.shard_id) == [0, 1], f"{prefix}: {qweight.shard_id}"
        start = 0
        for shard, ref in enumerate(refs):
            begin, end, width = qweight.shard_offset_map[shard]
            assert (begin, end) == (start, start + ref.shape[0]), (prefix, shard)
            qtype = fused.qweight_type.shard_weight_type[shard]
            got = _q8_0_dequant(qweight[begin:end, :width].contiguous(), qtype)
            err = (got.double() - ref.double()).abs()
            assert (err <= q8_0_bound(ref)).all(), f"{prefix} shard {shard}"
            start = end
        # What the layer computes: [q_a | kv_a] of the input, the two Q8_0
        # shards as one weight (0035).
        out = fused.quant_method.apply(fused, x)
        want = x @ torch.cat(refs).T
        rel = ((out - want).norm() / want.norm()).item()
        assert rel < 2e-2, f"{prefix}: relative error {rel}"
        assert mul_mat.calls == [(qweight.shape[0], qtype)], prefix


@pytest.mark.parametrize("kernels", ["series", "upstream"])
def test_fused_shards_run_as_one_weight_where_they_share_a_type(
    checkpoints, gguf_files, load_model, monkeypatch, tmp_path, kernels
):
    """0035: a fused linear whose shards share a GGUF type (q_a + kv_a,
    gate + up) runs as one weight, one kernel; shards of different types
    run one by one, as does vLLM 0.23's choice (VLLM_GGUF_KERNELS=upstream,
    the benchmark's peer). Both compute [q_a | kv_a] of the file's values.
    Layer 0's attn_q_a here is Q4_K (random blocks), its attn_kv_a_mqa Q8_0;
    layer 1 keeps the converter's Q8_0 for both."""
    import gguf
    from gguf import GGMLQuantizationType as QType
    from vllm.model_executor.layers.quantization import gguf as gguf_quant

    from gguf_checks import write_gguf
    from support.gguf_moe_ref import random_blocks

    monkeypatch.setenv("VLLM_GGUF_KERNELS", kernels)
    checkpoint = checkpoints["glm"]
    src = gguf.GGUFReader(gguf_files[("glm", "q8_0")])
    file_data = {t.name: t for t in src.tensors}
    g = torch.Generator().manual_seed(35)
    q_a = file_data["blk.0.attn_q_a.weight"]
    rows, cols = (int(d) for d in reversed(q_a.shape.tolist()))
    q_a_raw, q_a_values = random_blocks("Q4_K", (rows, cols), g)
    path = write_gguf(
        tmp_path / "mixed.gguf", src,
        blocks={"blk.0.attn_q_a.weight": (QType.Q4_K, q_a_raw.numpy())},
    )
    model = load_model(path, checkpoint.path)
    x = torch.randn(3, cols, generator=g)
    for i, types in ((0, [QType.Q4_K, QType.Q8_0]), (1, [QType.Q8_0, QType.Q8_0])):
        fused = _layers(model)[i].self_attn.fused_qkv_a_proj
        shard_types = fused.qweight_type.shard_weight_type
        assert [shard_types[s] for s in fused.qweight.shard_id] == types, i
        mul_mat = CpuMulMat()
        monkeypatch.setattr(gguf_quant, "fused_mul_mat_gguf", mul_mat)
        out = fused.quant_method.apply(fused, x)
        kv_a = file_data[f"blk.{i}.attn_kv_a_mqa.weight"]
        kv_a = _q8_0_dequant(torch.from_numpy(kv_a.data.copy()), kv_a.tensor_type)
        if i == 0:
            q_a_ref = q_a_values
        else:
            q_a_file = file_data["blk.1.attn_q_a.weight"]
            q_a_ref = _q8_0_dequant(
                torch.from_numpy(q_a_file.data.copy()), q_a_file.tensor_type
            )
        want = x.double() @ torch.cat([q_a_ref.double(), kv_a.double()]).T
        assert torch.isfinite(out).all(), i
        err = (out.double() - want).abs().max() / want.abs().max()
        assert err < 1e-5, f"layer {i}: max |err| {err:.3g} of max |ref|"
        one_weight = kernels == "series" and types[0] == types[1]
        if one_weight:
            assert mul_mat.calls == [(rows + kv_a.shape[0], types[0])], i
        else:
            assert mul_mat.calls == [(rows, types[0]), (kv_a.shape[0], types[1])], i


def test_gate_and_up_experts_of_different_types_run_split(
    checkpoints, gguf_files, load_model, monkeypatch, tmp_path
):
    """#23: llama.cpp's quantizer gives a layer's gate and up experts types
    of their own. Layer 1 with gate Q4_K, up Q6_K (random blocks) and down
    Q8_0 (converted) gets GGUFSplitMoEMethod: each half in its parameter
    with its type, the file's bytes, and the layer computes SiLU(gate) * up
    -> down of the file's values; layer 2 (Q8_0 alike) keeps the fused
    GGUFMoEMethod as before."""
    import gguf
    from gguf import GGMLQuantizationType as QType
    from vllm.model_executor.layers.quantization import gguf_split_moe
    from vllm.model_executor.layers.quantization.gguf import GGUFMoEMethod

    from gguf_checks import write_gguf
    from support.gguf_moe_ref import CpuGgufMoeOps, dequantize, moe_reference, random_blocks

    checkpoint = checkpoints["glm"]
    src = gguf.GGUFReader(gguf_files[("glm", "q8_0")])
    g = torch.Generator().manual_seed(23)
    experts, inter, hidden = 4, 64, 256
    gate_raw, gate = random_blocks("Q4_K", (experts, inter, hidden), g)
    up_raw, up = random_blocks("Q6_K", (experts, inter, hidden), g)
    path = write_gguf(
        tmp_path / "split.gguf",
        src,
        blocks={
            "blk.1.ffn_gate_exps.weight": (QType.Q4_K, gate_raw.numpy()),
            "blk.1.ffn_up_exps.weight": (QType.Q6_K, up_raw.numpy()),
        },
    )
    file_data = {t.name: torch.from_numpy(t.data.copy()) for t in src.tensors}
    model = load_model(path, checkpoint.path)

    layer = _layers(model)[1].mlp.experts
    assert type(layer.quant_method) is gguf_split_moe.GGUFSplitMoEMethod
    for half, raw, qtype in (("w1", gate_raw, QType.Q4_K), ("w3", up_raw, QType.Q6_K)):
        qweight = getattr(layer, f"{half}_qweight")
        assert qweight.dtype == torch.uint8 and torch.equal(qweight, raw), half
        assert getattr(layer, f"{half}_qweight_type").weight_type == qtype, half
    down_raw = file_data["blk.1.ffn_down_exps.weight"]
    assert torch.equal(layer.w2_qweight, down_raw)
    assert layer.w2_qweight_type.weight_type == QType.Q8_0
    assert layer.w13_qweight.numel() == 0  # receives both halves, holds none

    fused = _layers(model)[2].mlp.experts
    assert type(fused.quant_method) is GGUFMoEMethod
    w13 = torch.cat(
        [file_data["blk.2.ffn_gate_exps.weight"], file_data["blk.2.ffn_up_exps.weight"]],
        dim=1,
    )
    assert torch.equal(fused.w13_qweight, w13)
    assert fused.w13_qweight_type.weight_type == QType.Q8_0

    # What the layer computes, its GEMMs on CPU stand-ins of the CUDA ops.
    kernels = CpuGgufMoeOps().install(monkeypatch)
    monkeypatch.setattr(
        gguf_split_moe, "fused_moe_gguf_split", gguf_split_moe._fused_moe_gguf_split
    )
    x = torch.randn(5, hidden, generator=g).half()
    topk_ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(5)])
    topk_weights = torch.rand(5, 2, generator=g) + 0.1
    out = layer.quant_method.apply(layer, x, topk_weights, topk_ids.int(), None, None)
    assert kernels.calls == [("vec", "Q4_K"), ("vec", "Q6_K"), ("vec", "Q8_0")]
    ref = moe_reference(x, gate, up, dequantize(down_raw, "Q8_0"), topk_weights, topk_ids)
    assert not torch.isnan(out).any()
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < 4e-3, f"max |err| {err:.3g} of max |ref|"


def test_glm52_shared_layers_reuse_the_previous_topk(
    checkpoints, gguf_files, load_model
):
    """#15.3: GLM-5.2's indexer_types marks layers "shared": no indexer
    tensors in the GGUF, the layer skips the top-k and reuses the buffer
    of the previous full layer. 0034: a shared layer builds no indexer
    (no weights, no K cache in the KV cache), only the shared buffer."""
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache, Indexer

    from gguf_checks import GLM52_INDEXER_TYPES

    checkpoint = checkpoints["glm52"]
    model = load_model(gguf_files[("glm52", "f16")], checkpoint.path)
    state = load_file(checkpoint.path / "model.safetensors")
    buffers = set()
    for i, (layer, kind) in enumerate(
        zip(_layers(model), GLM52_INDEXER_TYPES, strict=True)
    ):
        mla = layer.self_attn.mla_attn
        assert mla.skip_topk == (kind == "shared"), (i, kind)
        assert isinstance(mla.indexer, Indexer) == (kind == "full"), (i, kind)
        assert mla.topk_tokens == 16, i
        buffers.add(mla.indexer.topk_indices_buffer.data_ptr())
        if kind == "full":
            ref = state[f"model.layers.{i}.self_attn.indexer.wq_b.weight"]
            got = layer.self_attn.indexer.wq_b.weight
            assert torch.equal(got, ref.half()), i
        else:
            assert not [n for n, _ in layer.named_parameters() if ".indexer." in n], i
            with pytest.raises(RuntimeError, match="reuses the previous layer's top-k"):
                mla.indexer()
    assert len(buffers) == 1
    # MTP layers (past the model's layers) keep an indexer: the drafter
    # switches their skip on and off
    from vllm.model_executor.models.dsa_shared_topk import reuses_previous_topk

    assert reuses_previous_topk(True, 4, 5) and not reuses_previous_topk(True, 5, 5)
    assert not reuses_previous_topk(False, 2, 5)
    caches = [m.prefix for m in model.modules() if isinstance(m, DeepseekV32IndexerCache)]
    full = [i for i, kind in enumerate(GLM52_INDEXER_TYPES) if kind == "full"]
    assert caches == [f"model.layers.{i}.self_attn.indexer.k_cache" for i in full]

    # the KV cache vLLM lays out for these layers: one group, a tensor for
    # every MLA layer and every full layer's indexer, a token's bytes those
    # of 5 MLA caches (fp16: 576 x 2 B) and 3 indexer caches (128 + 4 B)
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )

    vllm_config = next(m for m in model.modules() if isinstance(m, Indexer)).vllm_config
    with set_current_vllm_config(vllm_config):
        specs = {name: m.get_kv_cache_spec(vllm_config) for name, m in model.named_modules()
                 if isinstance(m, AttentionLayerBase)}
        (group,) = get_kv_cache_groups(vllm_config, specs)
        config = get_kv_cache_config_from_groups(vllm_config, [group], 1 << 30)
    assert group.kv_cache_spec.page_size_bytes == group.kv_cache_spec.block_size * (
        len(GLM52_INDEXER_TYPES) * 1152 + len(full) * 132)
    assert sorted(name for t in config.kv_cache_tensors for name in t.shared_by) == sorted(specs)
    assert len(specs) == len(GLM52_INDEXER_TYPES) + len(full)

    # a checkpoint that carries a shared layer's indexer weights anyway (other
    # IndexCache models may): skipped, the full layers' loaded as before
    shared = GLM52_INDEXER_TYPES.index("shared")
    extra = {f"model.layers.{shared}.self_attn.indexer.{w}": torch.zeros(s)
             for w, s in (("wk.weight", (128, 256)), ("k_norm.weight", (128,)))}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert model.load_weights(extra.items()) == set()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "name, key, neox",
    [("glm", None, False), ("glm", False, True), ("dsv32", None, True)],
)
def test_indexer_rope_style_of_the_built_model(
    checkpoints, gguf_files, load_model, tmp_path, name, key, neox
):
    """GLM-5's indexer rotates interleaved pairs even when its config lacks
    indexer_rope_interleave (transformers' GlmMoeDsaConfig saves none); an
    explicit key wins; DeepSeek-V3.2 stays NeoX (test_glm_dsa_defaults.py)."""
    import json
    import shutil

    hf_dir = checkpoints[name].path
    config = json.loads((hf_dir / "config.json").read_text())
    assert "indexer_rope_interleave" not in config
    if key is not None:
        hf_dir = tmp_path / name
        shutil.copytree(checkpoints[name].path, hf_dir)
        config["indexer_rope_interleave"] = key
        (hf_dir / "config.json").write_text(json.dumps(config))
    model = load_model(gguf_files[(name, "f16")], hf_dir)
    for i, layer in enumerate(_layers(model)):
        attn = layer.self_attn
        assert attn.indexer_rope_emb.is_neox_style is neox, i
        assert attn.rotary_emb.is_neox_style is False, i  # MLA's own RoPE


@pytest.mark.parametrize(
    "name, variant", [("glm", "f16"), ("glm", "q8_0"), ("glm52", "f16")]
)
def test_mtp_draft_loads_the_nextn_block(
    checkpoints, gguf_files, load_model, name, variant
):
    """MTP speculative decoding: the proposer asks the loader for the draft's
    model config while the VllmConfig is the target's. The GGUF loader built
    the target's model class from the VllmConfig instead, so the engine
    stopped with "Duplicate layer name: model.layers.0...." (found on the
    GPU). The draft must be DeepSeek's MTP model holding the NextN block,
    with the file's embedding and output head (float files: as stored;
    quantized ones: the head stays quantized, the block's embedding, built
    without quant_config, dequantized)."""
    checkpoint = checkpoints[name]
    model = load_model(gguf_files[(name, variant)], checkpoint.path, mtp=True)
    state = load_file(checkpoint.path / "model.safetensors")
    assert type(model).__name__ == "DeepSeekMTP"
    mtp = checkpoint.num_hidden_layers
    layers = model.model.layers
    assert list(layers) == [str(mtp)], list(layers)
    layer = layers[str(mtp)]
    expected = {
        "eh_proj.weight": state[f"model.layers.{mtp}.eh_proj.weight"],
        "enorm.weight": state[f"model.layers.{mtp}.enorm.weight"],
        "hnorm.weight": state[f"model.layers.{mtp}.hnorm.weight"],
        # the checkpoint's block has no copies: the file's shared tensors
        "embed": state["model.embed_tokens.weight"],
        "head": state["lm_head.weight"],
    }
    got = {
        "eh_proj.weight": layer.eh_proj.weight,
        "enorm.weight": layer.enorm.weight,
        "hnorm.weight": layer.hnorm.weight,
        "embed": model.model.embed_tokens.weight,
    }
    head = layer.shared_head.head
    if variant == "f16":
        got["head"] = head.weight
    else:
        qweight, qtype = head.qweight, int(head.qweight_type)
        got["head"] = _q8_0_dequant(qweight.data.contiguous(), qtype)
    for key, ref in expected.items():
        value = got[key].float()
        assert value.shape == ref.shape, key
        if variant == "f16" or key.endswith("norm.weight"):
            assert torch.equal(value, ref.half().float()), key
        else:
            # Q8_0, then fp16 where the block holds float weights
            err = (value.double() - ref.double()).abs()
            assert (err <= q8_0_bound(ref) + ref.double().abs() * 2.0**-11).all(), key


@pytest.mark.parametrize("variant", ["f16", "f16-split"])
def test_a_load_reads_each_file_header_once(
    checkpoints, gguf_files, load_model, monkeypatch, tmp_path, variant
):
    """gguf.GGUFReader parses all metadata on open: GLM-5's tokenizer arrays
    take seconds a parse, and a load used to open its file six times (the
    largest part of a real file's load). Within load_model each file (each
    shard of a split set) opens once; outside it, every call opens anew."""
    import gguf
    from vllm.model_executor.model_loader import gguf_readers

    opened = []
    parse = gguf.GGUFReader.__init__

    def counting_parse(self, path, *args, **kwargs):
        opened.append(str(path))
        parse(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting_parse)
    path = gguf_files[("glm", variant)]
    files = [path]
    if variant.endswith("split"):
        files = sorted(path.parent.glob(path.name.replace("-00001-of-", "-*-of-")))
        assert len(files) > 1, files
    load_model(path, checkpoints["glm"].path)
    assert sorted(opened) == [str(f) for f in files]

    # a weight reload (load_weights alone) reads each file once more, and
    # the same weights
    loaded = load_model(path, checkpoints["glm"].path).state_dict()
    opened.clear()
    reloaded = load_model(path, checkpoints["glm"].path, reload=True).state_dict()
    assert sorted(opened) == sorted(2 * [str(f) for f in files])
    assert loaded.keys() == reloaded.keys()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, reloaded[name]), name

    opened.clear()
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(path, copy)
    assert gguf_readers.reader(copy) is not gguf_readers.reader(copy)
    with gguf_readers.shared_readers():
        shared = gguf_readers.reader(copy)
        assert gguf_readers.reader(str(copy)) is shared
        # a file changed since it was opened is read again
        mtime = copy.stat().st_mtime_ns
        os.utime(copy, ns=(mtime, mtime + 1))
        assert gguf_readers.reader(copy) is not shared
    assert len(opened) == 4


def _read_alike(ours, theirs) -> None:
    assert list(ours.fields) == list(theirs.fields)
    for key, a in theirs.fields.items():
        b = ours.fields[key]
        assert (b.offset, b.name, b.data, b.types) == (a.offset, a.name, a.data, a.types), key
        assert [(p.dtype, p.tobytes()) for p in b.parts] == [
            (p.dtype, p.tobytes()) for p in a.parts
        ], key
        assert b.contents() == a.contents(), key
    assert len(ours.tensors) == len(theirs.tensors) > 0
    for a, b in zip(theirs.tensors, ours.tensors):
        assert (b.name, b.tensor_type, list(b.shape), b.n_elements, b.n_bytes, b.data_offset) == (
            a.name, a.tensor_type, list(a.shape), a.n_elements, a.n_bytes, a.data_offset
        ), a.name
        assert (b.data.dtype, b.data.shape) == (a.data.dtype, a.data.shape), a.name
        assert b.data.tobytes() == a.data.tobytes(), a.name


def test_the_fast_reader_reads_what_gguf_reads(gguf_files, tmp_path):
    """0031's FastGGUFReader parses on a plain view of the file's map: every
    field and tensor of every test file (converter output, quantized, split
    shards) and of a big-endian file comes out as gguf.GGUFReader reads it."""
    import gguf
    import numpy as np
    from vllm.model_executor.model_loader.gguf_readers import FastGGUFReader

    files = {f for p in gguf_files.values()
             for f in p.parent.glob(p.name.replace("-00001-of-", "-*-of-"))}
    assert len(files) > len(gguf_files)  # every shard of the split sets too
    for path in sorted(files):
        _read_alike(FastGGUFReader(path), gguf.GGUFReader(path))

    big = write_small_gguf(tmp_path / "big-endian.gguf", gguf.GGUFEndian.BIG)
    ours = FastGGUFReader(big)
    assert ours.byte_order == "S"
    _read_alike(ours, gguf.GGUFReader(big))
    assert ours.fields["glm-dsa.block_count"].contents() == 3
    assert ours.fields["tokenizer.ggml.tokens"].contents() == SMALL_GGUF_TOKENS
    assert ours.tensors[0].data.tolist() == np.arange(24).reshape(4, 6).tolist()


@pytest.mark.parametrize(
    "variant, use_tqdm", [("f16", True), ("f16-split", True), ("f16", False)]
)
def test_a_load_shows_its_progress(
    checkpoints, gguf_files, load_model, capfd, variant, use_tqdm
):
    """vLLM 0.23's GGUF loader printed nothing while it read the tensors
    (hundreds of GB in these models' files). A load shows one bar in
    vLLM's format over the bytes of every tensor it reads, across all
    shards of a split set, unless --use-tqdm-on-load is off; a fast load
    logs its first and last line only (a refresh at most every 10 s)."""
    capfd.readouterr()
    load_model(gguf_files[("glm", variant)], checkpoints["glm"].path,
               use_tqdm_on_load=use_tqdm)
    lines = [line for line in capfd.readouterr().err.splitlines()
             if line.startswith("Loading GGUF tensors")]
    if not use_tqdm:
        assert lines == []
        return
    assert len(lines) == 2, lines
    first, last = lines
    assert first.startswith("Loading GGUF tensors:   0% Completed | 0.00/"), first
    assert last.startswith("Loading GGUF tensors: 100% Completed | "), last
    done, total = last.split(" | ")[1].split(" ")[0].split("/")
    assert done == total and total != "0.00", last


def _tensor_data_of(path):
    """gguf-py's tensors of a file (its shards) by name, with the (start,
    end) address of each shard's map."""
    from vllm.model_executor.model_loader import gguf_readers

    paths = [path]
    if "-00001-of-" in path.name:
        paths = sorted(path.parent.glob(path.name.replace("-00001-of-", "-*-of-")))
    tensors, maps = {}, []
    for shard in paths:
        reader = gguf_readers.reader(shard)
        maps.append((reader.data.ctypes.data, reader.data.ctypes.data + reader.data.nbytes))
        tensors.update({t.name: t for t in reader.tensors})
    return paths, tensors, maps


@pytest.mark.parametrize("variant", ["q8_0", "bf16", "f32", "f16-split"])
def test_weights_are_read_from_the_file_s_map(gguf_files, variant):
    """vLLM 0.23 copied every tensor whole out of the file before a weight
    loader narrowed out its rank's shard, so each rank of TP 8 copied the
    whole file. The GGUF weights iterators give each tensor on the file's
    own memory, with the file's bytes: a rank copies only its shard."""
    from vllm.model_executor.model_loader import gguf_readers, weight_utils

    with gguf_readers.shared_readers():
        paths, tensors, maps = _tensor_data_of(gguf_files[("glm", variant)])
        identity = {name: name for name in tensors}
        if len(paths) > 1:
            weights = weight_utils.gguf_quant_weights_iterator_multi(
                [str(p) for p in paths], identity, use_tqdm_on_load=False)
        else:
            weights = weight_utils.gguf_quant_weights_iterator(
                paths[0], identity, use_tqdm_on_load=False)
        seen = set()
        for name, tensor in weights:
            if name.endswith(".qweight_type"):
                continue
            name = name.replace(".qweight", ".weight")
            start = tensor.data_ptr()
            end = start + tensor.numel() * tensor.element_size()
            assert any(lo <= start and end <= hi for lo, hi in maps), f"{name} is a copy"
            raw = tensors[name].data
            assert tensor.reshape(-1).view(torch.uint8).numpy().tobytes() == raw.tobytes(), name
            seen.add(name)
    assert seen == set(tensors)


def test_a_big_endian_file_s_floats_load_as_native_copies(tmp_path):
    """torch cannot view the other byte order: a big-endian file's float
    tensors come as native copies with the file's values (vLLM 0.23's
    torch.tensor raised on them)."""
    import gguf
    from vllm.model_executor.model_loader import weight_utils

    path = write_small_gguf(tmp_path / "big-endian.gguf", gguf.GGUFEndian.BIG)
    weights = dict(weight_utils.gguf_quant_weights_iterator(
        path, {"t.weight": "t.weight", "h.weight": "h.weight"}, use_tqdm_on_load=False))
    assert torch.equal(weights["t.weight"], torch.arange(24, dtype=torch.float32).reshape(4, 6))
    assert torch.equal(weights["h.weight"], torch.arange(8, dtype=torch.float16))


def _rank_parts(name: str, full: torch.Tensor, tp: int, shape: torch.Size) -> list[torch.Tensor]:
    """What each of `tp` ranks holds of `full` (the TP-1 model's tensor) when
    a rank's tensor has `shape`: all of it (replicated), or its part along
    the one dimension the ranks split; a merged layer's halves (gate_up,
    w13: [gate; up]) are each split, a rank holding [its gate; its up]."""
    if shape == full.shape:
        return [full] * tp
    dims = [d for d in range(full.dim()) if full.shape[d] != shape[d]]
    assert len(dims) == 1 and full.shape[dims[0]] == tp * shape[dims[0]], (
        f"{name}: {tuple(shape)} is no 1/{tp} of {tuple(full.shape)}")
    dim = dims[0]
    merged = "gate_up_proj." in name or ".w13_" in name
    halves = full.chunk(2 if merged else 1, dim)
    return [torch.cat([h.chunk(tp, dim)[r] for h in halves], dim) for r in range(tp)]


def _gate_up_of_two_types(checkpoints, gguf_files, tmp_path):
    """The tiny GLM-5 Q8_0 file with layer 1's gate experts Q4_K and up
    experts Q6_K (0020's split MoE)."""
    import gguf
    from gguf import GGMLQuantizationType as QType

    from gguf_checks import write_gguf
    from support.gguf_moe_ref import random_blocks

    g = torch.Generator().manual_seed(33)
    gate_raw, _ = random_blocks("Q4_K", (4, 64, 256), g)
    up_raw, _ = random_blocks("Q6_K", (4, 64, 256), g)
    return write_gguf(
        tmp_path / "gate-up.gguf",
        gguf.GGUFReader(gguf_files[("glm", "q8_0")]),
        blocks={
            "blk.1.ffn_gate_exps.weight": (QType.Q4_K, gate_raw.numpy()),
            "blk.1.ffn_up_exps.weight": (QType.Q6_K, up_raw.numpy()),
        },
    )


@pytest.mark.parametrize("name, variant", [
    ("glm", "q8_0"), ("glm", "bf16"), ("glm", "f16-split"), ("glm52", "q8_0"),
    ("glm", "gate-up-types"), ("glm", "q8_0-mtp"), ("glm52", "f16-mtp"),
])
def test_tensor_parallel_ranks_hold_their_part_of_each_weight(
    checkpoints, gguf_files, load_model, tmp_path, name, variant
):
    """Users serve these models at TP 4 or 8. Each rank of TP 2, one process
    a rank as `vllm serve` starts them, holds its part of every tensor of the
    model loaded at TP 1: the series' loaders (the MLA and indexer tensors,
    kv_b rebuilt, float and split experts, split files, the MTP draft)
    shard as vLLM's layers do, reading the file's map."""
    mtp = variant.endswith("-mtp")
    if variant == "gate-up-types":
        path = _gate_up_of_two_types(checkpoints, gguf_files, tmp_path)
    else:
        path = gguf_files[(name, variant.removesuffix("-mtp"))]
    full = load_model(path, checkpoints[name].path, mtp=mtp).state_dict()
    ranks = load_ranks(path, checkpoints[name].path, 2, tmp_path, mtp=mtp)
    assert [r.keys() for r in ranks] == [full.keys()] * 2
    split = 0
    for key, tensor in full.items():
        got = [r[key] for r in ranks]
        assert got[0].shape == got[1].shape, key
        want = _rank_parts(key, tensor, 2, got[0].shape)
        split += want[0].shape != tensor.shape
        for rank in range(2):
            assert got[rank].dtype == tensor.dtype, f"{key} rank {rank}"
            assert torch.equal(got[rank], want[rank]), f"{key} rank {rank}"
    assert split > 10
