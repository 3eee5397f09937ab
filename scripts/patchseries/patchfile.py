"""patches/: the series file, and what a patch file says about itself.

A patch file is `git format-patch` output. Its commit message carries
header fields after the what/why text, e.g.

    Upstream-Status: Backport [vLLM 0.33.0]
    Obsolete-If: vllm/transformers_utils/gguf_utils.py is gone
    Collides-If: vllm/v1/attention/backends/mla/triton_mla_sparse.py exists
    Tests: tests/gguf/test_speculators_probe.py

`Collides-If:` names what upstream would have to carry for the patch to
collide with upstream's own work of the same name; the patch header says
what to do then, and `make rebase` reports it.

A field's value may go on over the following lines, up to a blank line or
the next field.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from . import PATCH_DIR, SeriesError

FIELDS = ("Upstream-Status", "Obsolete-If", "Collides-If", "Tests")
_CRLF_HEADER = re.compile(rb"^(?:From |Subject: |diff --git )[^\n]*\r$", re.M)
_FIELD = re.compile(r"^([A-Z][A-Za-z0-9]*(?:-[A-Za-z0-9]+)*):(?:\s+(.*?))?\s*$")


def series_entries(patch_dir: Path = PATCH_DIR) -> list[tuple[int, str]]:
    """(line number, name) of each entry of patch_dir/series, in order."""
    series = patch_dir / "series"
    if not series.exists():
        return []
    entries = []
    for lineno, raw in enumerate(series.read_text().splitlines(), 1):
        name = raw.split("#", 1)[0].strip()
        if name:
            entries.append((lineno, name))
    return entries


def read_series(patch_dir: Path = PATCH_DIR) -> list[Path]:
    """The patch files patch_dir/series lists, in order."""
    patches: list[Path] = []
    # By the file, not the spelling: `./0003-x.patch` after `0003-x.patch` is
    # the same patch, which `git am` would skip as applied and export would
    # delete twice.
    first: dict[Path, tuple[int, str]] = {}
    for lineno, name in series_entries(patch_dir):
        path = patch_dir / name
        where = f"{patch_dir / 'series'}:{lineno}"
        if not path.is_file():
            raise SeriesError(f"{where}: {name} does not exist")
        if (seen := first.get(path.resolve())) is not None:
            also = f"line {seen[0]}" + (f", as {seen[1]}" if seen[1] != name else "")
            raise SeriesError(f"{where}: {name} is listed twice (also {also}); remove one "
                              "of the two lines")
        first[path.resolve()] = (lineno, name)
        # git writes these lines with LF whatever the patched files hold: a CR
        # there means an editor saved the file with Windows line endings, which
        # `git am --keep-cr` reports as a conflict somewhere.
        if m := _CRLF_HEADER.search(path.read_bytes()):
            line = m.string.count(b"\n", 0, m.start()) + 1
            raise SeriesError(
                f"{where}: {name} has CRLF (Windows) line endings (line {line}); save it with "
                f"LF endings (`sed -i 's/\\r$//' {patch_dir.name}/{name}`) and run again")
        patches.append(path)
    return patches


def write_patches(patch_dir: Path, contents: dict[str, bytes], old: list[Path]) -> None:
    """Make patch_dir hold `contents` ({name: bytes}, in series order) and a
    series file listing them; `old` is the series it held. Every file is
    written in full under a temporary name before any is replaced, and old
    patch files are deleted only once the new ones and the series are in
    place: a failure part-way loses no patch."""
    patch_dir.mkdir(exist_ok=True)
    staged: list[tuple[Path, Path]] = []
    try:
        for name, data in [*contents.items(),
                           ("series", "".join(f"{n}\n" for n in contents).encode())]:
            tmp = patch_dir / f".{name}.new"
            staged.append((tmp, patch_dir / name))
            tmp.write_bytes(data)
        for tmp, dest in staged:
            os.replace(tmp, dest)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
    for path in old:
        if path.name not in contents:
            path.unlink(missing_ok=True)


def series_digest(patches: list[Path]) -> str:
    """Digest of the series' names and contents: identifies the series."""
    digest = hashlib.sha256()
    for path in patches:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def message_of(text: str) -> str:
    """The commit message of a patch file: the part before its diffstat."""
    return text.split("\n---\n", 1)[0]


def header_fields(text: str) -> dict[str, list[str]]:
    """{field: [value, ...]} of the FIELDS in a patch file's commit message;
    continuation lines are joined to their field's value with one space."""
    fields: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in message_of(text).splitlines():
        m = _FIELD.match(line)
        if m and m.group(1) in FIELDS:
            current = [m.group(2) or ""]
            fields.setdefault(m.group(1), []).append(current)  # type: ignore[arg-type]
        elif m or not line.strip():
            current = None
        elif current is not None:
            current.append(line.strip())
    return {k: [" ".join(p for p in parts if p) for parts in v] for k, v in fields.items()}


def paths_in_tests_field(value: str) -> list[str]:
    """The repository paths named in a `Tests:` value: words ending in .py,
    or starting with tests/ or bench/; a pytest node id (file::test) and
    trailing punctuation are cut off."""
    paths = []
    for word in re.split(r"[\s,;()]+", value):
        word = word.split("::", 1)[0].rstrip(".:")
        if word.endswith(".py") or word.startswith(("tests/", "bench/")):
            paths.append(word)
    return paths


@dataclass
class PatchInfo:
    path: Path
    modified: list[str]
    created: list[str]
    deleted: list[str]
    obsolete_if: list[tuple[str, str | None]]  # `Obsolete-If:` (path, regex; None: is gone)
    backport_of: str | None = None      # X of `Upstream-Status: Backport [vLLM X]`
    collides_if: list[tuple[str, str | None]] = field(default_factory=list)
    # `Collides-If:` (path, regex; None: exists)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def files(self) -> list[str]:
        return self.modified + self.created + self.deleted


def read_patch(path: Path) -> PatchInfo:
    text = path.read_text(errors="replace")
    fields = header_fields(text)
    obsolete_if = _conditions(path, fields, "Obsolete-If", "is gone")
    collides_if = _conditions(path, fields, "Collides-If", "exists")
    backport = None
    for value in fields.get("Upstream-Status", []):
        m = re.match(r"Backport\s*\[(?:vLLM\s+)?v?(\d+(?:\.\d+)+)", value, re.I)
        backport = m.group(1) if m else backport
    modified, created, deleted = [], [], []
    for block in re.split(r"^diff --git ", text, flags=re.M)[1:]:
        m = re.match(r"a/(\S+) b/(\S+)\n((?:(?!--- |\+\+\+ |@@ ).*\n)*)", block)
        if not m:
            continue
        header = m.group(3)
        if "new file mode" in header:
            created.append(m.group(2))
        elif "deleted file mode" in header:
            deleted.append(m.group(1))
        else:
            modified.append(m.group(1))
    return PatchInfo(path, modified, created, deleted, obsolete_if, backport, collides_if)


def _conditions(path: Path, fields: dict[str, list[str]], name: str,
                word: str) -> list[tuple[str, str | None]]:
    """(path, regex) of each `<name>: <path> matches <regex>`; (path, None)
    of each `<name>: <path> <word>`."""
    out = []
    for value in fields.get(name, []):
        cond = re.fullmatch(rf"(\S+)\s+(?:matches\s+(.+)|({word}))", value)
        if not cond:
            raise SeriesError(f"{path.name}: `{name}: {value}` is neither "
                              f"`<path> matches <regex>` nor `<path> {word}`")
        if cond.group(2):
            try:
                re.compile(cond.group(2))
            except re.error as e:
                raise SeriesError(f"{path.name}: bad regex in {name}: {e}") from None
        out.append((cond.group(1), cond.group(2)))
    return out
