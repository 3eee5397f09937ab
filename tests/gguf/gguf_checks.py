"""Run vLLM's GGUF loader the way it runs for real (name map, weight types,
weight iterator) and compare what it yields with the HF checkpoint."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import gguf

FLOAT_TYPES = ("F32", "F16", "BF16")
_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight")

# GLM-5.2's layout in small: full first layers, then shared ones reusing
# the previous full layer's top-k.
GLM52_INDEXER_TYPES = ["full", "full", "shared", "full", "shared"]


@dataclass
class Loaded:
    name_map: dict[str, str]
    weight_types: dict[str, str]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    qtypes: dict[str, int] = field(default_factory=dict)


def run_loader(path: Path, config) -> Loaded:
    """The loader's own steps for `path` (a file or a set's first shard).
    Asserts that no parameter is yielded twice."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.gguf_loader import GGUFModelLoader

    loader = GGUFModelLoader(LoadConfig(load_format="gguf"))
    model_config = SimpleNamespace(
        model=str(path), hf_config=config, revision=None, trust_remote_code=False
    )
    name_map = loader._get_gguf_weights_map(model_config)
    weight_types = loader._get_gguf_weight_type(model_config, str(path), name_map)
    loaded = Loaded(name_map, weight_types)
    for name, tensor in loader._get_weights_iterator(model_config, str(path), name_map):
        if name.endswith("qweight_type"):
            key = name.replace("qweight_type", "weight")
            assert key not in loaded.qtypes, f"type of {key} yielded twice"
            loaded.qtypes[key] = int(tensor)
            continue
        key = name.replace("qweight", "weight")
        assert key not in loaded.tensors, f"{key} yielded twice"
        loaded.tensors[key] = tensor
    assert set(loaded.qtypes) <= set(loaded.tensors), "type without data"
    return loaded


def expected_from_checkpoint(
    state: dict[str, torch.Tensor], layers: range, top_level: bool = True
) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor for the given decoder layers (plus the
    top-level tensors), routed experts stacked under expert 0: how GGUF
    stores them and how FusedMoE loads them."""
    expected: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if (int(m.group(1)) not in layers) if m else not top_level:
            continue
        if e := _EXPERT.fullmatch(name):
            experts.setdefault((e.group(1), e.group(3)), {})[int(e.group(2))] = tensor
        else:
            expected[name] = tensor
    for (prefix, proj), by_id in experts.items():
        stacked = torch.stack([by_id[i] for i in range(len(by_id))])
        expected[f"{prefix}.0.{proj}.weight"] = stacked
    return expected


def file_tensor_types(path: Path) -> dict[str, str]:
    """GGUF tensor name -> type name over the whole shard set."""
    import gguf
    from vllm.model_executor.model_loader.gguf_loader import GGUFModelLoader

    return {
        t.name: t.tensor_type.name
        for f in GGUFModelLoader._get_all_gguf_files(str(path))
        for t in gguf.GGUFReader(f).tensors
    }


def dequantized(loaded: Loaded, name: str) -> torch.Tensor:
    import gguf

    tensor = loaded.tensors[name]
    if name not in loaded.qtypes:
        return tensor
    qtype = gguf.GGMLQuantizationType(loaded.qtypes[name])
    return torch.from_numpy(gguf.quants.dequantize(tensor.numpy(), qtype))


def q8_0_bound(ref: torch.Tensor) -> torch.Tensor:
    """Per-element bound of Q8_0's error on `ref` (blocks of 32 along the
    last dim): half a step of amax/127 plus the fp16 rounding of the
    scale over up to 127 steps, with 1 % slack."""
    blocks = ref.double().reshape(-1, 32)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    bound = amax * (0.5 / 127 + 2.0**-11) * 1.01 + 1e-12
    return bound.expand_as(blocks).reshape(ref.shape)


def assert_matches(
    got: torch.Tensor, ref: torch.Tensor, type_name: str, what: str, bound=None
):
    assert tuple(got.shape) == tuple(ref.shape), (
        f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    )
    assert not torch.isnan(got).any(), f"{what}: NaN"
    if type_name in FLOAT_TYPES:
        # Converted without rounding beyond the target type: bit-exact.
        want = ref.to(got.dtype)
        diff = (got.double() - want.double()).abs().max()
        assert torch.equal(got, want), f"{what} ({type_name}): max |diff| {diff}"
        return
    assert type_name == "Q8_0", f"{what}: unexpected type {type_name}"
    bound = q8_0_bound(ref) if bound is None else bound
    err = (got.double() - ref.double()).abs()
    assert (err <= bound).all(), f"{what} (Q8_0): error {err.max()} over bound"
    rel = (err.norm() / ref.double().norm()).item()
    assert rel < 1e-2, f"{what} (Q8_0): relative error {rel}"


def write_gguf(
    dst: Path,
    reader: gguf.GGUFReader,
    tensors: list | None = None,
    *,
    metadata: bool = True,
    kv: dict | None = None,
    add: tuple = (),
    retype: dict | None = None,
    blocks: dict | None = None,
) -> Path:
    """Write `tensors` (default: all of `reader`'s) to `dst` with gguf-py's
    writer, with `reader`'s metadata (unless not `metadata`) edited by `kv`
    ({key: (value, type)}, value None drops the key), extra float tensors
    `add` ((name, array), ...), tensors of `retype` ({name: type}) stored
    in another type (zero bytes of the same logical shape) and tensors of
    `blocks` ({name: (type, uint8 blocks [..., bytes])}) stored as given."""
    import gguf
    import numpy as np
    from gguf import GGUFValueType as VType

    kv, retype, blocks = kv or {}, retype or {}, blocks or {}
    arch = str(reader.get_field("general.architecture").contents())
    writer = gguf.GGUFWriter(dst, arch)
    if metadata:
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name in kv:
                continue
            if field.name == "general.architecture":
                continue
            sub = field.types[-1] if field.types[0] == VType.ARRAY else None
            writer.add_key_value(
                field.name, field.contents(), field.types[0], sub_type=sub
            )
    for key, (value, vtype) in kv.items():
        if value is not None:
            writer.add_key_value(key, value, vtype)
    for tensor in reader.tensors if tensors is None else tensors:
        if tensor.name in blocks:
            qtype, data = blocks[tensor.name]
            writer.add_tensor(tensor.name, np.asarray(data, np.uint8), raw_dtype=qtype)
        elif (qtype := retype.get(tensor.name)) is not None:
            shape = [int(d) for d in reversed(tensor.shape)]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            data = np.zeros((*shape[:-1], shape[-1] // block * size), np.uint8)
            writer.add_tensor(tensor.name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    for name, array in add:
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
