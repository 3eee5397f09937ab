"""Tools that turn the pinned vLLM release plus patches/ into a wheel, and
fetch the pinned llama.cpp that the tests and benchmarks use
(llama_cpp_sdist).

Standard library only: these run before any virtual environment exists.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PIN_FILE = REPO_ROOT / "vllm-pin.txt"
LLAMA_CPP_PIN_FILE = REPO_ROOT / "llama-cpp-pin.txt"
PATCH_DIR = REPO_ROOT / "patches"
WORK_TREE = REPO_ROOT / "vllm-src"


class SeriesError(Exception):
    """A failure with a message meant for the user; no traceback is shown."""
