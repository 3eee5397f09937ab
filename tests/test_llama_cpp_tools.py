"""llama.cpp's programs built from the pinned source
(scripts/patchseries/llama_cpp_tools.py): what is extracted and how cmake
is asked, and that the CPU tools are built once per source into the cache
and appear only once complete. The build itself (minutes) is stood in for;
tests/e2e/test_low_bit_files.py uses the real one where it is built."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from patchseries import REPO_ROOT, llama_cpp_tools
from patchseries.pin import load_llama_cpp_pin


def test_source_keeps_what_builds_read():
    keep = llama_cpp_tools.keep_source
    assert keep("ggml/src/ggml-cuda/mmq.cu") and keep("tools/server/server.cpp")
    assert keep("tools/quantize/quantize.cpp") and keep("src/llama-quant.cpp")
    assert not keep("models/ggml-vocab-llama-bpe.gguf") and not keep("docs/x.md")
    assert not keep("gguf-py/gguf/quants.py") and not keep(".git")


def test_cpu_tools_are_portable_and_fetch_nothing():
    args = llama_cpp_tools.configure_command(Path("/s"), Path("/b"), llama_cpp_tools.CPU_OPTIONS,
                                             None)
    assert args[:5] == ["cmake", "-S", "/s", "-B", "/b"]
    for option in ("-DGGML_NATIVE=OFF", "-DGGML_CUDA=OFF", "-DLLAMA_OPENSSL=OFF",
                   "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TOOLS=ON",
                   "-DBUILD_SHARED_LIBS=OFF"):
        assert option in args, option
    assert "-G" not in args


def test_source_key_names_the_source(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_CPP_SRC", raising=False)
    assert llama_cpp_tools.source_key() == "sdist-" + load_llama_cpp_pin().sdist_sha256[:16]
    archive = tmp_path / "src.tar.gz"
    archive.write_bytes(b"one")
    monkeypatch.setenv("LLAMA_CPP_SRC", str(archive))
    first = llama_cpp_tools.source_key()
    archive.write_bytes(b"two")
    assert first.startswith("archive-") and llama_cpp_tools.source_key() != first
    monkeypatch.setenv("LLAMA_CPP_SRC", str(tmp_path / "nothing"))
    with pytest.raises(SystemExit, match="LLAMA_CPP_SRC=.*nothing: no such file or folder"):
        llama_cpp_tools.source_key()


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """cpu_tools() with a cache in tmp_path, a one-file source archive and a
    stand-in for cmake that writes each target (FAIL_BUILD: fails instead).
    Returns the list of builds run."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "CMakeLists.txt").write_text("project(x)\n")
    archive = tmp_path / "llama.cpp-src.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname="llama.cpp")
    monkeypatch.setenv("VLLM_DSA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LLAMA_CPP_SRC", str(archive))
    builds = []

    def cmake_build(source, build, options, targets, jobs=None):
        assert (source / "CMakeLists.txt").is_file()
        builds.append(list(targets))
        if "FAIL_BUILD" in options:
            raise subprocess.CalledProcessError(1, "cmake")
        (build / "bin").mkdir(parents=True)
        for target in targets:
            (build / "bin" / target).write_text(target)
        return build / "bin"

    monkeypatch.setattr(llama_cpp_tools, "cmake_build", cmake_build)
    return builds


def test_cpu_tools_are_built_once_per_source(fake_build, monkeypatch):
    assert llama_cpp_tools.built_cpu_tools() is None
    bins = llama_cpp_tools.cpu_tools(jobs=2)
    assert fake_build == [list(llama_cpp_tools.CPU_TOOLS)]
    assert sorted(p.name for p in bins.iterdir()) == sorted(llama_cpp_tools.CPU_TOOLS)
    assert bins.parent == llama_cpp_tools.tools_cache()
    record = json.loads((bins.parent / "build.json").read_text())
    assert record["source"] == llama_cpp_tools.source_key() and record["jobs"] == 2
    # nothing left of the work tree (source, build folder) beside the tools
    assert sorted(p.name for p in bins.parent.parent.iterdir() if not p.name.endswith(".lock")) \
        == [bins.parent.name]
    assert llama_cpp_tools.cpu_tools() == bins and llama_cpp_tools.built_cpu_tools() == bins
    assert len(fake_build) == 1


def test_failed_build_leaves_no_tools(fake_build, monkeypatch):
    monkeypatch.setattr(llama_cpp_tools, "CPU_OPTIONS", ("FAIL_BUILD",))
    with pytest.raises(subprocess.CalledProcessError):
        llama_cpp_tools.cpu_tools()
    assert llama_cpp_tools.built_cpu_tools() is None
    assert not llama_cpp_tools.tools_cache().exists()


def test_series_llama_cpp_tools_command_takes_no_argument():
    r = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "series.py"), "llama-cpp",
                        "tools", "now"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "llama-cpp tools" in r.stderr
