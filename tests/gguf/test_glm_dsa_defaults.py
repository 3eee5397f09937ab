"""What GLM-5 (glm_moe_dsa) configs may leave out: sigmoid router scores
and an interleaved (GPT-J) indexer RoPE, which transformers' GlmMoeDsa and
llama.cpp's glm-dsa hard-code; DeepSeek-V3.2 keeps vLLM's defaults
(softmax unless its config says sigmoid, NeoX). Configs saved by
transformers' GlmMoeDsaConfig carry neither key, and vLLM then ran softmax
routing and a NeoX indexer without a word. An explicit key always wins.

The model-construction check is in test_gguf_engine_load.py
(test_indexer_rope_style_of_the_built_model)."""

from __future__ import annotations

import copy

import pytest
from transformers import DeepseekV32Config, GlmMoeDsaConfig


def _neox(config) -> bool:
    from vllm.model_executor.models.glm_dsa_defaults import indexer_rope_is_neox_style

    return indexer_rope_is_neox_style(config)


def _scoring(config) -> str:
    from vllm.model_executor.models.glm_dsa_defaults import router_scoring_func

    return router_scoring_func(config)


@pytest.mark.parametrize(
    "config_class, key, scoring",
    [
        (GlmMoeDsaConfig, None, "sigmoid"),  # GLM-5: sigmoid unless told
        (GlmMoeDsaConfig, "sigmoid", "sigmoid"),  # the official config.json
        (GlmMoeDsaConfig, "softmax", "softmax"),
        (DeepseekV32Config, None, "softmax"),  # vLLM's DeepSeek default
        (DeepseekV32Config, "sigmoid", "sigmoid"),  # DeepSeek-V3.2's config.json
    ],
)
def test_router_scoring(config_class, key, scoring):
    kwargs = {} if key is None else {"scoring_func": key}
    config = config_class(**kwargs)
    assert ("scoring_func" in config.to_dict()) == (key is not None)
    assert _scoring(config) == scoring


@pytest.mark.parametrize(
    "config_class, key, neox",
    [
        (GlmMoeDsaConfig, None, False),  # GLM-5: interleaved unless told
        (GlmMoeDsaConfig, True, False),  # the official GLM-5 config.json
        (GlmMoeDsaConfig, False, True),
        (DeepseekV32Config, None, True),  # DeepSeek-V3.2: NeoX unless told
        (DeepseekV32Config, False, True),
        (DeepseekV32Config, True, False),
    ],
)
def test_indexer_rope_style(config_class, key, neox):
    kwargs = {} if key is None else {"indexer_rope_interleave": key}
    config = config_class(**kwargs)
    assert ("indexer_rope_interleave" in config.to_dict()) == (key is not None)
    assert _neox(config) is neox


@pytest.mark.parametrize(
    "config_class, neox", [(GlmMoeDsaConfig, False), (DeepseekV32Config, True)]
)
def test_mtp_draft_keeps_the_targets_style(config_class, neox):
    """The MTP draft's config is the target's with model_type
    deepseek_mtp; its indexer rotates like the target's."""
    from vllm.config.speculative import SpeculativeConfig

    config = config_class(num_nextn_predict_layers=1)
    config.architectures = [config_class.__name__.replace("Config", "ForCausalLM")]
    draft = SpeculativeConfig.hf_config_override(copy.deepcopy(config))
    assert draft.model_type == "deepseek_mtp"
    assert _neox(draft) is neox
    assert _scoring(draft) == ("softmax" if neox else "sigmoid")
