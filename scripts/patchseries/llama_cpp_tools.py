"""llama.cpp's own programs, built with cmake from the pinned llama.cpp source:
the llama.cpp vendored in the pinned llama-cpp-python sdist
(llama_cpp_sdist.py).

- source_dir(): that source, extracted once, without the parts no build
  reads; from LLAMA_CPP_SRC (a folder, or an archive pack_source() wrote:
  ~10 MB, for a machine with neither the sdist nor a package index) or from
  the sdist (fetched and cached like the release files);
- cmake_build(): configure and build some of its targets;
- cpu_tools(): llama-quantize, llama-imatrix and llama-gguf-split for the
  CPU (GGML_NATIVE=OFF: no -march=native; no CUDA, no OpenSSL, no web UI;
  llama.cpp's own libraries linked in),
  built once into the download cache under a key of the source (the pinned
  sdist's sha256, or LLAMA_CPP_SRC's). The end-to-end test models make
  their importance matrix, low-bit and split files with them
  (tests/support/llama_cpp_quantize.py); `series.py llama-cpp tools` builds
  them ahead.

bench/engine/llamacpp.py builds llama-server and llama-bench with CUDA from
the same source.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .fetch import cache_dir, sha256_of
from .pin import load_llama_cpp_pin

CPU_TOOLS = ("llama-quantize", "llama-imatrix", "llama-gguf-split")

# Parts of the vendored llama.cpp that no build of its tools reads (".git":
# the sdist's gitlink, which cmake would take for a repository, and .github/).
_SKIP = ("docs/", "models/", "media/", "benches/", "tests/", "examples/", "tools/ui/tests/",
         "gguf-py/", "conversion/", "scripts/snapdragon/", ".git", "ci/", "pocs/", "app/")

# Options every build of the tools here takes: the tools and their common
# library, nothing downloaded at configure or build time.
COMMON_OPTIONS = ("-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF",
                  "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
                  "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_APP=OFF")

# The CPU tools: no -march=native (the cache may move between machines),
# llama.cpp's libraries linked in (the programs alone are kept), no server.
CPU_OPTIONS = ("-DGGML_NATIVE=OFF", "-DGGML_CUDA=OFF", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_SERVER=OFF")


def keep_source(rel: str) -> bool:
    """Whether a path of the vendored llama.cpp (relative to it) is extracted."""
    return bool(rel) and not any(rel == s.rstrip("/") or rel.startswith(s) for s in _SKIP)


def pack_source(dest: Path) -> Path:
    """A trimmed archive of the pinned llama.cpp source (for LLAMA_CPP_SRC)."""
    from .llama_cpp_sdist import sdist

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    with tarfile.open(sdist()) as src, tarfile.open(tmp, "w:gz") as out:
        for m in src.getmembers():
            _, _, rel = m.name.partition("/vendor/llama.cpp/")
            if not keep_source(rel) or not (m.isfile() or m.isdir()):
                continue
            m2 = tarfile.TarInfo("llama.cpp/" + rel)
            m2.size, m2.mode, m2.type, m2.mtime = m.size, m.mode, m.type, 0
            out.addfile(m2, src.extractfile(m) if m.isfile() else None)
    os.replace(tmp, dest)
    return dest


def source_dir(cache: Path) -> Path:
    """The llama.cpp source tree: LLAMA_CPP_SRC where it is a folder, else
    extracted into cache/src once (from LLAMA_CPP_SRC's archive or the sdist)."""
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
        from .llama_cpp_sdist import sdist

        with tarfile.open(sdist()) as tar:
            members = [m for m in tar.getmembers()
                       if keep_source(m.name.partition("/vendor/llama.cpp/")[2])]
            tar.extractall(tmp, members=members, filter="data")
        root = next(tmp.glob("*/vendor/llama.cpp"))
    root.rename(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    return dest


def build_jobs() -> int:
    """Compile jobs: CMAKE_BUILD_PARALLEL_LEVEL (cmake's own variable), else
    one per core."""
    given = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL")
    return int(given) if given and given.isdigit() and int(given) > 0 else os.cpu_count() or 1


def missing_build_tools(extra: Sequence[tuple[str, bool]] = ()) -> list[str]:
    """What a build of llama.cpp needs and this machine lacks; extra: (what,
    present) pairs of a particular build."""
    needs = [("cmake (CMake >= 3.18 on PATH)", bool(shutil.which("cmake"))),
             ("a C++ compiler (c++/g++)", bool(shutil.which("c++") or shutil.which("g++"))),
             *extra]
    return [what for what, present in needs if not present]


def configure_command(src: Path, build: Path, options: Sequence[str],
                      generator: str | None) -> list[str]:
    args = ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
            *COMMON_OPTIONS, *options]
    if generator:
        args += ["-G", generator]
    return args


def cmake_build(src: Path, build: Path, options: Sequence[str], targets: Sequence[str],
                jobs: int | None = None) -> Path:
    """Configure src into build (Release, COMMON_OPTIONS, then options) and
    build targets, cmake's and the compiler's progress on the terminal;
    returns the folder of the programs (build/bin)."""
    generator = "Ninja" if shutil.which("ninja") else None
    subprocess.run(configure_command(src, build, options, generator), check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", *targets,
                    "-j", str(jobs or build_jobs())], check=True)
    return build / "bin"


def source_key() -> str:
    """Names the source the tools are built from: the pinned sdist's sha256,
    or LLAMA_CPP_SRC's (an archive's sha256; a folder's path and the hash of
    its CMakeLists.txt, since a folder is taken as it is)."""
    given = os.environ.get("LLAMA_CPP_SRC")
    if not given:
        return "sdist-" + load_llama_cpp_pin().sdist_sha256[:16]
    path = Path(given)
    if path.is_dir():
        digest = hashlib.sha256(str(path.resolve()).encode())
        digest.update((path / "CMakeLists.txt").read_bytes())
        return "folder-" + digest.hexdigest()[:16]
    if not path.is_file():
        raise SystemExit(f"LLAMA_CPP_SRC={given}: no such file or folder")
    return "archive-" + sha256_of(path)[:16]


def tools_cache() -> Path:
    """Where cpu_tools() keeps the programs of the current source."""
    return cache_dir() / "llama.cpp-tools" / source_key()


def built_cpu_tools() -> Path | None:
    """The folder of the built CPU tools of the current source, or None where
    they are not built (nothing is fetched or built)."""
    bins = tools_cache() / "bin"
    return bins if all((bins / t).is_file() for t in CPU_TOOLS) else None


def cpu_tools(jobs: int | None = None) -> Path:
    """llama-quantize, llama-imatrix and llama-gguf-split for the CPU, built
    once per source into tools_cache()/bin (a few minutes on few cores);
    returns that folder. The folder appears only once complete; concurrent
    calls build once."""
    if bins := built_cpu_tools():
        return bins
    if missing := missing_build_tools():
        raise SystemExit("error: building llama.cpp's tools (" + ", ".join(CPU_TOOLS) + ") needs "
                          + "; ".join(missing))
    home = tools_cache()
    home.parent.mkdir(parents=True, exist_ok=True)
    with open(home.parent / f".{home.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if bins := built_cpu_tools():  # another process built them meanwhile
            return bins
        jobs = jobs or build_jobs()
        print(f"[llama.cpp tools] building {', '.join(CPU_TOOLS)} (CPU) from the pinned "
              f"llama.cpp, {jobs} jobs, into {home}", flush=True)
        start = time.monotonic()
        with tempfile.TemporaryDirectory(dir=home.parent, prefix=f".{home.name}.") as work:
            work = Path(work)
            src = source_dir(work)
            built = cmake_build(src, work / "build", CPU_OPTIONS, CPU_TOOLS, jobs)
            staged = work / "done"
            (staged / "bin").mkdir(parents=True)
            for tool in CPU_TOOLS:
                shutil.copy2(built / tool, staged / "bin" / tool)
            seconds = round(time.monotonic() - start)
            (staged / "build.json").write_text(json.dumps(
                {"source": source_key(), "options": [*COMMON_OPTIONS, *CPU_OPTIONS],
                 "jobs": jobs, "seconds": seconds}, indent=1))
            shutil.rmtree(home, ignore_errors=True)
            os.rename(staged, home)
        print(f"[llama.cpp tools] built in {seconds} s: {home / 'bin'}", flush=True)
    return home / "bin"
