"""llama.cpp's own command-line tools on a GGUF file written by llama.cpp's
converter (tests/support/llama_cpp_convert.py), as the published low-bit
files are made: an importance matrix from a calibration text
(llama-imatrix), a quantized file with optional per-tensor types
(llama-quantize) and a split set (llama-gguf-split). The tools are built
from the pinned llama.cpp by scripts/patchseries/llama_cpp_tools.py; every
function here takes the folder that holds them.

The converter writes a word-level vocabulary of NORMAL tokens ("<t0>",
"<t1>", ...) that llama.cpp's BPE tokenizer cannot read back from text:
llama-imatrix therefore runs on a copy of the file whose tokens are
USER_DEFINED, which llama.cpp matches verbatim in a text. The weights, and
so the activations the matrix is made of, are the file's own.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

# llama-quantize's words for a tensor whose rows do not fit the block of the
# type it was to get (tensor_type_fallback in src/llama-quant.cpp).
_FALLBACK = re.compile(
    r"(?P<tensor>\S+)\s+- ncols\s+(?P<cols>\d+) not divisible by\s+(?P<block>\d+) "
    r"\(required for type\s+(?P<wanted>\S+)\)\s*(?:\(WARNING:[^)]*\)\s*)?"
    r"-> falling back to\s+(?P<got>\S+)")
_FALLBACK_COUNT = re.compile(r"(?P<n>\d+) of \d+ tensor\(s\) required fallback quantization")

# gguf's TokenType.USER_DEFINED
_USER_DEFINED = 4


def token_text(tokens: Sequence[int]) -> str:
    """A text that the tokenizable copy (see the module docstring) reads back
    as exactly `tokens`."""
    return "".join(f"<t{t}>" for t in tokens)


def _run(cmd: list[str], what: str) -> str:
    """Run one of the tools; its output (stdout and stderr in order) is
    returned, and shown in the error where it fails."""
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed (exit status {result.returncode}): "
                           f"{' '.join(cmd)}\n{result.stdout[-6000:]}")
    return result.stdout


def _tokenizable_copy(src: Path, dst: Path) -> None:
    import gguf

    shutil.copyfile(src, dst)
    reader = gguf.GGUFReader(dst, "r+")
    field = reader.fields["tokenizer.ggml.token_type"]
    for i in field.data:
        field.parts[i][0] = _USER_DEFINED
    reader.data.flush()


def imatrix(tools: Path, model: Path, text: str, out: Path, ctx: int, threads: int) -> str:
    """llama-imatrix on `model` over `text` (token_text()), in chunks of
    `ctx` tokens; writes the matrix (GGUF) to `out`, returns the tool's
    output."""
    work = out.with_name(f".{out.name}.work")
    work.mkdir(parents=True, exist_ok=True)
    try:
        copy, text_file = work / model.name, work / "calibration.txt"
        _tokenizable_copy(model, copy)
        text_file.write_text(text)
        return _run([str(tools / "llama-imatrix"), "-m", str(copy), "-f", str(text_file),
                     "-o", str(out), "-c", str(ctx), "--no-ppl",
                     "-t", str(threads)], f"llama-imatrix on {model.name}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def quantize(tools: Path, src: Path, dst: Path, ftype: str, threads: int, *,
             imatrix: Path | None = None, tensor_types: Sequence[tuple[str, str]] = (),
             token_embedding_type: str | None = None,
             output_tensor_type: str | None = None) -> dict[str, dict]:
    """llama-quantize `src` to `dst` as `ftype` (its type argument, e.g.
    IQ2_XXS), with an importance matrix and per-tensor types (--tensor-type
    PATTERN=TYPE, the first pattern found in a tensor's name wins) where
    given. Returns the tensors that the quantizer gave another type than the
    one it meant to because their rows do not fit that type's blocks:
    {tensor: {"wanted", "got", "columns", "block"}}."""
    cmd = [str(tools / "llama-quantize")]
    if imatrix is not None:
        cmd += ["--imatrix", str(imatrix)]
    for pattern, qtype in tensor_types:
        cmd += ["--tensor-type", f"{pattern}={qtype}"]
    if token_embedding_type:
        cmd += ["--token-embedding-type", token_embedding_type]
    if output_tensor_type:
        cmd += ["--output-tensor-type", output_tensor_type]
    tmp = dst.with_name(f".{dst.name}.tmp")
    try:
        log = _run([*cmd, str(src), str(tmp), ftype, str(threads)],
                   f"llama-quantize {src.name} -> {ftype}")
        fallback = {m["tensor"]: {"wanted": m["wanted"].upper(), "got": m["got"].upper(),
                                  "columns": int(m["cols"]), "block": int(m["block"])}
                    for m in _FALLBACK.finditer(log)}
        counted = _FALLBACK_COUNT.search(log)
        if len(fallback) != (int(counted["n"]) if counted else 0):
            # The quantizer's words changed: a fallback must not go unrecorded.
            raise RuntimeError(
                f"llama-quantize {dst.name}: read {len(fallback)} fallback tensors from its "
                f"output, it says {counted[0] if counted else 'none'}")
        tmp.rename(dst)
    finally:
        tmp.unlink(missing_ok=True)
    return fallback


def split(tools: Path, src: Path, prefix: Path, max_tensors: int) -> list[Path]:
    """llama-gguf-split --split of `src` into shards of at most
    `max_tensors` tensors, <prefix>-0000i-of-0000N.gguf; returns them in
    order (the first is the one a loader is given)."""
    for old in prefix.parent.glob(f"{prefix.name}-*-of-*.gguf"):
        old.unlink()
    _run([str(tools / "llama-gguf-split"), "--split", "--split-max-tensors", str(max_tensors),
          str(src), str(prefix)], f"llama-gguf-split {src.name}")
    made = sorted(prefix.parent.glob(f"{prefix.name}-*-of-*.gguf"))
    if not made or not made[0].name.endswith(f"-00001-of-{len(made):05d}.gguf"):
        raise RuntimeError(f"llama-gguf-split {src.name} wrote {[p.name for p in made]}")
    return made
