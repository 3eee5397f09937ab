"""The pinned llama-cpp-python sdist (llama-cpp-pin.txt; fetched and cached
like the release files) and what the tests and benchmarks take from it:
llama.cpp's converter, and for `make wheelhouse` (a machine without a
package index) a CPU wheel of llama-cpp-python and an archive of the
converter (`series.py llama-cpp wheel|converter`)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .fetch import fetch_file
from .pin import load_llama_cpp_pin

# What the converter needs from the sdist, relative to its llama.cpp dir.
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def sdist() -> Path:
    pin = load_llama_cpp_pin()
    return fetch_file("llama-cpp-python", pin.sdist, pin.sdist_sha256)


def extract_converter(archive: Path, dest: Path) -> Path:
    """llama.cpp's converter (script, conversion/, gguf-py/) from the sdist,
    extracted under dest; returns its llama.cpp directory."""
    root = None
    with tarfile.open(archive) as tar:
        members = []
        for member in tar.getmembers():
            top, _, rest = member.name.partition("/vendor/llama.cpp/")
            if rest and rest.startswith(_CONVERTER_PARTS):
                root = dest / top / "vendor" / "llama.cpp"
                members.append(member)
        tar.extractall(dest, members=members, filter="data")
    if root is None or not (root / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(f"{archive.name} has no vendor/llama.cpp converter")
    return root


def converter_dir(work: Path) -> Path:
    """llama.cpp's converter, extracted under work: from E2E_LLAMA_CPP (the
    archive `make wheelhouse` writes, for a machine without a package index;
    extracted once) or from the pinned sdist."""
    archive = os.environ.get("E2E_LLAMA_CPP")
    if archive:
        if not Path(archive).is_file():
            raise SystemExit(f"E2E_LLAMA_CPP={archive}: no such file")
        if not (work / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
            with tarfile.open(archive) as tar:
                tar.extractall(work, filter="data")
        return work / "llama.cpp"
    return extract_converter(sdist(), work)


def write_converter_archive(dest: Path) -> None:
    """The converter as E2E_LLAMA_CPP takes it: its llama.cpp dir, as llama.cpp/."""
    with tempfile.TemporaryDirectory() as tmp:
        root = extract_converter(sdist(), Path(tmp))
        with tarfile.open(dest, "w:gz") as tar:
            tar.add(root, arcname="llama.cpp")


def build_wheel(dest: Path) -> None:
    """The llama-cpp-python wheel from the pinned sdist, CPU only and portable
    (no -march=native), for the llama.cpp oracle and the quantizer on another
    machine."""
    env = dict(os.environ, CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_CUDA=OFF -DLLAMA_CURL=OFF "
               "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(dest),
                    str(sdist())], env=env, check=True)
