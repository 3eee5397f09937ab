"""Routed gate and up experts (ffn_gate_exps, ffn_up_exps) load into one
fused w13 parameter that vLLM 0.23's GGUF MoE method runs with one GGUF
type: a file whose gate and up experts of a layer differ in type is
refused before loading, naming both tensors and their types. Down experts
of another type, layers of different types, and shared experts or dense
MLPs with gate and up of different types (a type per shard) still load."""

from __future__ import annotations

import re

import gguf
import pytest
from gguf import GGMLQuantizationType as QType

from gguf_checks import run_loader, write_gguf


@pytest.fixture(scope="module")
def glm_config(checkpoints):
    from vllm.transformers_utils.config import get_config

    return lambda: get_config(checkpoints["glm"].path, trust_remote_code=False)


@pytest.fixture(scope="module")
def glm_q8_0(gguf_files):
    src = gguf.GGUFReader(gguf_files[("glm", "q8_0")])
    assert {t.tensor_type for t in src.tensors if "_exps" in t.name} == {QType.Q8_0}
    return src


@pytest.mark.parametrize("up_type", [QType.Q4_0, QType.F16], ids=lambda t: t.name)
def test_gate_and_up_experts_of_different_types_are_refused(
    tmp_path, glm_q8_0, glm_config, up_type
):
    """The fused w13 keeps one qweight_type: the other half decoded as
    garbage or NaN without a word. The error names file, both tensors and
    their types."""
    from vllm.model_executor.model_loader.gguf_dsa import GGUFCheckpointError

    dst = write_gguf(
        tmp_path / "mixed.gguf",
        glm_q8_0,
        retype={"blk.1.ffn_up_exps.weight": up_type},
    )
    message = (
        f"{re.escape(str(dst))}: routed experts of layer 1 mix GGUF types "
        r"within the fused gate/up weight: blk\.1\.ffn_gate_exps\.weight is "
        rf"Q8_0, blk\.1\.ffn_up_exps\.weight is {up_type.name}; vLLM 0\.23's "
        r"GGUF MoE kernel takes one type for both"
    )
    with pytest.raises(GGUFCheckpointError, match=message):
        run_loader(dst, glm_config())


def test_other_down_layer_shared_and_dense_types_load(tmp_path, glm_q8_0, glm_config):
    """Down experts have their own w2_qweight_type, each layer its own
    parameters, and MergedColumnParallelLinear (shared experts, dense MLP)
    a type per shard: none of these is refused."""
    retype = {
        "blk.1.ffn_down_exps.weight": QType.Q4_0,  # w2 != w13 in layer 1
        "blk.2.ffn_gate_exps.weight": QType.Q4_0,  # layer 2 != layer 1
        "blk.2.ffn_up_exps.weight": QType.Q4_0,
        "blk.1.ffn_up_shexp.weight": QType.Q4_0,  # shared gate Q8_0, up Q4_0
        "blk.0.ffn_up.weight": QType.Q4_0,  # dense gate Q8_0, up Q4_0
    }
    dst = write_gguf(tmp_path / "mixed.gguf", glm_q8_0, retype=retype)
    loaded = run_loader(dst, glm_config())
    got = {
        gguf_name: QType(loaded.qtypes[hf_name]).name
        for gguf_name, hf_name in loaded.name_map.items()
        if gguf_name in retype
    }
    assert got == {name: qtype.name for name, qtype in retype.items()}
    gate = "model.layers.1.mlp.experts.0.gate_proj.weight"
    assert loaded.weight_types[gate] == "Q8_0"
