"""The engine config of a GGUF checkpoint: --cpu-offload-gb is refused
(patch 0038: vLLM's UVA offloader picks the weights to offload while the
model is built, before a GGUF weight exists, so it would offload none of
the quantized weights); --dtype auto takes float16 where vLLM's GGUF
kernels refuse the config's bfloat16 (patch 0039: Blackwell); a DSA GGUF's
tokenizer is its --hf-config-path's unless --tokenizer says otherwise
(patch 0040: transformers cannot read these files' tokenizer); a folder of
GGUF files is refused naming the file to pass (patch 0041); so is expert
parallelism (patch 0042: the GGUF MoE layers cannot divide their experts)."""

from __future__ import annotations

import json
import re
import shutil
import types
from pathlib import Path

import pytest
import torch

_CONFIG_DIR = object()


def _engine_config(monkeypatch, model: str, config_dir: str, tokenizer=_CONFIG_DIR,
                   **args):
    import vllm.engine.arg_utils as arg_utils
    from vllm.config import DeviceConfig
    from vllm.engine.arg_utils import EngineArgs

    # No accelerator on CPU test machines; the device plays no part here.
    monkeypatch.setattr(arg_utils, "DeviceConfig", lambda device: DeviceConfig("cpu"))
    if tokenizer is _CONFIG_DIR:
        tokenizer = config_dir
    engine_args = EngineArgs(model=model, hf_config_path=config_dir, tokenizer=tokenizer,
                             **args)
    return engine_args.create_engine_config()


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


def _gguf_kernels_on(monkeypatch, capability: int) -> None:
    """vLLM's GGUF quantization sees a GPU of this capability (major * 10 +
    minor); its dtypes depend on it (bfloat16 refused from 10.0)."""
    import vllm.model_executor.layers.quantization.gguf as gguf_quant

    monkeypatch.setattr(gguf_quant, "current_platform", types.SimpleNamespace(
        has_device_capability=lambda c: c <= capability))


@pytest.mark.parametrize("capability", [100, 120])
def test_auto_dtype_of_a_gguf_on_blackwell_is_float16(
    monkeypatch, checkpoints, gguf_files, capability
):
    _gguf_kernels_on(monkeypatch, capability)
    config_dir = str(checkpoints["glm"].path)
    model = str(gguf_files[("glm", "q8_0")])
    config = _engine_config(monkeypatch, model, config_dir)
    assert config.model_config.dtype == torch.float16


@pytest.mark.parametrize("dtype, wanted", [
    ("float16", torch.float16),
    ("float32", torch.float32),
    ("bfloat16", None),  # asked for: refused as before
])
def test_a_dtype_asked_for_is_kept_on_blackwell(
    monkeypatch, checkpoints, gguf_files, dtype, wanted
):
    _gguf_kernels_on(monkeypatch, 120)
    config_dir = str(checkpoints["glm"].path)
    model = str(gguf_files[("glm", "q8_0")])
    if wanted is None:
        with pytest.raises(ValueError, match="bfloat16 is not supported for "
                                             "quantization method gguf"):
            _engine_config(monkeypatch, model, config_dir, dtype=dtype)
        return
    config = _engine_config(monkeypatch, model, config_dir, dtype=dtype)
    assert config.model_config.dtype == wanted


def test_auto_dtype_elsewhere_stays_the_configs(monkeypatch, checkpoints, gguf_files):
    _gguf_kernels_on(monkeypatch, 90)
    config_dir = str(checkpoints["glm"].path)
    model = str(gguf_files[("glm", "q8_0")])
    config = _engine_config(monkeypatch, model, config_dir)
    assert config.model_config.dtype == torch.bfloat16


def test_auto_dtype_of_a_float_checkpoint_on_blackwell_stays(monkeypatch, checkpoints):
    _gguf_kernels_on(monkeypatch, 120)
    config_dir = str(checkpoints["glm"].path)
    config = _engine_config(monkeypatch, config_dir, config_dir)
    assert config.model_config.dtype == torch.bfloat16


def _with_tokenizer(checkpoint: Path, out: Path) -> str:
    """A copy of the checkpoint's config with a word-level tokenizer, as the
    original model's repository has its config and tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    out.mkdir()
    shutil.copy(checkpoint / "config.json", out)
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "the": 1, "tokenizer": 2},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}))
    return str(out)


@pytest.mark.parametrize("name", ["glm", "glm52", "dsv32"])
def test_a_dsa_gguf_takes_its_tokenizer_from_its_config_path(
    monkeypatch, checkpoints, gguf_files, tmp_path, name
):
    from vllm.tokenizers import cached_tokenizer_from_config

    config_dir = _with_tokenizer(checkpoints[name].path, tmp_path / name)
    config = _engine_config(monkeypatch, str(gguf_files[(name, "f16")]), config_dir,
                            tokenizer=None)
    assert config.model_config.tokenizer == config_dir
    tokenizer = cached_tokenizer_from_config(config.model_config)
    assert tokenizer.encode("the tokenizer", add_special_tokens=False) == [1, 2]


def test_a_tokenizer_asked_for_is_kept(monkeypatch, checkpoints, gguf_files):
    other = str(checkpoints["dsv32"].path)
    config = _engine_config(monkeypatch, str(gguf_files[("glm", "f16")]),
                            str(checkpoints["glm"].path), tokenizer=other)
    assert config.model_config.tokenizer == other


def test_a_gguf_of_another_architecture_keeps_its_own_tokenizer(
    monkeypatch, checkpoints, gguf_files
):
    model = str(gguf_files[("dsv3", "f16")])  # DeepSeek-V3: deepseek2, no DSA
    config = _engine_config(monkeypatch, model, str(checkpoints["dsv3"].path),
                            tokenizer=None)
    assert config.model_config.tokenizer == model


@pytest.mark.parametrize("name,dsa", [("glm", True), ("dsv32", True), ("dsv3", False)])
def test_a_remote_gguf_takes_its_tokenizer_by_its_configs_model_type(
    checkpoints, tmp_path, name, dsa
):
    """A remote GGUF (repo:type) is downloaded after the engine config, its
    tokenizer with it: the config it is given says whether it is a DSA
    model, as a local file's header does."""
    from vllm.transformers_utils.gguf_utils import gguf_default_tokenizer

    remote = "someone/GLM-5-GGUF:Q4_K_M"
    config_dir = str(checkpoints[name].path)
    assert gguf_default_tokenizer(remote, config_dir) == (config_dir if dsa else remote)
    assert gguf_default_tokenizer(remote, None) == remote
    # a config that cannot be read is left to vLLM's own config load
    assert gguf_default_tokenizer(remote, str(tmp_path / "missing")) == remote


def test_a_broken_gguf_s_tokenizer_is_left_to_the_loader(
    monkeypatch, checkpoints, gguf_files, tmp_path
):
    """A file whose header does not parse keeps the model as its tokenizer
    here; the loader then names the file and what is wrong with it."""
    src = gguf_files[("glm", "f16")]
    broken = tmp_path / "cut.gguf"
    broken.write_bytes(src.read_bytes()[:40])
    config = _engine_config(monkeypatch, str(broken), str(checkpoints["glm"].path),
                            tokenizer=None)
    assert config.model_config.tokenizer == str(broken)


def _directory_of(first: Path, out: Path, digits: int = 5) -> Path:
    """A folder holding one GGUF file, or every shard of a split set, the
    shards numbered with `digits` digits (the loader finds any width)."""
    out.mkdir()
    stem = re.sub(r"-00001-of-\d{5}\.gguf$", "", first.name)
    files = [first] if stem == first.name else sorted(first.parent.glob(f"{stem}-*.gguf"))
    for f in files:
        name = re.sub(r"-0*(\d+)-of-0*(\d+)\.gguf$",
                      lambda m: f"-{int(m[1]):0{digits}d}-of-{int(m[2]):0{digits}d}.gguf",
                      f.name)
        (out / name).symlink_to(f)
    return out


@pytest.mark.parametrize("variant,digits", [("q8_0", 5), ("f16-split", 5),
                                            ("f16-split", 2)])
def test_a_directory_of_gguf_files_names_the_file_to_pass(
    monkeypatch, checkpoints, gguf_files, tmp_path, variant, digits
):
    first = gguf_files[("glm", variant)]
    folder = _directory_of(first, tmp_path / "model", digits)
    names = sorted(p.name for p in folder.iterdir())
    assert (len(names) > 1) == variant.endswith("split")
    with pytest.raises(ValueError, match=(
        rf"{re.escape(str(folder))} is a directory of GGUF files: pass the file itself "
        rf".*: {re.escape(str(folder / names[0]))}$")):
        _engine_config(monkeypatch, str(folder), str(checkpoints["glm"].path))


def test_a_checkpoint_directory_with_a_gguf_beside_is_a_checkpoint(
    monkeypatch, checkpoints, gguf_files, tmp_path
):
    folder = tmp_path / "model"
    shutil.copytree(checkpoints["glm"].path, folder)
    (folder / "extra.gguf").symlink_to(gguf_files[("glm", "q8_0")])
    config = _engine_config(monkeypatch, str(folder), str(folder))
    assert config.model_config.quantization is None


def test_expert_parallel_of_a_gguf_is_refused(monkeypatch, checkpoints, gguf_files):
    with pytest.raises(ValueError, match=(
        r"--enable-expert-parallel cannot split a GGUF checkpoint's routed experts: "
        r".* Leave it out")):
        _engine_config(monkeypatch, str(gguf_files[("glm", "q8_0")]),
                       str(checkpoints["glm"].path), enable_expert_parallel=True)


def test_a_float_checkpoint_keeps_expert_parallel(monkeypatch, checkpoints):
    config_dir = str(checkpoints["glm"].path)
    config = _engine_config(monkeypatch, config_dir, config_dir,
                            enable_expert_parallel=True)
    assert config.parallel_config.enable_expert_parallel
