"""Broken or mismatched GGUF input fails early with the cause, not with a
traceback from deep inside the loader (patches 0001 and 0002)."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import pytest
from transformers import AutoConfig

from gguf_checks import run_loader, write_gguf


def _edit_header(src: Path, dst: Path, old: bytes, new: bytes) -> Path:
    """Copy `src` with `old` replaced by `new` (same length) in the metadata
    and tensor-info header only, leaving tensor data and offsets intact."""
    assert len(old) == len(new)
    header_end = gguf.GGUFReader(src).data_offset
    data = bytearray(src.read_bytes())
    header = bytes(data[:header_end])
    assert old in header, f"{old!r} not in the header of {src.name}"
    data[:header_end] = header.replace(old, new)
    dst.write_bytes(bytes(data))
    return dst


@pytest.fixture(scope="module")
def glm_config(checkpoints):
    return AutoConfig.from_pretrained(checkpoints["glm"].path)


def test_unknown_gguf_arch_is_named(tmp_path, gguf_files, glm_config):
    from vllm.model_executor.model_loader.gguf_dsa import GGUFCheckpointError

    src = gguf_files[("glm", "f16")]
    bad = _edit_header(src, tmp_path / "odd-arch.gguf", b"glm-dsa", b"glm-zzz")
    with pytest.raises(GGUFCheckpointError, match="'glm-zzz'"):
        run_loader(bad, glm_config)


def test_gguf_arch_not_matching_the_config_is_named(gguf_files, glm_config):
    from vllm.model_executor.model_loader.gguf_dsa import GGUFCheckpointError

    with pytest.raises(GGUFCheckpointError, match="'deepseek2'.*'glm_moe_dsa'"):
        run_loader(gguf_files[("dsv3", "f16")], glm_config)


@pytest.mark.parametrize(
    "hidden, named",
    [
        (["attn_v_b"], "blk.1.attn_v_b.weight"),
        (["attn_k_b"], "blk.1.attn_k_b.weight"),
        (["attn_k_b", "attn_v_b"], "blk.1.attn_k_b.weight"),
    ],
)
def test_missing_mla_factor_is_named(tmp_path, gguf_files, glm_config, hidden, named):
    from vllm.model_executor.model_loader.gguf_dsa import GGUFCheckpointError

    path = gguf_files[("glm", "q8_0")]
    for i, tensor in enumerate(hidden):
        # Rename the tensor in place: the file keeps a consistent layout.
        old = f"blk.1.{tensor}.weight".encode()
        new = f"blk.1.{tensor[:-1]}X.weight".encode()
        path = _edit_header(path, tmp_path / f"no-factor-{i}.gguf", old, new)
    with pytest.raises(GGUFCheckpointError, match=named.replace(".", r"\.")):
        run_loader(path, glm_config)


@pytest.mark.parametrize("keep", ["header", "data"])
def test_truncated_file(tmp_path, gguf_files, glm_config, keep):
    from vllm.model_executor.model_loader.gguf_dsa import GGUFCheckpointError

    src = gguf_files[("glm", "q8_0")]
    data = src.read_bytes()
    cut = 200 if keep == "header" else len(data) - 4096
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(GGUFCheckpointError, match="truncated"):
        run_loader(bad, glm_config)


def test_shard_set_with_a_missing_shard(tmp_path, gguf_files, glm_config):
    from vllm.model_executor.model_loader.gguf_loader import GGUFModelLoader

    first = gguf_files[("glm", "f16-split")]
    shards = GGUFModelLoader._get_all_gguf_files(str(first))
    for shard in shards:
        if "-00002-of-" not in shard:
            shutil.copy(shard, tmp_path)
    missing = Path(shards[1]).name
    with pytest.raises(FileNotFoundError, match=missing):
        run_loader(tmp_path / first.name, glm_config)


def test_mtp_draft_from_a_file_without_the_block(checkpoints, gguf_files):
    import copy

    from vllm.config.speculative import SpeculativeConfig
    from vllm.model_executor.model_loader.gguf_dsa import GGUFCheckpointError

    # DeepSeek-V3's converter drops the NextN block.
    config = AutoConfig.from_pretrained(checkpoints["dsv3"].path)
    config.num_nextn_predict_layers = 1
    draft = SpeculativeConfig.hf_config_override(copy.deepcopy(config))
    with pytest.raises(GGUFCheckpointError, match="no NextN/MTP block blk.2"):
        run_loader(gguf_files[("dsv3", "q8_0")], draft)


@pytest.mark.parametrize(
    "file_of, config_of, named",
    [
        # A GLM-5.2 file under GLM-5's config: shared layers lack indexers.
        ("glm52", "glm", r"layers \[2, 4\] have no blk\.N\.indexer"),
        # A GLM-5.2 config that marks a full layer of the file shared.
        ("glm52", "glm52-more-shared", r"layers \[3\] carry blk\.N\.indexer"),
    ],
)
def test_indexer_layout_disagreeing_with_the_config(
    checkpoints, gguf_files, file_of, config_of, named
):
    from vllm.model_executor.model_loader.gguf_dsa import GGUFCheckpointError

    config = AutoConfig.from_pretrained(checkpoints[config_of.split("-")[0]].path)
    if config_of == "glm":
        config.num_hidden_layers = checkpoints["glm52"].num_hidden_layers
        config.indexer_types = None
    if config_of.endswith("more-shared"):
        config.indexer_types = ["full", "full", "shared", "shared", "shared"]
    with pytest.raises(GGUFCheckpointError, match=named):
        run_loader(gguf_files[(file_of, "f16")], config)


def _name(name: bytes) -> bytes:
    """A tensor name as the GGUF header stores it (uint64 length first), so
    that "output.weight" does not also match "blk.N.attn_output.weight"."""
    return len(name).to_bytes(8, "little") + name


@pytest.mark.parametrize(
    "old, new, named",
    [
        # noaux_tc routing (the tiny checkpoints' topk_method) needs the bias.
        (b"blk.1.exp_probs_b.bias", b"blk.1.exp_probs_X.bias", "blk.1.exp_probs_b.bias"),
        # The config does not tie the head to the embeddings.
        (_name(b"output.weight"), _name(b"outpuX.weight"), "'output.weight'"),
    ],
    ids=["router-bias", "output"],
)
def test_missing_required_tensor_is_named(
    tmp_path, gguf_files, glm_config, old, new, named
):
    from vllm.model_executor.model_loader.gguf_dsa import GGUFCheckpointError

    assert glm_config.topk_method == "noaux_tc"
    assert not glm_config.tie_word_embeddings
    bad = _edit_header(gguf_files[("glm", "f16")], tmp_path / "lacks.gguf", old, new)
    with pytest.raises(GGUFCheckpointError, match=named.replace(".", r"\.")):
        run_loader(bad, glm_config)


def test_output_may_be_missing_when_the_config_ties_it(
    tmp_path, gguf_files, glm_config
):
    import copy

    config = copy.deepcopy(glm_config)
    config.tie_word_embeddings = True
    reader = gguf.GGUFReader(gguf_files[("glm", "f16")])
    tied = write_gguf(tmp_path / "tied.gguf", reader,
                      [t for t in reader.tensors if t.name != "output.weight"])
    loaded = run_loader(tied, config)
    assert "lm_head.weight" not in loaded.tensors


def _dims(*dims: int) -> bytes:
    """A 2-D tensor's n_dims and ne[] as the GGUF header stores them."""
    return len(dims).to_bytes(4, "little") + b"".join(
        d.to_bytes(8, "little") for d in dims
    )


@pytest.mark.parametrize("variant", ["f16", "q8_0"])
def test_misshapen_tensor_is_named_with_both_shapes(
    tmp_path, gguf_files, glm_config, variant
):
    """attn_q_a [q_lora 128, hidden 256] stored as [256, 128]: the same
    bytes, so the file itself is consistent. A Q8_0 one loaded silently
    before and computed garbage."""
    from vllm.model_executor.model_loader.gguf_dsa import GGUFCheckpointError

    name = _name(b"blk.1.attn_q_a.weight")
    bad = _edit_header(
        gguf_files[("glm", variant)],
        tmp_path / "misshapen.gguf",
        name + _dims(256, 128),
        name + _dims(128, 256),
    )
    with pytest.raises(
        GGUFCheckpointError,
        match=r"blk\.1\.attn_q_a\.weight: expected \(128, 256\), found \(256, 128\)",
    ):
        run_loader(bad, glm_config)


@pytest.mark.parametrize("name", ["glm", "dsv3", "dsv32", "glm52"])
def test_every_mapped_tensor_has_an_expected_shape(checkpoints, gguf_files, name):
    """The shape check covers the whole map (it raises KeyError on a name
    it has no shape for), for the target model and the MTP draft."""
    import copy

    from vllm.config.speculative import SpeculativeConfig
    from vllm.model_executor.model_loader.gguf_dsa import get_mla_gguf_name_map

    config = AutoConfig.from_pretrained(checkpoints[name].path)
    path = str(gguf_files[(name, "f16")])
    assert get_mla_gguf_name_map(config, [path])
    if checkpoints[name].num_mtp_layers:
        draft = SpeculativeConfig.hf_config_override(copy.deepcopy(config))
        assert get_mla_gguf_name_map(draft, [path])
