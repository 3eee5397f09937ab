# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""llama.cpp with CUDA for the GPU at hand: llama-server and llama-bench
from the pinned source (the llama.cpp vendored in the pinned
llama-cpp-python sdist, scripts/patchseries/llama_cpp_sdist.py), built once per
machine into a cache folder.

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
import tarfile
from pathlib import Path

TARGETS = ("llama-server", "llama-bench")
# Parts of the vendored llama.cpp a CUDA build of the tools does not read.
_SKIP = ("docs/", "models/", "media/", "benches/", "tests/", "examples/", "tools/ui/tests/",
         "gguf-py/", "conversion/", "scripts/snapdragon/", ".github/", "ci/", "pocs/", "app/")


def _keep(rel: str) -> bool:
    return bool(rel) and not any(rel == s.rstrip("/") or rel.startswith(s) for s in _SKIP)


def pack_source(dest: Path) -> Path:
    """A trimmed archive of the pinned llama.cpp source (for LLAMA_CPP_SRC)."""
    from patchseries.llama_cpp_sdist import sdist

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    with tarfile.open(sdist()) as src, tarfile.open(tmp, "w:gz") as out:
        for m in src.getmembers():
            _, _, rel = m.name.partition("/vendor/llama.cpp/")
            if not _keep(rel) or not (m.isfile() or m.isdir()):
                continue
            m2 = tarfile.TarInfo("llama.cpp/" + rel)
            m2.size, m2.mode, m2.type, m2.mtime = m.size, m.mode, m.type, 0
            out.addfile(m2, src.extractfile(m) if m.isfile() else None)
    os.replace(tmp, dest)
    return dest


def source_dir(cache: Path) -> Path:
    """The llama.cpp source tree, extracted into ``cache`` once."""
    given = os.environ.get("LLAMA_CPP_SRC")
    if given and Path(given).is_dir():
        return Path(given)
    dest = cache / "src"
    if (dest / "CMakeLists.txt").is_file():
        return dest
    tmp = cache / "src.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if given:
        if not Path(given).is_file():
            raise SystemExit(f"LLAMA_CPP_SRC={given}: no such file or folder")
        with tarfile.open(given) as tar:
            tar.extractall(tmp, filter="data")
        root = tmp / "llama.cpp"
    else:
        from patchseries.llama_cpp_sdist import sdist

        with tarfile.open(sdist()) as tar:
            members = []
            for m in tar.getmembers():
                top, _, rel = m.name.partition("/vendor/llama.cpp/")
                if _keep(rel):
                    members.append(m)
            tar.extractall(tmp, members=members, filter="data")
        root = next(tmp.glob("*/vendor/llama.cpp"))
    root.rename(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _nvcc() -> str | None:
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file():
            return cand
    return None


def tools_missing() -> list[str]:
    """What a CUDA build needs and this machine lacks."""
    missing = []
    if not shutil.which("cmake"):
        missing.append("cmake (CMake >= 3.18 on PATH)")
    if not _nvcc():
        missing.append("nvcc (the CUDA toolkit: on PATH, CUDACXX, or /usr/local/cuda/bin)")
    if not (shutil.which("c++") or shutil.which("g++")):
        missing.append("a C++ compiler (c++/g++)")
    return missing


def configure_args(src: Path, build: Path, nvcc: str, generator: str | None) -> list[str]:
    args = ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=native", f"-DCMAKE_CUDA_COMPILER={nvcc}",
            "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_APP=OFF"]
    if generator:
        args += ["-G", generator]
    return args


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
    gen = "Ninja" if shutil.which("ninja") else None
    subprocess.run(configure_args(src, bdir, nvcc, gen), check=True)
    jobs = jobs or os.cpu_count() or 1
    subprocess.run(["cmake", "--build", str(bdir), "--target", *TARGETS, "-j", str(jobs)],
                   check=True)
    stamp_file.write_text(json.dumps(stamp))
    return bins
