"""Run vLLM's GGUF loader the way it runs for real (name map, weight types,
weight iterator: support/gguf_loader.py, shared with the end-to-end
tests) and compare what it yields with the HF checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from support.gguf_loader import (
    Loaded,
    dequantized,
    expected_from_checkpoint,
    file_tensor_types,
    run_loader,
)

if TYPE_CHECKING:
    import gguf

__all__ = ["GLM52_INDEXER_TYPES", "Loaded", "assert_matches", "dequantized",
           "expected_from_checkpoint", "file_tensor_types", "q8_0_bound", "run_loader",
           "write_gguf"]

FLOAT_TYPES = ("F32", "F16", "BF16")

# GLM-5.2's layout in small: full first layers, then shared ones reusing
# the previous full layer's top-k.
GLM52_INDEXER_TYPES = ["full", "full", "shared", "full", "shared"]


def q8_0_bound(ref: torch.Tensor) -> torch.Tensor:
    """Per-element bound of Q8_0's error on `ref` (blocks of 32 along the
    last dim): half a step of amax/127 plus the fp16 rounding of the
    scale over up to 127 steps, with 1 % slack."""
    blocks = ref.double().reshape(-1, 32)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    bound = amax * (0.5 / 127 + 2.0**-11) * 1.01 + 1e-12
    return bound.expand_as(blocks).reshape(ref.shape)


def assert_matches(
    got: torch.Tensor, ref: torch.Tensor, type_name: str, what: str, bound=None
):
    assert tuple(got.shape) == tuple(ref.shape), (
        f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    )
    assert not torch.isnan(got).any(), f"{what}: NaN"
    if type_name in FLOAT_TYPES:
        # Converted without rounding beyond the target type: bit-exact.
        want = ref.to(got.dtype)
        diff = (got.double() - want.double()).abs().max()
        assert torch.equal(got, want), f"{what} ({type_name}): max |diff| {diff}"
        return
    assert type_name == "Q8_0", f"{what}: unexpected type {type_name}"
    bound = q8_0_bound(ref) if bound is None else bound
    err = (got.double() - ref.double()).abs()
    assert (err <= bound).all(), f"{what} (Q8_0): error {err.max()} over bound"
    rel = (err.norm() / ref.double().norm()).item()
    assert rel < 1e-2, f"{what} (Q8_0): relative error {rel}"


def write_gguf(
    dst: Path,
    reader: gguf.GGUFReader,
    tensors: list | None = None,
    *,
    metadata: bool = True,
    kv: dict | None = None,
    add: tuple = (),
    retype: dict | None = None,
    blocks: dict | None = None,
) -> Path:
    """Write `tensors` (default: all of `reader`'s) to `dst` with gguf-py's
    writer, with `reader`'s metadata (unless not `metadata`) edited by `kv`
    ({key: (value, type)}, value None drops the key), extra float tensors
    `add` ((name, array), ...), tensors of `retype` ({name: type}) stored
    in another type (zero bytes of the same logical shape) and tensors of
    `blocks` ({name: (type, uint8 blocks [..., bytes])}) stored as given."""
    import gguf
    import numpy as np
    from gguf import GGUFValueType as VType

    kv, retype, blocks = kv or {}, retype or {}, blocks or {}
    arch = str(reader.get_field("general.architecture").contents())
    writer = gguf.GGUFWriter(dst, arch)
    if metadata:
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name in kv:
                continue
            if field.name == "general.architecture":
                continue
            sub = field.types[-1] if field.types[0] == VType.ARRAY else None
            writer.add_key_value(
                field.name, field.contents(), field.types[0], sub_type=sub
            )
    for key, (value, vtype) in kv.items():
        if value is not None:
            writer.add_key_value(key, value, vtype)
    for tensor in reader.tensors if tensors is None else tensors:
        if tensor.name in blocks:
            qtype, data = blocks[tensor.name]
            writer.add_tensor(tensor.name, np.asarray(data, np.uint8), raw_dtype=qtype)
        elif (qtype := retype.get(tensor.name)) is not None:
            shape = [int(d) for d in reversed(tensor.shape)]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            data = np.zeros((*shape[:-1], shape[-1] // block * size), np.uint8)
            writer.add_tensor(tensor.name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    for name, array in add:
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


SMALL_GGUF_TOKENS = ["a", "bc", "\u00e9t\u00e9"]


def write_small_gguf(dst: Path, endianess, arch_first: bool = True) -> Path:
    """A small glm-dsa GGUF written by gguf-py in byte order `endianess`
    (gguf.GGUFEndian): a block count, a RoPE base, SMALL_GGUF_TOKENS and
    their scores, t.weight (float32 arange(24) as [4, 6]) and h.weight
    (float16 arange(8)). arch_first=False moves general.architecture behind
    the other fields (llama.cpp's writers put it first)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(dst, "glm-dsa", endianess=endianess)
    writer.add_uint32("glm-dsa.block_count", 3)
    writer.add_float32("glm-dsa.rope.freq_base", 1e6)
    writer.add_token_list(SMALL_GGUF_TOKENS)
    writer.add_token_scores([0.5, -1.0, 2.0])
    if not arch_first:
        kv = writer.kv_data[0]
        kv[gguf.Keys.General.ARCHITECTURE] = kv.pop(gguf.Keys.General.ARCHITECTURE)
    writer.add_tensor("t.weight", np.arange(24, dtype=np.float32).reshape(4, 6))
    writer.add_tensor("h.weight", np.arange(8, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
