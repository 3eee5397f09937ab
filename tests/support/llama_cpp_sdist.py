# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""llama.cpp for the tests: the pinned llama-cpp-python sdist (fetched and
cached like the release files) and the converter inside it."""

from __future__ import annotations

import sys
import tarfile
from pathlib import Path

SDIST = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# What the converter needs from the sdist, relative to its llama.cpp dir.
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
_SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def sdist() -> Path:
    if str(_SCRIPTS) not in sys.path:
        sys.path.insert(0, str(_SCRIPTS))
    from patchseries.fetch import fetch_file

    return fetch_file("llama-cpp-python", SDIST, SDIST_SHA256)


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
