"""GLM-5 / DeepSeek-V3 / DeepSeek-V3.2 GGUF files written by llama.cpp's
converter load through vLLM's GGUF loader: every checkpoint parameter
exactly once, with the checkpoint's values (patches 0001 and 0002)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from gguf_checks import (
    Loaded,
    assert_matches,
    dequantized,
    expected_from_checkpoint,
    file_tensor_types,
    q8_0_bound,
    run_loader,
)

_DTYPE_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _config(checkpoint):
    return AutoConfig.from_pretrained(checkpoint.path)


def _kv_b_bound(ref: torch.Tensor, config) -> torch.Tensor:
    """Q8_0 bound for a kv_b rebuilt from Q8_0 attn_k_b/attn_v_b: the
    quantization blocks run along the factors' last dims."""
    h, nope, v = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    per_head = ref.view(h, nope + v, config.kv_lora_rank)
    k_b = per_head[:, :nope].transpose(1, 2)
    v_b = per_head[:, nope:]
    bound = torch.cat([q8_0_bound(k_b).transpose(1, 2), q8_0_bound(v_b)], dim=1)
    return bound.reshape(ref.shape)


def _check_values(loaded: Loaded, expected: dict, path, config) -> None:
    file_types = file_tensor_types(path)
    gguf_name = {hf: g for g, hf in loaded.name_map.items()}
    checked_kv_b = 0
    for name, ref in expected.items():
        got = dequantized(loaded, name)
        source = gguf_name[name]
        bound = None
        if source.endswith("attn_kv_b.weight") and source not in file_types:
            # Rebuilt from the factors; compare against their type.
            k_type = file_types[source.replace("attn_kv_b", "attn_k_b")]
            v_type = file_types[source.replace("attn_kv_b", "attn_v_b")]
            assert k_type == v_type
            type_name = k_type
            if type_name == "Q8_0":
                bound = _kv_b_bound(ref, config)
            checked_kv_b += 1
        else:
            type_name = file_types[source]
        if type_name in ("F32", "F16", "BF16"):
            assert _DTYPE_TYPES[got.dtype] == type_name, f"{name}: {got.dtype}"
        assert_matches(got, ref, type_name, name, bound)
    return checked_kv_b


@pytest.mark.parametrize(
    "name, variant",
    [
        ("glm", "f32"),
        ("glm", "f16"),
        ("glm", "bf16"),
        ("glm", "q8_0"),
        ("glm", "q8_0-legacy"),
        ("dsv3", "f16"),
        ("dsv3", "q8_0"),
        ("dsv3", "f32-legacy"),
        ("dsv32", "f16"),
        ("glm52", "q8_0"),
    ],
)
def test_every_parameter_once_with_checkpoint_values(
    checkpoints, gguf_files, name, variant
):
    checkpoint = checkpoints[name]
    config = _config(checkpoint)
    path = gguf_files[(name, variant)]
    loaded = run_loader(path, config)
    state = load_file(checkpoint.path / "model.safetensors")
    expected = expected_from_checkpoint(state, range(checkpoint.num_hidden_layers))

    assert sorted(loaded.tensors) == sorted(expected)
    n_kv_b = _check_values(loaded, expected, path, config)
    legacy = variant.endswith("-legacy")
    assert n_kv_b == (0 if legacy else checkpoint.num_hidden_layers)
    if not legacy:
        file_types = file_tensor_types(path)
        assert not any("attn_kv_b" in t for t in file_types), (
            "converter wrote attn_kv_b"
        )
    # The rebuilt kv_b and the float-only indexer wk are unquantized layers.
    for layer in range(checkpoint.num_hidden_layers):
        prefix = f"model.layers.{layer}.self_attn."
        assert (
            loaded.weight_types[prefix + "kv_b_proj.weight"] in ("F32", "F16", "BF16")
            or legacy
        )
        if name == "glm52" and config.indexer_types[layer] == "shared":
            assert not any(n.startswith(prefix + "indexer.") for n in loaded.tensors)
        elif name != "dsv3":
            assert prefix + "indexer.wk.weight" not in loaded.qtypes
            assert loaded.weight_types[prefix + "indexer.wk.weight"] in (
                "F32",
                "F16",
                "BF16",
            )


def test_mtp_block_is_skipped_for_the_target_model(checkpoints, gguf_files):
    checkpoint = checkpoints["glm"]
    path = gguf_files[("glm", "q8_0")]
    mtp = checkpoint.num_hidden_layers
    assert f"blk.{mtp}.nextn.eh_proj.weight" in file_tensor_types(path)
    loaded = run_loader(path, _config(checkpoint))
    assert not [n for n in loaded.tensors if n.startswith(f"model.layers.{mtp}.")]


@pytest.mark.parametrize("variant", ["f16", "q8_0"])
def test_mtp_block_loads_for_the_speculative_draft(checkpoints, gguf_files, variant):
    from vllm.config.speculative import SpeculativeConfig

    checkpoint = checkpoints["glm"]
    path = gguf_files[("glm", variant)]
    # The draft config MTP speculative decoding derives from the target's.
    config = SpeculativeConfig.hf_config_override(copy.deepcopy(_config(checkpoint)))
    assert config.model_type == "deepseek_mtp"
    loaded = run_loader(path, config)

    mtp = checkpoint.num_hidden_layers
    state = load_file(checkpoint.path / "model.safetensors")
    expected = expected_from_checkpoint(state, range(mtp, mtp + 1), top_level=False)
    # GLM-5 keeps no per-block embedding/head: the draft shares the target's.
    expected[f"model.layers.{mtp}.embed_tokens.weight"] = state[
        "model.embed_tokens.weight"
    ]
    expected[f"model.layers.{mtp}.shared_head.head.weight"] = state["lm_head.weight"]
    assert sorted(loaded.tensors) == sorted(expected)
    _check_values(loaded, expected, path, config)
    assert loaded.tensors[f"model.layers.{mtp}.eh_proj.weight"].dtype.is_floating_point


def test_shard_set_loads_like_the_single_file(checkpoints, gguf_files):
    from vllm.model_executor.model_loader.gguf_loader import GGUFModelLoader

    first = gguf_files[("glm", "f16-split")]
    shards = GGUFModelLoader._get_all_gguf_files(str(first))
    assert len(shards) == int(first.stem.rsplit("-of-", 1)[1]) > 1
    config = _config(checkpoints["glm"])
    split = run_loader(first, config)
    single = run_loader(gguf_files[("glm", "f16")], config)
    assert sorted(split.tensors) == sorted(single.tensors)
    for name, tensor in single.tensors.items():
        assert torch.equal(split.tensors[name], tensor), name
    assert split.weight_types == single.weight_types


@pytest.mark.parametrize(
    "name, tp_size", [("glm", 1), ("glm", 2), ("glm", 4), ("dsv3", 3)]
)
def test_kv_b_tensor_parallel_shards_are_whole_heads(
    checkpoints, gguf_files, name, tp_size
):
    """kv_b_proj's own weight loader cuts the rebuilt tensor into per-rank
    row blocks; each must hold its heads' nope rows then v rows."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    checkpoint = checkpoints[name]
    config = _config(checkpoint)
    n_head = config.num_attention_heads
    loaded = run_loader(gguf_files[(name, "f16")], config)
    state = load_file(checkpoint.path / "model.safetensors")
    rows = config.qk_nope_head_dim + config.v_head_dim
    per_rank = n_head // tp_size
    for layer in range(checkpoint.num_hidden_layers):
        key = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        ref = state[key].to(torch.float16).view(n_head, rows, config.kv_lora_rank)
        for rank in range(tp_size):
            param = torch.nn.Parameter(
                torch.full(
                    (per_rank * rows, config.kv_lora_rank),
                    float("nan"),
                    dtype=torch.float16,
                ),
                requires_grad=False,
            )
            param.output_dim = 0
            layer_stub = SimpleNamespace(tp_rank=rank, tp_size=tp_size)
            ColumnParallelLinear.weight_loader(layer_stub, param, loaded.tensors[key])
            want = ref[rank * per_rank : (rank + 1) * per_rank].reshape(param.shape)
            assert torch.equal(param.data, want), (key, rank)


def _random_blocks(qtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random but valid GGUF blocks of `qtype` for a float tensor of `shape`:
    random bytes with the fp16 super-block scales set to sane values."""
    import gguf
    import numpy as np

    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block
    raw = torch.randint(0, 256, (n_blocks, type_size), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n_blocks, 2, generator=gen) * 0.01 + 1e-3).half()
    scale_bytes = scales.view(torch.uint8)
    if qtype == gguf.GGMLQuantizationType.Q6_K:  # d is the last field
        raw[:, -2:] = scale_bytes[:, :2]
    else:  # Q4_K / Q5_K / Q2_K...: d, dmin lead the block
        raw[:, :4] = scale_bytes
    return raw.reshape(*shape[:-1], shape[-1] // block * type_size)


@pytest.mark.parametrize(
    "k_type, v_type",
    [("Q8_0", "Q4_K"), ("Q8_0", "Q6_K"), ("Q6_K", "Q6_K"), ("F16", "Q5_K")],
)
def test_kv_b_from_k_quant_factors(checkpoints, k_type, v_type):
    """llama.cpp's converter writes no K-quants (llama-quantize does, and
    falls back to another type for attn_k_b where qk_nope is no multiple of
    256): rebuild kv_b from such factors, as the GGUF iterators deliver them."""
    import gguf
    from vllm.model_executor.model_loader.gguf_dsa import (
        mla_gguf_weight_types,
        mla_gguf_weights,
    )

    config = copy.deepcopy(_config(checkpoints["glm"]))
    config.num_attention_heads = 3
    h, rank = config.num_attention_heads, config.kv_lora_rank
    nope, v = config.qk_nope_head_dim, config.v_head_dim
    if k_type.endswith("_K"):
        nope = config.qk_nope_head_dim = 256  # K-quant rows come in 256s
    gen = torch.Generator().manual_seed(7)
    prefix = "model.layers.0.self_attn.kv_b_proj"
    stream, types, floats = [], [], {}
    for which, type_name, shape in (
        ("k", k_type, (h, rank, nope)),
        ("v", v_type, (h, v, rank)),
    ):
        name = f"{prefix}.{which}_b.weight"
        qtype = gguf.GGMLQuantizationType[type_name]
        if type_name == "F16":
            data = torch.randn(shape, generator=gen).half()
            floats[which] = data.float()
            stream.append((name, data))
        else:
            data = _random_blocks(qtype, shape, gen)
            floats[which] = torch.from_numpy(
                gguf.quants.dequantize(data.numpy(), qtype)
            )
            types.append(
                (name.replace("weight", "qweight_type"), torch.tensor(int(qtype)))
            )
            stream.append((name.replace("weight", "qweight"), data))
        assert torch.isfinite(floats[which]).all()
    name_map = {f"blk.0.attn_{w}_b.weight": f"{prefix}.{w}_b.weight" for w in "kv"}
    out = dict(mla_gguf_weights(types + stream, config, name_map))

    assert list(out) == [f"{prefix}.weight"]
    want = torch.cat([floats["k"].transpose(1, 2), floats["v"]], dim=1).reshape(
        -1, rank
    )
    assert torch.equal(out[f"{prefix}.weight"].float(), want)
    weight_types = mla_gguf_weight_types(
        {f"{prefix}.k_b.weight": k_type, f"{prefix}.v_b.weight": v_type}
    )
    assert weight_types == {f"{prefix}.weight": "F32"}
