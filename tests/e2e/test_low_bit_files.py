"""CPU checks of the end-to-end test files that llama.cpp's own tools make
(models.TOOL_FILES: K and IQ types with the model's importance matrix, a
dynamic mixture, a split set), as the engine tests (cases.GROUPS) use them:

- the routed experts carry the type a file is named for, and what the
  manifest says of each file (tensor types, the tensors the quantizer gave
  another type because their rows do not fit its blocks) is true of it;
- the series' GGUF loader reads every tensor of every file (a split set from
  its first shard) into the checkpoint's parameters, each of the file's
  type and within that type's rounding of the checkpoint, or refuses a type
  vLLM cannot run, naming tensor and type; the model an engine builds for
  the file holds its routed experts as the file stores them.

They need llama.cpp's tools (`python3 scripts/series.py llama-cpp tools`,
minutes on few cores; `make e2e-models` builds them too) and are skipped
where they are not built.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

import models
from cases import GROUPS
from patchseries.llama_cpp_tools import built_cpu_tools
from support.gguf_engine_load import engine_loader
from support.gguf_loader import dequantized, expected_from_checkpoint, run_loader


def _tools_built() -> bool:
    try:
        return built_cpu_tools() is not None
    except SystemExit:  # LLAMA_CPP_SRC names nothing: the build would say so
        return False


def _llama_cpp_importable() -> bool:
    # the converter and the binding-made files need llama-cpp-python
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


pytestmark = [
    pytest.mark.skipif(
        not _tools_built(),
        reason="llama.cpp's tools are not built: python3 scripts/series.py llama-cpp tools"),
    pytest.mark.skipif(
        not _llama_cpp_importable(),
        reason="llama_cpp (llama-cpp-python, tests/requirements-gpu.txt) not importable"),
]

# Every file of the engine matrix that llama.cpp's tools make.
FILES = [(m, t) for m, t in GROUPS if t in models.TOOL_FILES]
QUANTIZED = [(m, t) for m, t in FILES if models.TOOL_FILES[t].ftype]
SPLIT = [(m, t) for m, t in FILES if models.TOOL_FILES[t].split_of]

# Relative error (Frobenius) of a type's rounding of these checkpoints'
# tensors, with room: about 1.5x the largest seen. A tensor loaded under
# another's name, transposed or mixed up with its partner is off by ~1.4.
FLOAT = ("F32", "F16", "BF16")
ROUNDING = {"Q8_0": 0.01, "Q6_K": 0.03, "Q5_K": 0.06,
            "Q5_0": 0.1, "Q4_K": 0.12, "Q4_0": 0.12, "IQ4_XS": 0.12, "IQ4_NL": 0.12,
            "Q3_K": 0.25, "IQ3_S": 0.25, "IQ3_XXS": 0.3, "Q2_K": 0.45, "IQ2_XXS": 0.55,
            "IQ1_M": 0.7}

_EXPS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The models of FILES with those files, as `make e2e-models` builds them."""
    out = tmp_path_factory.mktemp("e2e")
    manifest = {}
    for name in sorted({m for m, _ in FILES}):
        manifest = models.build(out, types=tuple(t for m, t in FILES if m == name),
                                names=(name,))
    return out, manifest


def _file(built, model: str, gguf_type: str):
    out, manifest = built
    return out / model / manifest["models"][model]["gguf"][gguf_type]


def _gguf_shapes(path) -> dict[str, list[int]]:
    """GGUF tensor -> its ne (row length first), over a set's shards."""
    from gguf import GGUFReader

    return {t.name: [int(d) for d in t.shape] for f in models.shards(path)
            for t in GGUFReader(f).tensors}


@pytest.mark.parametrize("model, gguf_type", QUANTIZED, ids=[f"{m}-{t}" for m, t in QUANTIZED])
def test_routed_experts_carry_the_named_type(built, model, gguf_type):
    entry = built[1]["models"][model]
    types = models.tensor_types(_file(built, model, gguf_type))
    named = entry["named"][gguf_type]
    assert named == models.TOOL_FILES[gguf_type].experts
    gate_up = {n: t for n, t in types.items()
               if (m := _EXPS.fullmatch(n)) and m[2] != "down" and int(m[1]) < entry["layers"]}
    # every MoE layer of the decoder (the first is dense)
    assert len(gate_up) == 2 * (entry["layers"] - 1)
    assert set(gate_up.values()) == {named}, gate_up
    assert entry["tensor_types"][gguf_type] == models.listed_types(types)
    assert entry["types"][gguf_type] == sorted(set(types.values()))


@pytest.mark.parametrize("model, gguf_type", QUANTIZED, ids=[f"{m}-{t}" for m, t in QUANTIZED])
def test_fallback_record_is_what_the_rows_force(built, model, gguf_type):
    """The tensors llama-quantize gave a fallback type have rows that do not
    fit the wanted type's blocks, and hold the type recorded; no routed
    expert is among them."""
    fallback = built[1]["models"][model]["fallback"][gguf_type]
    path = _file(built, model, gguf_type)
    types, shapes = models.tensor_types(path), _gguf_shapes(path)
    for name, record in fallback.items():
        assert types[name] == record["got"] != record["wanted"], name
        assert shapes[name][0] == record["columns"], name
        assert record["columns"] % record["block"] != 0, name
        assert not _EXPS.fullmatch(name), name


@pytest.mark.parametrize("model", [m for m, t in FILES if t == "iq2_xxs-dynamic"])
def test_dynamic_mixture_types(built, model):
    """The dynamic mixture: attention, indexer and NextN block Q8_0, shared
    experts Q6_K, routed gate/up IQ2_XXS, routed down IQ3_XXS, the leading
    dense layers Q4_K, the token embedding Q4_K, the output head Q6_K."""
    entry = built[1]["models"][model]
    layers = entry["layers"]
    for name, t in models.tensor_types(_file(built, model, "iq2_xxs-dynamic")).items():
        if name.endswith(("norm.weight", ".bias")) or "ffn_gate_inp" in name:
            want = "F32"
        elif name == "token_embd.weight":
            want = "Q4_K"
        elif name == "output.weight":
            want = "Q6_K"
        elif name.startswith(f"blk.{layers}."):
            want = "Q8_0"
        elif "_shexp." in name:
            want = "Q6_K"
        elif m := _EXPS.fullmatch(name):
            want = "IQ3_XXS" if m[2] == "down" else "IQ2_XXS"
        elif re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.weight", name):
            want = "Q4_K"
        else:
            assert re.fullmatch(r"blk\.\d+\.(attn_|indexer\.)\w+\.weight", name), name
            want = "Q8_0"
        assert t == want, (name, t, want)


@pytest.mark.parametrize("model, gguf_type", FILES, ids=[f"{m}-{t}" for m, t in FILES])
def test_series_loader_reads_every_tensor(built, model, gguf_type):
    """Every parameter of the checkpoint once, from the file's tensor of its
    name, of that tensor's type, within its type's rounding; a file holding
    a type vLLM cannot run is refused, naming each such tensor and type."""
    from transformers import AutoConfig
    from vllm.model_executor.layers.quantization.gguf import DEQUANT_TYPES, UNQUANTIZED_TYPES
    from vllm.model_executor.model_loader.gguf_dsa import GGUFCheckpointError
    from vllm.model_executor.model_loader.gguf_iq3_s import iq3_s_repacked

    entry = built[1]["models"][model]
    path = _file(built, model, gguf_type)
    hf = path.parent / entry["hf"]
    config = AutoConfig.from_pretrained(hf)
    types = models.tensor_types(path)
    supported = {t.name for t in UNQUANTIZED_TYPES | DEQUANT_TYPES}
    if unsupported := {n: t for n, t in types.items() if t not in supported
                       and not n.startswith(f"blk.{entry['layers']}.")}:
        with pytest.raises(GGUFCheckpointError) as excinfo:
            run_loader(path, config)
        for name, t in unsupported.items():
            assert f"'{name}': '{t}'" in str(excinfo.value)
        return
    loaded = run_loader(path, config)
    expected = expected_from_checkpoint(load_file(hf / "model.safetensors"),
                                        range(entry["layers"]))
    assert sorted(loaded.tensors) == sorted(expected)
    source = {hf_name: g for g, hf_name in loaded.name_map.items()}
    for name, ref in expected.items():
        gguf_name = source[name]
        if gguf_name in types:
            type_names = [types[gguf_name]]
            if name in loaded.qtypes:  # kept quantized: the file's bytes and type
                import gguf

                want = types[gguf_name]
                if want == "IQ3_S" and iq3_s_repacked():  # 0027: Q6_K blocks of its values
                    want = "Q6_K"
                assert gguf.GGMLQuantizationType(loaded.qtypes[name]).name == want
        else:  # kv_b_proj, rebuilt from its absorbed factors
            type_names = [types[gguf_name.replace("attn_kv_b", f"attn_{f}_b")] for f in "kv"]
        got = dequantized(loaded, name)
        assert tuple(got.shape) == tuple(ref.shape), name
        if type_names[0] in FLOAT:  # converted as they are
            assert torch.equal(got, ref.to(got.dtype)), (name, type_names)
            continue
        rel = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
        assert rel <= max(ROUNDING[t] for t in type_names), (name, type_names, rel)


@pytest.fixture(scope="module")
def load_model():
    """(GGUF path, HF dir) -> the model vLLM builds and loads, on the CPU."""
    with pytest.MonkeyPatch.context() as mp, engine_loader(mp) as load:
        yield load


@pytest.mark.parametrize("model, gguf_type", FILES, ids=[f"{m}-{t}" for m, t in FILES])
def test_engine_model_holds_the_files_experts(built, load_model, model, gguf_type):
    """The model an engine builds for the file (GGUFModelLoader.load_model)
    runs every MoE layer through the GGUF MoE method with the file's bytes
    and types: gate and up experts fused as w13, down as w2."""
    import gguf
    from vllm.model_executor.layers.quantization.gguf import GGUFMoEMethod

    entry = built[1]["models"][model]
    path = _file(built, model, gguf_type)
    net = load_model(path, path.parent / entry["hf"])
    tensors = {t.name: t for f in models.shards(path) for t in gguf.GGUFReader(f).tensors}
    moe_layers = 0
    for i, layer in enumerate(net.model.layers):
        if (experts := getattr(layer.mlp, "experts", None)) is None:
            continue
        moe_layers += 1
        gate, up, down = (tensors[f"blk.{i}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
        assert isinstance(experts.quant_method, GGUFMoEMethod), i
        assert experts.w13_qweight_type.weight_type == gate.tensor_type == up.tensor_type, i
        assert experts.w2_qweight_type.weight_type == down.tensor_type, i
        w13 = torch.cat([torch.from_numpy(gate.data), torch.from_numpy(up.data)], dim=1)
        assert torch.equal(experts.w13_qweight.data, w13), i
        assert torch.equal(experts.w2_qweight.data, torch.from_numpy(down.data)), i
    assert moe_layers == entry["layers"] - 1  # the first layer is dense


@pytest.mark.parametrize("model, gguf_type", SPLIT, ids=[f"{m}-{t}" for m, t in SPLIT])
def test_split_set_from_its_first_shard(built, model, gguf_type):
    """llama-gguf-split's set, given by its first shard as users pass it:
    vLLM's config and the series' loader see the whole set, the same
    tensors and types as the file it was split from; so does the
    transformers oracle."""
    import gguf
    from transformers import AutoConfig
    from vllm.config import ModelConfig

    from oracles import gguf_tensors

    entry = built[1]["models"][model]
    first = _file(built, model, gguf_type)
    whole = _file(built, model, models.TOOL_FILES[gguf_type].split_of)
    shards = models.shards(first)
    assert [p.name for p in shards] == entry["shards"][gguf_type]
    assert len(shards) == models.TOOL_FILES[gguf_type].shards
    # llama-gguf-split's layout: the metadata in the first shard only
    later = gguf.GGUFReader(shards[1])
    assert later.get_field(gguf.Keys.General.ARCHITECTURE) is None
    assert len(gguf.GGUFReader(first).tensors) < len(models.tensor_types(first))

    hf = first.parent / entry["hf"]
    config = ModelConfig(model=str(first), hf_config_path=str(hf), tokenizer=str(hf),
                         quantization="gguf", skip_tokenizer_init=True)
    assert config.hf_config.model_type == AutoConfig.from_pretrained(hf).model_type
    split, single = (run_loader(p, AutoConfig.from_pretrained(hf)) for p in (first, whole))
    assert sorted(split.tensors) == sorted(single.tensors)
    for name, tensor in single.tensors.items():
        assert torch.equal(split.tensors[name], tensor), name
    assert split.qtypes == single.qtypes and split.weight_types == single.weight_types

    from_set, from_file = gguf_tensors(first), gguf_tensors(whole)
    assert sorted(from_set) == sorted(from_file)
    assert all((from_set[n] == from_file[n]).all() for n in from_file)
