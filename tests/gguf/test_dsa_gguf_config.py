"""A DSA GGUF (glm-dsa, deepseek32) started without the original model's
config says what to pass, instead of transformers' "architecture ... is
not supported yet" (issue 16, item 10)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("name", ["glm", "dsv32"])
def test_dsa_gguf_without_hf_config_path_says_what_to_pass(gguf_files, name):
    from vllm.config import ModelConfig

    path = gguf_files[(name, "f16")]
    with pytest.raises(Exception) as excinfo:
        ModelConfig(model=str(path), quantization="gguf", skip_tokenizer_init=True)
    message = str(excinfo.value)
    assert "--hf-config-path" in message and "--tokenizer" in message, message
    assert str(path) in message and "not supported yet" not in message


def test_dsa_gguf_with_hf_config_path_reads_that_config(checkpoints, gguf_files):
    from vllm.config import ModelConfig

    config = ModelConfig(
        model=str(gguf_files[("glm", "f16")]),
        hf_config_path=str(checkpoints["glm"].path),
        quantization="gguf",
        skip_tokenizer_init=True,
    )
    assert config.hf_config.model_type == "glm_moe_dsa"
