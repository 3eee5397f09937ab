"""The pinned llama.cpp as the tests, the benchmarks and `make wheelhouse`
take it (scripts/patchseries/llama_cpp_sdist.py): the converter from the
sdist, and the converter archive a machine without a package index gets
(E2E_LLAMA_CPP)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from patchseries import REPO_ROOT
from patchseries.llama_cpp_sdist import converter_dir, write_converter_archive


def test_converter_archive_holds_the_sdists_converter(tmp_path, monkeypatch):
    archive = tmp_path / "llama.cpp-converter.tar.gz"
    write_converter_archive(archive)
    monkeypatch.setenv("E2E_LLAMA_CPP", str(archive))
    from_archive = converter_dir(tmp_path / "a")
    assert from_archive == tmp_path / "a" / "llama.cpp"
    assert sorted(p.name for p in from_archive.iterdir()) == [
        "conversion", "convert_hf_to_gguf.py", "gguf-py"]
    assert (from_archive / "gguf-py" / "gguf" / "__init__.py").is_file()
    # extracted once: a second call reuses the folder
    (from_archive / "marker").write_text("")
    assert converter_dir(tmp_path / "a") == from_archive and (from_archive / "marker").exists()


def test_missing_converter_archive_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("E2E_LLAMA_CPP", str(tmp_path / "nothing.tar.gz"))
    with pytest.raises(SystemExit, match="nothing.tar.gz: no such file"):
        converter_dir(tmp_path)


def test_series_llama_cpp_command_needs_what_and_where():
    r = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "series.py"), "llama-cpp",
                        "wheel"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "llama-cpp wheel DIR" in r.stderr
