"""vLLM's GGUF loader run the way it runs for real (name map, weight types,
weight iterator), and what it yields set beside a Hugging Face checkpoint:
shared by the CPU GGUF tests (tests/gguf) and the end-to-end test models'
checks (tests/e2e)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight")


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
