"""Tools that turn the pinned vLLM release plus patches/ into a wheel.

Standard library only: these run before any virtual environment exists.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PIN_FILE = REPO_ROOT / "vllm-pin.txt"
PATCH_DIR = REPO_ROOT / "patches"
WORK_TREE = REPO_ROOT / "vllm-src"


class SeriesError(Exception):
    """A failure with a message meant for the user; no traceback is shown."""
