"""Readers of the pin files, vllm-pin.txt and llama-cpp-pin.txt: `key = value`
lines, `#` comments."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from . import LLAMA_CPP_PIN_FILE, PIN_FILE, SeriesError

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")


@dataclass(frozen=True)
class Pin:
    version: str
    commit: str
    sdist: str
    sdist_sha256: str
    wheel: str
    wheel_sha256: str
    torch: str


@dataclass(frozen=True)
class LlamaCppPin:
    version: str
    sdist: str
    sdist_sha256: str


def _key_values(text: str, source: str, keys: dict) -> dict[str, str]:
    """Every key of `keys` (a dataclass's fields) once, nothing else."""
    values: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, sep, value = (part.strip() for part in line.partition("="))
        if not sep or not key or not value:
            raise SeriesError(f"{source}:{lineno}: expected 'key = value', got {raw!r}")
        if key not in keys:
            raise SeriesError(f"{source}:{lineno}: unknown key {key!r}")
        if key in values:
            raise SeriesError(f"{source}:{lineno}: {key!r} given twice")
        values[key] = value
    missing = [k for k in keys if k not in values]
    if missing:
        raise SeriesError(f"{source}: missing {', '.join(missing)}")
    return values


def parse_pin(text: str, source: str = "vllm-pin.txt") -> Pin:
    values = _key_values(text, source, Pin.__dataclass_fields__)
    for key in ("sdist_sha256", "wheel_sha256"):
        if not _SHA256.match(values[key]):
            raise SeriesError(f"{source}: {key} is not 64 lowercase hex digits")
    if not _COMMIT.match(values["commit"]):
        raise SeriesError(f"{source}: commit is not a hex commit id")
    if not values["sdist"].startswith(f"vllm-{values['version']}"):
        raise SeriesError(f"{source}: sdist {values['sdist']} is not version {values['version']}")
    if not values["wheel"].startswith(f"vllm-{values['version']}-"):
        raise SeriesError(f"{source}: wheel {values['wheel']} is not version {values['version']}")
    return Pin(**values)


def parse_llama_cpp_pin(text: str, source: str = "llama-cpp-pin.txt") -> LlamaCppPin:
    values = _key_values(text, source, LlamaCppPin.__dataclass_fields__)
    if not _SHA256.match(values["sdist_sha256"]):
        raise SeriesError(f"{source}: sdist_sha256 is not 64 lowercase hex digits")
    if values["sdist"] != f"llama_cpp_python-{values['version']}.tar.gz":
        raise SeriesError(f"{source}: sdist {values['sdist']} is not "
                          f"llama_cpp_python-{values['version']}.tar.gz")
    return LlamaCppPin(**values)


def load_pin(path: Path = PIN_FILE) -> Pin:
    return parse_pin(_read(path), path.name)


def load_llama_cpp_pin(path: Path = LLAMA_CPP_PIN_FILE) -> LlamaCppPin:
    return parse_llama_cpp_pin(_read(path), path.name)


def _read(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SeriesError(f"cannot read {path}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise SeriesError(f"{path.name}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at "
                          f"column {column}); save {path} as UTF-8") from None
    return text


def pin_text(pin: Pin) -> str:
    """vllm-pin.txt for `pin`, comments and all: the one place its text is
    written (by `make rebase`); the committed file equals this."""
    text = f"""\
# The vLLM release this patch series applies to. One `key = value` per line;
# parsed by scripts/patchseries/pin.py, the only reader of this file, and
# written by `make rebase` (pin_text in the same file).
version = {pin.version}
# Upstream commit of the release, as recorded in its version metadata
# (vllm/_version.py of the sdist). A VLLM_SRC checkout must be at it.
commit = {pin.commit}
sdist = {pin.sdist}
sdist_sha256 = {pin.sdist_sha256}
# x86_64 wheel whose compiled ops the default build reuses: the highest build
# tag on the index when a release has several (they differ).
wheel = {pin.wheel}
wheel_sha256 = {pin.wheel_sha256}
# torch that the release pins (its requirements).
torch = {pin.torch}
"""
    parse_pin(text)  # never write a pin the tools cannot read
    return text
