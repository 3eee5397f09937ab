"""A MoE layer's routed experts may each have a GGUF type of their own
(llama.cpp's quantizer picks a type per tensor: "dynamic" mixtures,
per-tensor overrides). Gate and up experts of different quantized types
load, each half with its type, and the layer is listed for the split GGUF
MoE method (GGUFSplitMoEMethod; the built model: test_gguf_engine_load.py,
its math: tests/kernels/test_gguf_moe_split.py). Down experts of another
type, layers of different types, and shared experts or dense MLPs with gate
and up of different types (a type per shard) load as before. A layer that
mixes float and quantized experts is still refused (one MoE method per
layer), as are types without a kernel (test_gguf_file_vs_config.py)."""

from __future__ import annotations

import re

import gguf
import pytest
from gguf import GGMLQuantizationType as QType

from gguf_checks import run_loader, write_gguf

GATE = "model.layers.1.mlp.experts.0.gate_proj.weight"
UP = "model.layers.1.mlp.experts.0.up_proj.weight"


@pytest.mark.parametrize("up_type", [QType.Q4_0, QType.Q6_K, QType.IQ4_XS], ids=lambda t: t.name)
def test_gate_and_up_experts_of_different_types_load_split(
    tmp_path, glm_q8_0, glm_config, up_type
):
    """Each half arrives with its own type and its own bytes per row, and
    the layer is listed for GGUFSplitMoEMethod (no other layer is)."""
    from vllm.model_executor.model_loader.gguf_dsa import mla_gguf_split_gate_up

    dst = write_gguf(
        tmp_path / "mixed.gguf",
        glm_q8_0,
        retype={"blk.1.ffn_up_exps.weight": up_type},
    )
    loaded = run_loader(dst, glm_config())
    assert QType(loaded.qtypes[GATE]) == QType.Q8_0
    assert QType(loaded.qtypes[UP]) == up_type
    for name, qtype in ((GATE, QType.Q8_0), (UP, up_type)):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        assert tuple(loaded.tensors[name].shape) == (4, 64, 256 // block * size), name
    assert loaded.weight_types[UP] == up_type.name
    assert mla_gguf_split_gate_up(loaded.weight_types) == ["model.layers.1.mlp.experts"]


def test_float_and_quantized_halves_are_refused(tmp_path, glm_q8_0, glm_config):
    """A float up half with a quantized gate half: the layer's experts
    would need two MoE methods; refused naming the layer and the types."""
    from vllm.model_executor.model_loader.gguf_dsa import GGUFCheckpointError

    dst = write_gguf(
        tmp_path / "mixed.gguf",
        glm_q8_0,
        retype={"blk.1.ffn_up_exps.weight": QType.F16},
    )
    message = (
        r"routed experts of model\.layers\.1\.mlp\.experts mix float and quantized "
        rf"GGUF types \(.*{re.escape(repr(UP))}: 'F16'.*\); vLLM runs a layer's "
        r"experts with one method"
    )
    with pytest.raises(GGUFCheckpointError, match=message):
        run_loader(dst, glm_config())


def test_other_down_layer_shared_and_dense_types_load(tmp_path, glm_q8_0, glm_config):
    """Down experts have their own w2_qweight_type, each layer its own
    parameters, and MergedColumnParallelLinear (shared experts, dense MLP)
    a type per shard: these load, and no layer needs the split method."""
    from vllm.model_executor.model_loader.gguf_dsa import mla_gguf_split_gate_up

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
    assert loaded.weight_types[GATE] == "Q8_0"
    assert mla_gguf_split_gate_up(loaded.weight_types) == []
