"""MTP speculative decoding from a DSA GGUF: the draft is the target's own
file, so its ModelConfig must read the config the target was given with
--hf-config-path (the GGUF metadata does not describe the DSA indexer;
the series refuses a DSA GGUF without one, patch "config: DSA GGUFs
without --hf-config-path say which config they need")."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("name", ["glm", "glm52"])
def test_mtp_draft_of_a_gguf_reads_the_targets_hf_config(
    checkpoints, gguf_files, name
):
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.config.speculative import SpeculativeConfig

    hf_dir = str(checkpoints[name].path)
    target = ModelConfig(
        model=str(gguf_files[(name, "f16")]),
        hf_config_path=hf_dir,
        tokenizer=hf_dir,
        skip_tokenizer_init=True,
        quantization="gguf",
        max_model_len=256,
    )
    spec = SpeculativeConfig(
        method="mtp",
        num_speculative_tokens=1,
        target_model_config=target,
        target_parallel_config=ParallelConfig(),
    )
    draft = spec.draft_model_config
    assert draft.model == target.model
    assert draft.hf_config_path == hf_dir
    assert draft.hf_config.model_type == "deepseek_mtp"
    assert draft.hf_config.num_nextn_predict_layers == checkpoints[name].num_mtp_layers
    assert draft.hf_config.index_topk == target.hf_config.index_topk
    assert getattr(draft.hf_config, "indexer_types", None) == getattr(
        target.hf_config, "indexer_types", None
    )
