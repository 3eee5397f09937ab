"""The GGUF loader holds file and config to each other (MLA/DSA archs):
configs as transformers' config classes write them build the published
model or are refused naming the key; every tensor of the file is read or
named; metadata the config also states agrees; a split set is whole and
one file's; tensor types without a vLLM kernel are refused at load."""

from __future__ import annotations

import inspect
import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType as VType

from gguf_checks import run_loader, write_gguf

# Keys the published config.json files carry and the config classes do not
# write (num_nextn_predict_layers as the file's own NextN block count).
_PUBLISHED_KEYS = {
    "glm": dict(
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        indexer_rope_interleave=True,
        rope_interleave=True,
        moe_layer_freq=1,
        num_nextn_predict_layers=1,
    ),
    "dsv32": dict(
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        moe_layer_freq=1,
        num_nextn_predict_layers=1,
    ),
}
_PUBLISHED_KEYS["glm52"] = _PUBLISHED_KEYS["glm"]


def _error():
    from vllm.model_executor.model_loader.gguf_dsa import GGUFCheckpointError

    return GGUFCheckpointError


def _split(
    src: Path, dst: Path, stem: str, n: int, edits: dict | None = None
) -> list[Path]:
    """`src` as an n-shard set `stem-0000i-of-0000n.gguf` in `dst`, split
    keys as gguf-split writes them; `edits` per shard index: "kv" (split
    keys), "extra" (tensors of other shards it carries as well),
    "extra_total" (added to split.tensors.count)."""
    edits = edits or {}
    reader = gguf.GGUFReader(src)
    tensors = list(reader.tensors)
    per = -(-len(tensors) // n)
    parts = [tensors[i * per : (i + 1) * per] for i in range(n)]
    total = sum(len(p) for p in parts)
    paths = []
    for i, part in enumerate(parts):
        edit = edits.get(i, {})
        part = part + edit.get("extra", [])
        kv = {
            "split.no": (i, VType.UINT16),
            "split.count": (n, VType.UINT16),
            "split.tensors.count": (total + edit.get("extra_total", 0), VType.INT32),
        } | edit.get("kv", {})
        path = dst / f"{stem}-{i + 1:05d}-of-{n:05d}.gguf"
        paths.append(write_gguf(path, reader, part, metadata=i == 0, kv=kv))
    return paths


@pytest.fixture(scope="module")
def configs(checkpoints):
    from vllm.transformers_utils.config import get_config

    def load(name: str, **overrides):
        config = get_config(checkpoints[name].path, trust_remote_code=False)
        config.update(overrides)
        return config

    return load


def _built_model(config) -> dict:
    """What vLLM reads from the config to build the MoE routing, the
    indexer and the MTP draft."""
    from vllm.model_executor.models.glm_dsa_defaults import (
        indexer_rope_is_neox_style,
        router_scoring_func,
    )

    keys = ("topk_method", "n_group", "topk_group", "routed_scaling_factor")
    keys += ("norm_topk_prob", "num_nextn_predict_layers", "num_hidden_layers")
    return {key: getattr(config, key, None) for key in keys} | {
        "scoring_func": router_scoring_func(config),
        "indexer_neox": indexer_rope_is_neox_style(config),
        "moe_layer_freq": getattr(config, "moe_layer_freq", 1),
        "rope_parameters": config.rope_parameters,
    }


@pytest.mark.parametrize("name", ["glm", "glm52", "dsv32"])
def test_transformers_written_config_builds_the_published_model(
    tmp_path, checkpoints, gguf_files, name
):
    """A config built by transformers' GlmMoeDsaConfig / DeepseekV32Config
    (only the class's own fields) lacks scoring_func, topk_method, ...;
    vLLM then routed without the score correction bias and skipped the
    file's blk.N.exp_probs_b (DeepSeek-V3.2 also with softmax)."""
    from transformers import DeepseekV32Config, GlmMoeDsaConfig
    from vllm.model_executor.model_loader.gguf_dsa import get_mla_gguf_name_map
    from vllm.transformers_utils.config import get_config

    source = json.loads((checkpoints[name].path / "config.json").read_text())
    cls = DeepseekV32Config if name == "dsv32" else GlmMoeDsaConfig
    fields = inspect.signature(cls.__init__).parameters
    written = cls(**{k: v for k, v in source.items() if k in fields})
    written.save_pretrained(tmp_path / "written")
    saved = json.loads((tmp_path / "written" / "config.json").read_text())
    assert not set(_PUBLISHED_KEYS[name]) & set(saved), "the class wrote them"
    (tmp_path / "published").mkdir()
    published = source | _PUBLISHED_KEYS[name]
    (tmp_path / "published" / "config.json").write_text(json.dumps(published))

    path = str(gguf_files[(name, "f16")])
    models = {}
    for kind in ("written", "published"):
        config = get_config(tmp_path / kind, trust_remote_code=False)
        name_map = get_mla_gguf_name_map(config, [path])
        models[kind] = (_built_model(config), name_map)
    assert models["written"][0] == models["published"][0]
    assert models["written"][1] == models["published"][1]
    assert any(n.endswith("exp_probs_b.bias") for n in models["written"][1])


def test_deepseek2_config_without_topk_method_is_refused(configs, gguf_files):
    """DeepSeek-V2/V3 configs route either way: without topk_method the
    file's router bias would go unread; the error names the key."""
    config = configs("dsv3")
    del config.topk_method
    with pytest.raises(_error(), match=r"blk\.1\.exp_probs_b\.bias.*topk_method"):
        run_loader(gguf_files[("dsv3", "q8_0")], config)


def test_file_gating_func_is_used_where_the_config_has_none(
    tmp_path, configs, gguf_files
):
    from vllm.model_executor.model_loader.gguf_dsa import get_mla_gguf_name_map

    src = gguf_files[("dsv32", "f16")]
    key = "deepseek32.expert_gating_func"
    dst = write_gguf(
        tmp_path / "softmax.gguf", gguf.GGUFReader(src), kv={key: (1, VType.UINT32)}
    )
    config = configs("dsv32")
    assert getattr(config, "scoring_func", None) is None
    get_mla_gguf_name_map(config, [str(dst)])
    assert config.scoring_func == "softmax"


def test_config_with_fewer_layers_than_the_file(configs, gguf_files):
    config = configs("glm", num_hidden_layers=2)
    with pytest.raises(_error()) as info:
        run_loader(gguf_files[("glm", "q8_0")], config)
    message = str(info.value)
    assert "never reads: ['blk.2." in message, message
    assert "glm-dsa.block_count: expected 3 (num_hidden_layers 2 + 1 NextN" in message
    assert "found 4" in message


@pytest.mark.parametrize(
    "name, variant, tensor",
    [
        ("glm", "f16", "blk.1.ffn_extra.weight"),
        ("glm52", "q8_0", "extra_head.weight"),
        ("dsv3", "q8_0", "blk.0.attn_q_extra.weight"),
    ],
)
def test_unknown_tensor_is_named(tmp_path, configs, gguf_files, name, variant, tensor):
    src = gguf.GGUFReader(gguf_files[(name, variant)])
    extra = (tensor, np.ones((4, 32), np.float32))
    dst = write_gguf(tmp_path / "extra.gguf", src, add=[extra])
    match = r"never reads: \['" + re.escape(tensor) + r"'\]"
    with pytest.raises(_error(), match=match):
        run_loader(dst, configs(name))


@pytest.mark.parametrize(
    "name, file_kv, config_kv, named",
    [
        (
            "glm",
            {"glm-dsa.expert_count": (8, VType.UINT32)},
            {},
            r"glm-dsa\.expert_count: expected 4 \(n_routed_experts\), found 8",
        ),
        (
            "glm",
            {},
            {"num_experts_per_tok": 3},
            r"glm-dsa\.expert_used_count: expected 3 \(num_experts_per_tok\), found 2",
        ),
        (
            "glm52",
            {"glm-dsa.attention.head_count": (8, VType.UINT32)},
            {},
            r"attention\.head_count: expected 4 \(num_attention_heads\), found 8",
        ),
        (
            "glm",
            {},
            {"max_position_embeddings": 4096},
            r"context_length: expected 4096 \(max_position_embeddings\), found 1024",
        ),
        (
            "glm",
            {},
            {"num_nextn_predict_layers": 2},
            r"nextn_predict_layers: expected 2 \(num_nextn_predict_layers\), found 1",
        ),
        (
            "glm",
            {"glm-dsa.expert_gating_func": (1, VType.UINT32)},
            {"scoring_func": "sigmoid"},
            r"expert_gating_func: expected 'sigmoid' \(scoring_func\), found 'softmax'",
        ),
        (
            "dsv32",
            {},
            {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}},
            r"rope\.freq_base: expected 1000000 .*rope_theta\), found 10000",
        ),
        (
            "dsv32",
            {},
            {"index_topk": 32},
            r"indexer\.top_k: expected 32 \(index_topk\), found 16",
        ),
        (
            "dsv3",
            {},
            {"routed_scaling_factor": 1.0},
            r"expert_weights_scale: expected 1 \(routed_scaling_factor\), found 2\.5",
        ),
    ],
    ids=[
        "expert_count",
        "expert_used_count",
        "head_count",
        "context_length",
        "nextn",
        "gating",
        "rope_theta",
        "index_topk",
        "routed_scaling",
    ],
)
def test_metadata_disagreement_is_named(
    tmp_path, configs, gguf_files, name, file_kv, config_kv, named
):
    path = gguf_files[(name, "q8_0" if name != "dsv32" else "f16")]
    if file_kv:
        path = write_gguf(tmp_path / "edited.gguf", gguf.GGUFReader(path), kv=file_kv)
    with pytest.raises(_error(), match=named):
        run_loader(path, configs(name, **config_kv))


@pytest.fixture(scope="module")
def shard_sets(tmp_path_factory, gguf_files, configs):
    """glm and glm52 (q8_0) as 3-shard sets; the glm set as written here
    loads (the cases below edit one thing each)."""
    root = tmp_path_factory.mktemp("shards")
    sets = {}
    for name in ("glm", "glm52"):
        (root / name).mkdir()
        sets[name] = _split(gguf_files[(name, "q8_0")], root / name, name, 3)
    loaded = run_loader(sets["glm"][0], configs("glm"))
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in loaded.tensors
    return sets


def test_split_shard_from_another_file(tmp_path, shard_sets, configs):
    for i, shard in enumerate(shard_sets["glm"]):
        source = shard_sets["glm52"][i] if i == 1 else shard
        shutil.copy(source, tmp_path / shard.name)
    foreign = tmp_path / shard_sets["glm"][1].name
    with pytest.raises(
        _error(),
        match=rf"{foreign.name}: split\.tensors\.count: expected \d+, found \d+",
    ):
        run_loader(tmp_path / shard_sets["glm"][0].name, configs("glm"))


def test_split_tensor_in_two_shards(tmp_path, gguf_files, configs):
    src = gguf_files[("glm", "q8_0")]
    first = gguf.GGUFReader(src).tensors[0]
    # The last shard carries the first shard's first tensor too; the
    # counts say so, as a set written that way would.
    edits = {i: {"extra_total": 1} for i in range(3)}
    edits[2]["extra"] = [first]
    shards = _split(src, tmp_path, "glm", 3, edits)
    with pytest.raises(
        _error(), match=rf"tensors in more than one shard: \{{'{first.name}'"
    ):
        run_loader(shards[0], configs("glm"))


@pytest.mark.parametrize("shard", [0, 2])
def test_split_count_disagreeing_with_the_set(tmp_path, gguf_files, configs, shard):
    src = gguf_files[("glm", "q8_0")]
    edits = {shard: {"kv": {"split.count": (4, VType.UINT16)}}}
    shards = _split(src, tmp_path, "glm", 3, edits)
    name = shards[shard].name.replace(".", r"\.")
    with pytest.raises(_error(), match=rf"{name}: split\.count: expected 3, found 4"):
        run_loader(shards[0], configs("glm"))


def test_a_shard_loaded_alone(tmp_path, shard_sets, configs):
    alone = tmp_path / "glm.gguf"
    shutil.copy(shard_sets["glm"][0], alone)
    with pytest.raises(
        _error(), match=r"split\.count is 3, but the file is loaded alone"
    ):
        run_loader(alone, configs("glm"))


@pytest.mark.parametrize(
    "qtype", [QType.MXFP4, QType.TQ1_0, QType.TQ2_0], ids=lambda t: t.name
)
def test_expert_type_without_a_kernel_is_refused(tmp_path, gguf_files, configs, qtype):
    """Merged experts of one layer in a type vLLM's GGUF MoE cannot run:
    refused before loading, naming tensor and type (the GGUF MoE method
    has no load-time check; it failed at the first forward). ffn_down
    (rows of 64) stays Q8_0: the ternary types need rows of 256."""
    src = gguf.GGUFReader(gguf_files[("glm", "q8_0")])
    assert {t.tensor_type for t in src.tensors if "_exps" in t.name} == {QType.Q8_0}
    experts = [f"blk.1.ffn_{w}_exps.weight" for w in ("gate", "up")]
    dst = write_gguf(
        tmp_path / "experts.gguf", src, retype=dict.fromkeys(experts, qtype)
    )
    with pytest.raises(
        _error(), match=rf"'blk\.1\.ffn_gate_exps\.weight': '{qtype.name}'"
    ):
        run_loader(dst, configs("glm"))


@pytest.mark.parametrize("kernels", ["series", "upstream"])
def test_iq3_s_tensors_are_named_in_a_warning(monkeypatch, kernels):
    """vLLM's compiled IQ3_S grid is older than llama.cpp's: the tensors the
    model reads in that type are named (and only those), with the memory
    they take as Q6_K (gguf_iq3_s), or with VLLM_GGUF_KERNELS=upstream the
    error they keep."""
    from types import SimpleNamespace

    from vllm import logger as vllm_logger
    from vllm.model_executor.model_loader import gguf_dsa

    def tensor(name, qtype):
        return SimpleNamespace(name=name, tensor_type=qtype, n_bytes=110 * 2**20)

    monkeypatch.setenv("VLLM_GGUF_KERNELS", kernels)
    readers = [SimpleNamespace(tensors=[
        tensor("blk.1.ffn_down_exps.weight", QType.IQ3_S),
        tensor("blk.1.ffn_up_exps.weight", QType.IQ3_XXS),
        tensor("blk.9.ffn_down_exps.weight", QType.IQ3_S),  # not read: not named
    ])]
    name_map = {"blk.1.ffn_down_exps.weight": "x", "blk.1.ffn_up_exps.weight": "y"}
    warnings = []
    monkeypatch.setattr(gguf_dsa.logger, "warning",
                        lambda *a, **_: warnings.append(a[0] % a[1:]))
    vllm_logger._print_warning_once.cache_clear()  # once per process: start afresh
    named = gguf_dsa._warn_iq3_s(["m.gguf"], readers, name_map)
    assert named == ["blk.1.ffn_down_exps.weight"]
    # the loader maps a file's names more than once: one warning a file
    assert gguf_dsa._warn_iq3_s(["m.gguf"], readers, name_map) == named
    assert len(warnings) == 1
    assert "m.gguf: 1 tensors of type IQ3_S (blk.1.ffn_down_exps.weight)" in warnings[0]
    if kernels == "series":
        assert "load as Q6_K blocks of the same values, 210.0 MiB instead of 110.0 MiB" in (
            warnings[0])
        assert gguf_dsa._size(3 * 2**30) == "3.0 GiB"
    else:
        assert "15.5 instead of 15" in warnings[0]
    warnings.clear()
    assert gguf_dsa._warn_iq3_s(["m.gguf"], readers, {"blk.1.ffn_up_exps.weight": "y"}) == []
    assert warnings == []
