# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""llama.cpp with CUDA for the GPU at hand: llama-server and llama-bench
from the pinned source (the llama.cpp vendored in the pinned
llama-cpp-python sdist), built once per machine into a cache folder. The
source and the cmake steps are scripts/patchseries/llama_cpp_tools.py's,
which also builds the CPU tools the test models are made with.

The source comes from LLAMA_CPP_SRC (a folder, or an archive written by
``bench_engine.py pack-llama-src``: the sdist's llama.cpp without docs, models and
tests, ~10 MB, for a machine with neither the sdist nor a package index) or
the sdist (fetched and cached like the release files).

The build: cmake -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native, no web UI
download, no OpenSSL, only the two targets. A stamp (source, GPU, compute
capability, nvcc version) makes a second call a no-op on the same machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

from patchseries.llama_cpp_tools import (
    cmake_build,
    configure_command,
    missing_build_tools,
    pack_source,
    source_dir,
)

__all__ = ["TARGETS", "build", "configure_args", "pack_source", "source_dir", "tools_missing"]

TARGETS = ("llama-server", "llama-bench")


def _nvcc() -> str | None:
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file():
            return cand
    return None


def tools_missing() -> list[str]:
    """What a CUDA build needs and this machine lacks."""
    return missing_build_tools(
        [("nvcc (the CUDA toolkit: on PATH, CUDACXX, or /usr/local/cuda/bin)", bool(_nvcc()))])


def _options(nvcc: str) -> list[str]:
    return ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=native",
            f"-DCMAKE_CUDA_COMPILER={nvcc}", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON"]


def configure_args(src: Path, build: Path, nvcc: str, generator: str | None) -> list[str]:
    return configure_command(src, build, _options(nvcc), generator)


def _stamp(src: Path, nvcc: str) -> dict:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    ver = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip()
    h = hashlib.sha256((src / "CMakeLists.txt").read_bytes()).hexdigest()[:12]
    return {"gpu": gpu, "nvcc": ver.splitlines()[-1] if ver else "", "source": h}


def build(cache: Path, jobs: int | None = None) -> Path:
    """llama-server and llama-bench in cache/build/bin (built once per
    machine); returns that folder."""
    if missing := tools_missing():
        raise SystemExit("error: llama.cpp's CUDA build needs " + "; ".join(missing)
                         + ". Install them, or run without the llama.cpp peer "
                         "(--paths without llama.cpp).")
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    src = source_dir(cache)
    nvcc = _nvcc()
    stamp = _stamp(src, nvcc)
    bdir = cache / "build"
    stamp_file = bdir / "bench-engine-stamp.json"
    bins = bdir / "bin"
    if (stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp
            and all((bins / t).is_file() for t in TARGETS)):
        print(f"[llama.cpp] up to date in {bins} ({stamp['gpu']})", flush=True)
        return bins
    cmake_build(src, bdir, _options(nvcc), TARGETS, jobs)
    stamp_file.write_text(json.dumps(stamp))
    return bins
