"""The types of the published low-bit files (Q2_K, Q3_K, IQ4_XS, IQ3_XXS,
IQ2_XXS, IQ1_M, and the fallbacks IQ4_NL and Q4_0 llama.cpp gives tensors
whose rows do not fit a 256 block) through the series' loader, without
llama.cpp's tools: the GLM-5 Q8_0 file with every tensor llama.cpp would
quantize that fits the type's blocks in that type (zero blocks; llama.cpp's quantizer makes the
real files, tests/e2e/test_low_bit_files.py). Every tensor is read: the
quantized ones with their type and bytes, the float-only ones (indexer wk
and weights_proj, the MLA k_b/v_b factors) dequantized."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from transformers import AutoConfig

from gguf_checks import run_loader, write_gguf

TYPES = [QType.Q2_K, QType.Q3_K, QType.IQ4_XS, QType.IQ3_XXS, QType.IQ2_XXS, QType.IQ1_M,
         QType.IQ4_NL, QType.Q4_0]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_tensor_of_a_low_bit_type_is_read(tmp_path, checkpoints, gguf_files, qtype):
    src = gguf.GGUFReader(gguf_files[("glm", "q8_0")])
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    # what llama.cpp's quantizer quantizes: 2D/3D weights but norms and the router
    retype = {t.name: qtype for t in src.tensors
              if len(t.shape) >= 2 and t.name.endswith(".weight") and "norm" not in t.name
              and "ffn_gate_inp" not in t.name and int(t.shape[0]) % block == 0}
    # the routed experts, attention and the indexer are among them
    for name in ("blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight",
                 "blk.1.attn_q_a.weight", "blk.1.attn_v_b.weight",
                 "blk.1.indexer.attn_k.weight", "blk.1.indexer.proj.weight"):
        assert name in retype, name
    config = AutoConfig.from_pretrained(checkpoints["glm"].path)
    loaded = run_loader(write_gguf(tmp_path / "low.gguf", src, retype=retype), config)
    q8_0 = run_loader(gguf_files[("glm", "q8_0")], config)
    assert sorted(loaded.tensors) == sorted(q8_0.tensors)
    for gguf_name, name in loaded.name_map.items():
        if name not in loaded.tensors or "kv_b_proj" in name:  # NextN; kv_b (below)
            continue
        tensor = loaded.tensors[name]
        if gguf_name not in retype:
            assert torch.equal(tensor, q8_0.tensors[name]), name
        elif name in loaded.qtypes:
            assert QType(loaded.qtypes[name]) == qtype, name
            assert tensor.dtype == torch.uint8 and not tensor.any(), name
        else:  # a float-only layer: dequantized (zero blocks: zeros)
            assert tensor.dtype.is_floating_point and not tensor.any(), name
            assert tuple(tensor.shape) == tuple(q8_0.tensors[name].shape), name
    nope = config.qk_nope_head_dim
    for layer in range(checkpoints["glm"].num_hidden_layers):
        kv_b = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        # rebuilt from its factors: zeros where a factor was retyped
        got, ref = (t[kv_b].float().view(config.num_attention_heads, -1, config.kv_lora_rank)
                    for t in (loaded.tensors, q8_0.tensors))
        for rows, factor in ((slice(None, nope), "attn_k_b"), (slice(nope, None), "attn_v_b")):
            if f"blk.{layer}.{factor}.weight" in retype:
                assert not got[:, rows].any(), (kv_b, factor)
            else:
                assert torch.equal(got[:, rows], ref[:, rows]), (kv_b, factor)
