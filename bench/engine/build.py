# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Build a benchmark checkpoint: HF config + tokenizer (what vLLM's
--hf-config-path / --tokenizer read), the F16 GGUF from llama.cpp's own
converter (convert.py, tensors streamed), then each quantized type from
llama.cpp's own quantizer (llama_model_quantize: llama-quantize's code,
with its per-tensor type overrides and, for IQ types, an importance matrix).

IQ1/IQ2/IQ3_XXS types refuse to quantize without an importance matrix
("this quantization requires an imatrix!"). llama.cpp's imatrix tool (not in
the Python wheel) measures one from activations on text; for random weights
and a speed benchmark a uniform one (every input column weighted 1, what
isotropic activations give) is handed to the quantizer directly
(llama_model_quantize_params.imatrix). It changes which grid points the
quantizer picks, not the file's layout or the kernels that read it.

Layout of <out>/<spec name>/: hf/ (config.json, tokenizer files,
bench_spec.json), <name>-<type>.gguf, build.json (what was built, sizes,
tensor types, timings, the routing check). A type whose file and recipe are
unchanged is not rebuilt; the F16 file is removed after quantizing unless
f16 itself was asked for.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from . import spec as specs
from . import vocab

HERE = Path(__file__).resolve().parent
RECIPE = 1  # bump when the tensors or the vocabulary change


def recipe_hash(spec: specs.Spec) -> str:
    blob = json.dumps([RECIPE, dataclasses.asdict(spec)], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def write_hf(spec: specs.Spec, path: Path) -> None:
    """config.json (the transformers config class, plus the published keys
    vLLM reads), the tokenizer, and the spec."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    config = getattr(transformers, spec.config_class)(**specs.hf_config(spec))
    config.architectures = [spec.architecture]
    config.torch_dtype = "bfloat16"
    config.save_pretrained(path)
    # keys the config class may drop on save (vLLM reads them)
    saved = json.loads((path / "config.json").read_text())
    for k, v in specs.hf_config(spec).items():
        saved.setdefault(k, v)
    (path / "config.json").write_text(json.dumps(saved, indent=1))
    vocab.write_tokenizer(path, spec.vocab, spec.max_position)
    (path / "bench_spec.json").write_text(json.dumps(dataclasses.asdict(spec), indent=1))


def converter_dir(work: Path) -> Path:
    """llama.cpp's converter: E2E_LLAMA_CPP (the archive `make wheelhouse`
    writes) or the pinned llama-cpp-python sdist (scripts/patchseries)."""
    from patchseries.llama_cpp_sdist import converter_dir

    return converter_dir(work)


def convert(spec: specs.Spec, hf: Path, outfile: Path, outtype: str, converter: Path) -> float:
    job = hf.parent / f"convert-{outtype}.json"
    job.write_text(json.dumps({"hf": str(hf), "spec": dataclasses.asdict(spec),
                               "outtype": outtype, "outfile": str(outfile)}))
    # the converter's llama.cpp dir and gguf-py (before the installed gguf), and
    # bench/ for the engine package
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (
        str(converter), str(converter / "gguf-py"), str(HERE.parent), env.get("PYTHONPATH")) if p)
    start = time.monotonic()
    subprocess.run([sys.executable, str(HERE / "convert.py"), str(job)], env=env, check=True)
    return time.monotonic() - start


def _ggml_type(llama_cpp, name: str) -> int:
    return getattr(llama_cpp, f"GGML_TYPE_{name.upper()}")


def quantize(src: Path, dst: Path, gtype: specs.GgufType, nthread: int) -> float:
    """llama_model_quantize (llama-quantize's code) from ``src`` (F16)."""
    import llama_cpp
    import numpy as np

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{gtype.ftype.upper()}")
    params.nthread = nthread
    keep = []  # ctypes buffers the C side reads until the call returns
    if gtype.overrides:
        arr = (llama_cpp.llama_model_tensor_override * (len(gtype.overrides) + 1))()
        for i, (pattern, t) in enumerate(gtype.overrides):
            arr[i].pattern = pattern.encode()
            arr[i].type = _ggml_type(llama_cpp, t)
        arr[len(gtype.overrides)].pattern = None
        keep.append(arr)
        params.tt_overrides = ctypes.cast(
            arr, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    if gtype.needs_imatrix:
        entries = imatrix_entries(src, gtype)
        arr = (llama_cpp.llama_model_imatrix_data * (len(entries) + 1))()
        for i, (name, size) in enumerate(entries):
            ones = np.ones(size, dtype=np.float32)
            keep.append(ones)
            arr[i].name = name.encode()
            arr[i].data = ones.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            arr[i].size = size
        arr[len(entries)].name = None
        keep.append(arr)
        params.imatrix = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    tmp = dst.with_name(dst.name + ".tmp")
    start = time.monotonic()
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"llama_model_quantize {src.name} -> {gtype.name} failed (rc {rc})")
    os.replace(tmp, dst)
    return time.monotonic() - start


def imatrix_entries(src: Path, gtype: specs.GgufType) -> list[tuple[str, int]]:
    """(tensor, ne0 * ne2) for every tensor an IQ override names: the
    uniform importance matrix's entries (one value per input column and
    expert)."""
    from gguf import GGUFReader

    iq = [(p, t) for p, t in gtype.overrides if t.upper().startswith(("IQ1", "IQ2", "IQ3_XXS"))]
    out = []
    for t in GGUFReader(src).tensors:
        shape = [int(x) for x in t.shape]
        if len(shape) < 2:
            continue
        if specs.expected_type(specs.GgufType("", "", tuple(iq)), t.name):
            out.append((t.name, shape[0] * (shape[2] if len(shape) > 2 else 1)))
    return out


def describe(path: Path) -> dict:
    """Tensor types (count per type), bytes, and every tensor's type and
    shape (ggml order) of a GGUF file."""
    from gguf import GGUFReader

    r = GGUFReader(path)
    tensors = {t.name: {"type": t.tensor_type.name, "shape": [int(x) for x in t.shape]}
               for t in r.tensors}
    return {
        "bytes": path.stat().st_size,
        "types": dict(sorted(Counter(v["type"] for v in tensors.values()).items())),
        "tensors": tensors,
    }


def build(spec: specs.Spec, types: list[str], out: Path, nthread: int | None = None,
          routing_tokens: int = 4096) -> dict:
    """Build ``spec``'s files of ``types`` in out/<spec.name>/; returns its
    build.json."""
    from . import weights

    for t in types:
        if t not in specs.TYPES:
            raise SystemExit(f"unknown GGUF type {t!r} (known: {', '.join(specs.TYPES)})")
    nthread = nthread or os.cpu_count() or 1
    mdir = out / spec.name
    mdir.mkdir(parents=True, exist_ok=True)
    info_path = mdir / "build.json"
    recipe = recipe_hash(spec)
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    if info.get("recipe") != recipe:
        info = {"recipe": recipe, "spec": dataclasses.asdict(spec), "files": {}, "seconds": {}}
    files = info["files"]
    hf = mdir / "hf"

    def have(t: str) -> bool:
        return t in files and (mdir / files[t]["file"]).is_file()

    todo = [t for t in types if not have(t)]
    if not todo and (hf / "config.json").is_file():
        print(f"[bench-engine] {spec.name}: up to date ({', '.join(types)})", flush=True)
        return info
    quantized = [t for t in todo if specs.TYPES[t].ftype != "convert"]
    # before the F16 file, which takes minutes at full width
    if quantized and importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit(
            f"{spec.name}: {', '.join(quantized)} need llama.cpp's quantizer, read "
            "through llama-cpp-python (tests/requirements-gpu.txt), which this "
            "Python cannot import"
        )
    start = time.monotonic()
    write_hf(spec, hf)
    info["parameters"] = specs.parameter_count(spec)
    if "routing" not in info:
        t0 = time.monotonic()
        info["routing"] = weights.routing_check(spec, tokens=routing_tokens)
        info["seconds"]["routing_check"] = round(time.monotonic() - t0, 1)
        bad = {k: v["problems"] for k, v in info["routing"].items() if v["problems"]}
        if bad:
            raise SystemExit(f"{spec.name}: the random router is not balanced: {bad}")
    f16 = mdir / f"{spec.name}-f16.gguf"
    if not f16.is_file():
        converter = converter_dir(out / "_llama_cpp")
        print(f"[bench-engine] {spec.name}: llama.cpp converter -> f16 "
              f"({info['parameters'] / 1e9:.2f} B parameters)", flush=True)
        info["seconds"]["convert_f16"] = round(convert(spec, hf, f16, "f16", converter), 1)
    for t in todo:
        gtype = specs.TYPES[t]
        if gtype.ftype == "convert":
            path = f16
        else:
            path = mdir / f"{spec.name}-{t}.gguf"
            print(f"[bench-engine] {spec.name}: llama.cpp quantizer -> {t}", flush=True)
            info["seconds"][f"quantize_{t}"] = round(quantize(f16, path, gtype, nthread), 1)
        d = describe(path)
        files[t] = {"file": path.name, "bytes": d["bytes"], "types": d["types"],
                    "tensors": d["tensors"]}
        info_path.write_text(json.dumps(info, indent=1))
    if "f16" not in types and f16.is_file():
        f16.unlink()  # the quantizer's input; disk is the limit at full width
    info["seconds"]["total_last_build"] = round(time.monotonic() - start, 1)
    info_path.write_text(json.dumps(info, indent=1))
    return info
