"""--cpu-offload-gb is refused for GGUF checkpoints when the engine config
is made (patch 0038): vLLM's UVA offloader picks the weights to offload
while the model is built, before a GGUF weight exists, so it would offload
none of the quantized weights."""

from __future__ import annotations

import pytest
import torch


def _engine_config(monkeypatch, model: str, config_dir: str, **offload):
    import vllm.engine.arg_utils as arg_utils
    from vllm.config import DeviceConfig
    from vllm.engine.arg_utils import EngineArgs

    # No accelerator on CPU test machines; the device plays no part here.
    monkeypatch.setattr(arg_utils, "DeviceConfig", lambda device: DeviceConfig("cpu"))
    args = EngineArgs(model=model, hf_config_path=config_dir, tokenizer=config_dir,
                      **offload)
    return args.create_engine_config()


@pytest.mark.parametrize("offload", [
    {"cpu_offload_gb": 4},
    {"cpu_offload_gb": 0.5, "offload_backend": "uva"},
    {"cpu_offload_gb": 4, "cpu_offload_params": {"experts"}},
], ids=["auto", "uva", "some-params"])
def test_uva_offload_of_a_gguf_is_refused_naming_the_argument(
    monkeypatch, checkpoints, gguf_files, offload
):
    config_dir = str(checkpoints["glm"].path)
    model = str(gguf_files[("glm", "q8_0")])
    with pytest.raises(ValueError, match=(
        rf"--cpu-offload-gb {offload['cpu_offload_gb']:g} cannot offload a GGUF "
        r"checkpoint: .* Leave --cpu-offload-gb out")):
        _engine_config(monkeypatch, model, config_dir, **offload)


@pytest.mark.parametrize("offload", [
    {},
    {"cpu_offload_gb": 0},
    # the prefetch offloader chooses layers, not bytes (not run on a GPU
    # with a GGUF); cpu_offload_gb is unused beside it
    {"offload_group_size": 4, "offload_num_in_group": 1},
    {"offload_group_size": 4, "offload_num_in_group": 1, "cpu_offload_gb": 4},
], ids=["none", "zero", "prefetch", "prefetch-and-gb"])
def test_a_gguf_without_uva_offload_gets_its_config(
    monkeypatch, checkpoints, gguf_files, offload
):
    config_dir = str(checkpoints["glm"].path)
    model = str(gguf_files[("glm", "q8_0")])
    config = _engine_config(monkeypatch, model, config_dir, **offload)
    assert config.model_config.quantization == "gguf"
    assert config.device_config.device == torch.device("cpu")


def test_a_float_checkpoint_keeps_cpu_offload(monkeypatch, checkpoints):
    config_dir = str(checkpoints["glm"].path)
    config = _engine_config(monkeypatch, config_dir, config_dir, cpu_offload_gb=4)
    assert config.model_config.quantization is None
    assert config.offload_config.uva.cpu_offload_gb == 4
