"""GGUF checkpoints skip the speculators probe (patch 0003)."""

from __future__ import annotations

import types

import pytest
import torch


class _Reached(Exception):
    pass


def test_engine_config_for_gguf_with_hf_config_path(
    monkeypatch, checkpoints, gguf_files
):
    """Without the patch the probe makes transformers parse the GGUF, which
    rejects arch glm-dsa; with it, engine config creation gets to the model
    config, which comes from --hf-config-path."""
    import vllm.engine.arg_utils as arg_utils
    from vllm.engine.arg_utils import EngineArgs

    create_model_config = EngineArgs.create_model_config

    def stop_after_model_config(self):
        raise _Reached(create_model_config(self))

    monkeypatch.setattr(EngineArgs, "create_model_config", stop_after_model_config)
    # No accelerator on CPU test machines; the device plays no part here.
    monkeypatch.setattr(
        arg_utils,
        "DeviceConfig",
        lambda device: types.SimpleNamespace(
            device=torch.device("cpu"), device_type="cpu"
        ),
    )
    config_dir = str(checkpoints["glm"].path)
    gguf = str(gguf_files[("glm", "q8_0")])
    args = EngineArgs(model=gguf, hf_config_path=config_dir, tokenizer=config_dir)
    with pytest.raises(_Reached) as reached:
        args.create_engine_config()
    model_config = reached.value.args[0]
    assert model_config.hf_config.model_type == "glm_moe_dsa"
    assert model_config.quantization == "gguf"


@pytest.mark.parametrize(
    "reference",
    [
        "local file",
        "local shard",
        "unsloth/GLM-5-GGUF:Q4_K_M",
        "unsloth/GLM-5-GGUF/GLM-5-Q8_0.gguf",
    ],
)
def test_gguf_references_are_not_probed(monkeypatch, gguf_files, reference):
    from vllm.transformers_utils import config as config_module

    model = {
        "local file": str(gguf_files[("glm", "f16")]),
        "local shard": str(gguf_files[("glm", "f16-split")]),
    }.get(reference, reference)

    def probe(*args, **kwargs):
        raise AssertionError(f"probed {args} {kwargs}")

    monkeypatch.setattr(config_module.PretrainedConfig, "get_config_dict", probe)
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    assert config_module.maybe_override_with_speculators(
        model=model,
        tokenizer="tok",
        trust_remote_code=False,
        vllm_speculative_config=spec,
    ) == (model, "tok", spec)


def test_other_models_are_still_probed(monkeypatch, checkpoints):
    from vllm.transformers_utils import config as config_module

    probed = []
    real = config_module.PretrainedConfig.get_config_dict

    def spy(*args, **kwargs):
        probed.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(config_module.PretrainedConfig, "get_config_dict", spy)
    model = str(checkpoints["glm"].path)
    assert config_module.maybe_override_with_speculators(
        model=model, tokenizer=None, trust_remote_code=False
    ) == (model, None, None)
    assert probed
