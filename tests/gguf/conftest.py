"""Tiny random-weight GLM-5 / DeepSeek checkpoints, converted to GGUF by
llama.cpp's own converter (from the llama-cpp-python sdist of
llama-cpp-pin.txt) once per test session."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from gguf_checks import GLM52_INDEXER_TYPES
from support import llama_cpp_convert
from support.tiny_checkpoints import NEXTN_NORMS, write_checkpoint

# Real MLA head geometry; everything else tiny. Hidden sizes are multiples
# of 32 so that the converter quantizes to Q8_0 where a real file would.
_COMMON = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=128,
    moe_intermediate_size=64,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    q_lora_rank=128,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    first_k_dense_replace=1,
    max_position_embeddings=1024,
    topk_method="noaux_tc",
)
_DSA = dict(index_n_heads=4, index_head_dim=128, index_topk=16)


@dataclass(frozen=True)
class Checkpoint:
    name: str
    path: Path
    num_hidden_layers: int
    num_mtp_layers: int


@pytest.fixture(scope="session")
def llama_cpp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from patchseries.llama_cpp_sdist import extract_converter, sdist

    return extract_converter(sdist(), tmp_path_factory.mktemp("llama_cpp"))


def _random_nextn(hidden: int) -> dict:
    """A random NextN block (the GGUF tests check names, shapes and types)."""
    import torch

    return {"eh_proj.weight": torch.randn(hidden, 2 * hidden) * 0.02,
            **{f"{norm}.weight": 1 + 0.1 * torch.randn(hidden) for norm in NEXTN_NORMS}}


def _save_glm(path: Path, indexer_types: list[str] | None = None) -> Checkpoint:
    """GLM-5; with `indexer_types`, GLM-5.2, whose "shared" layers have no
    indexer of their own (they reuse the previous full layer's top-k, and
    transformers builds no indexer for them)."""
    geometry = dict(
        _COMMON,
        **_DSA,
        num_attention_heads=4,
        num_key_value_heads=4,
        qk_nope_head_dim=192,
        v_head_dim=256,
    )
    layers, mtp = 3, 1
    if indexer_types is not None:
        layers = len(indexer_types)
        geometry["indexer_types"] = indexer_types
    write_checkpoint(path, "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", geometry, layers, mtp,
                     seed=1234 if indexer_types is None else 5678,
                     nextn_tensors=_random_nextn, edit_state=_randomize_norms)
    return Checkpoint("glm" if indexer_types is None else "glm52", path, layers, mtp)


def _save_deepseek(path: Path, v32: bool) -> Checkpoint:
    # Odd head count, DeepSeek's qk_nope 128 / v_head 128.
    geometry = dict(
        num_attention_heads=3,
        num_key_value_heads=3,
        qk_nope_head_dim=128,
        v_head_dim=128,
        **_COMMON,
        **(_DSA if v32 else {}),
    )
    name = "V32" if v32 else "V3"
    # The config transformers writes: DeepSeek-V3's default of one NextN
    # layer stays, as in its published config.
    write_checkpoint(path, f"Deepseek{name}Config", f"Deepseek{name}ForCausalLM", geometry,
                     layers=2, seed=4321 + v32, edit_state=_randomize_norms, own_config=False)
    return Checkpoint("dsv32" if v32 else "dsv3", path, 2, 0)


def _randomize_norms(state: dict) -> None:
    import torch

    # Fresh init leaves norms at 1 and biases at 0; make every value count.
    for name, tensor in state.items():
        if tensor.ndim == 1:
            state[name] = tensor + 0.1 * torch.randn_like(tensor)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "glm": _save_glm(root / "glm"),
        "glm52": _save_glm(root / "glm52", GLM52_INDEXER_TYPES),
        "dsv3": _save_deepseek(root / "dsv3", v32=False),
        "dsv32": _save_deepseek(root / "dsv32", v32=True),
    }


# (checkpoint, variant): variant is an outtype, optionally with a suffix.
GGUF_VARIANTS = [
    ("glm", "f32"),
    ("glm", "f16"),
    ("glm", "bf16"),
    ("glm", "q8_0"),
    ("glm", "f16-split"),
    ("glm", "q8_0-legacy"),
    ("dsv3", "f16"),
    ("dsv3", "q8_0"),
    ("dsv3", "f32-legacy"),
    ("dsv32", "f16"),
    ("glm52", "f16"),
    ("glm52", "q8_0"),
]


@pytest.fixture(scope="session")
def gguf_files(
    tmp_path_factory: pytest.TempPathFactory,
    llama_cpp_dir: Path,
    checkpoints: dict[str, Checkpoint],
) -> dict[tuple[str, str], Path]:
    """(checkpoint, variant) -> GGUF path (first shard for split sets)."""
    out = tmp_path_factory.mktemp("gguf")
    jobs, files = [], {}
    for name, variant in GGUF_VARIANTS:
        outtype, _, suffix = variant.partition("-")
        job = {
            "model": str(checkpoints[name].path),
            "outtype": outtype,
            "outfile": str(out / f"{name}-{variant}.gguf"),
        }
        if suffix == "split":
            job["split_max_tensors"] = 30
        if suffix == "legacy":
            job["legacy_kv_b"] = True
        jobs.append(job)
    (out / "jobs.json").write_text(json.dumps(jobs))
    result = llama_cpp_convert.run(llama_cpp_dir, out / "jobs.json", capture_output=True,
                                   text=True)
    assert result.returncode == 0, (
        f"llama.cpp converter failed:\n{result.stderr[-4000:]}"
    )
    for (name, variant), job in zip(GGUF_VARIANTS, jobs, strict=True):
        path = Path(job["outfile"])
        if variant.endswith("-split"):
            shards = sorted(out.glob(f"{path.stem}-0*-of-*.gguf"))
            assert len(shards) > 1, f"converter wrote no shard set for {path.name}"
            path = shards[0]
        assert path.is_file(), f"converter wrote no {path.name}"
        files[(name, variant)] = path
    return files


@pytest.fixture(scope="session")
def glm_config(checkpoints):
    """A fresh config of the tiny GLM-5, as vLLM reads it, on each call."""
    from vllm.transformers_utils.config import get_config

    return lambda: get_config(checkpoints["glm"].path, trust_remote_code=False)


@pytest.fixture(scope="session")
def glm_q8_0(gguf_files):
    """The tiny GLM-5's Q8_0 file (experts all Q8_0), to retype tensors of."""
    import gguf

    src = gguf.GGUFReader(gguf_files[("glm", "q8_0")])
    assert {t.tensor_type for t in src.tensors if "_exps" in t.name} == {
        gguf.GGMLQuantizationType.Q8_0}
    return src
