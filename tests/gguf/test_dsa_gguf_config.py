"""A DSA GGUF (glm-dsa, deepseek32) started without the original model's
config says what to pass, instead of transformers' "architecture ... is
not supported yet" (issue 16, item 10)."""

from __future__ import annotations

import pytest

from gguf_checks import write_small_gguf


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


def test_the_architecture_is_read_without_parsing_the_metadata(gguf_files, monkeypatch, tmp_path):
    """The config check reads general.architecture alone where llama.cpp's
    writers put it, first (every file the converter wrote here, a split
    set's first shard among them; both byte orders); a file with another
    field first is parsed whole, with the same answer."""
    import gguf
    from vllm.transformers_utils import gguf_utils

    first = {str(path): None for path in gguf_files.values()}
    for endianess in (gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG):
        first[str(write_small_gguf(tmp_path / f"first-{endianess.name}.gguf", endianess))] = None
    last = [write_small_gguf(tmp_path / f"last-{e.name}.gguf", e, arch_first=False)
            for e in (gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG)]
    for path in [*first, *last]:
        reader = gguf.GGUFReader(path)
        assert (list(reader.fields)[3] == gguf.Keys.General.ARCHITECTURE) == (path in first)
        arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
        assert arch in ("glm-dsa", "deepseek2", "deepseek32"), path
        if path in first:
            first[path] = arch
        else:
            assert gguf_utils._gguf_architecture(path) == arch

    def no_parse(*args, **kwargs):
        raise AssertionError("parsed the whole file")

    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    for path, arch in first.items():
        assert gguf_utils._gguf_architecture(path) == arch, path
