"""patches/: the series file, and what a patch file says about itself.

The series file lists one `git format-patch` file a line, in `git am` order;
`#` starts a comment. A comment line `# == <name>: <title>` opens a section
(an area and its upstream fate); `# == <name>` alone resumes a section opened
earlier, since the order is the order the patches apply in and an area's
patches need not be adjacent. Every patch line belongs to the section last
opened above it. The tools keep every comment and section line when they
rewrite the file (`layout_series`).

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

import difflib
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from . import PATCH_DIR, SeriesError

FIELDS = ("Upstream-Status", "Obsolete-If", "Collides-If", "Tests")
_CRLF_HEADER = re.compile(rb"^(?:From |Subject: |diff --git )[^\n]*\r$", re.M)
_FIELD = re.compile(r"^([A-Z][A-Za-z0-9]*(?:-[A-Za-z0-9]+)*):(?:\s+(.*?))?\s*$")


# `# == <name>: <title>` or `# == <name>`; a comment whose text starts with `==`
# is a section line, and a malformed one is an error rather than a comment.
_SECTION_LINE = re.compile(r"\s*#\s*==(.*)")
_SECTION = re.compile(r"\s*([a-z][a-z0-9-]*)\s*(?::\s*(.*?))?\s*")


@dataclass
class SeriesLine:
    """One line of a series file."""
    lineno: int
    text: str
    name: str | None = None     # the patch file an entry line lists
    section: str | None = None  # entry: the section it is in; section line: the one it opens
    title: str = ""             # section line: its title ("" where it resumes a section)


def parse_series(text: str, where: str = "series") -> list[SeriesLine]:
    """The lines of a series file; SeriesError names the first malformed one."""
    lines: list[SeriesLine] = []
    opened: dict[str, tuple[int, str]] = {}  # section -> (line, title) where it was opened
    section = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = SeriesLine(lineno, raw)
        if m := _SECTION_LINE.fullmatch(raw):
            if not (s := _SECTION.fullmatch(m.group(1))):
                raise SeriesError(
                    f"{where}:{lineno}: malformed section line {raw.strip()!r}; expected "
                    "`# == <name>: <title>` to open a section or `# == <name>` to resume "
                    "one (name: lower-case letters, digits and -)")
            section, title = s.group(1), s.group(2) or ""
            if (first := opened.get(section)) is None:
                if not title:
                    raise SeriesError(
                        f"{where}:{lineno}: section `{section}` is opened without a title; "
                        f"write `# == {section}: <its area and upstream fate>`")
                opened[section] = (lineno, title)
            elif title and title != first[1]:
                raise SeriesError(
                    f"{where}:{lineno}: section `{section}` was opened on line {first[0]} "
                    f"with another title; resume it with `# == {section}` alone")
            line.section, line.title = section, title
        elif name := raw.split("#", 1)[0].strip():
            if len(name.split()) > 1:
                raise SeriesError(
                    f"{where}:{lineno}: {name!r} is not one file name; list one patch file "
                    "a line (quilt's options, such as -p1, are not supported)")
            line.name, line.section = name, section
        lines.append(line)
    return lines


def read_series_file(patch_dir: Path = PATCH_DIR) -> list[SeriesLine]:
    """The lines of patch_dir/series ([] when there is none)."""
    series = patch_dir / "series"
    if not series.exists():
        return []
    return parse_series(series.read_text(), str(series))


def series_sections(patch_dir: Path = PATCH_DIR) -> dict[str | None, tuple[str, list[str]]]:
    """{section: (title, its patches in order)}, sections in the order they are
    first opened; patches above the first section line are under None."""
    sections: dict[str | None, tuple[str, list[str]]] = {}
    for line in read_series_file(patch_dir):
        if line.title:
            sections.setdefault(line.section, (line.title, []))
        elif line.name:
            sections.setdefault(line.section, ("", []))[1].append(line.name)
    return sections


def format_sections(patch_dir: Path = PATCH_DIR) -> str:
    """The series grouped by section, each patch with its Upstream-Status: the
    areas at a glance (the file itself is in `git am` order, where a section
    may recur)."""
    read_series(patch_dir)  # every listed patch exists, each once
    out = []
    for section, (title, names) in series_sections(patch_dir).items():
        out.append(f"{section}: {title}" if section else "(in no section)")
        width = max(map(len, names), default=0)
        for name in names:
            status = header_fields((patch_dir / name).read_text()).get("Upstream-Status", ["?"])
            short = status[0] if len(status[0]) <= 60 else status[0][:57] + "..."
            out.append(f"  {name:<{width}}  {short}")
    return "\n".join(out)


def series_entries(patch_dir: Path = PATCH_DIR) -> list[tuple[int, str]]:
    """(line number, name) of each entry of patch_dir/series, in order."""
    return [(line.lineno, line.name) for line in read_series_file(patch_dir) if line.name]


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


def write_patches(patch_dir: Path, contents: dict[str, bytes], old: list[Path]) -> list[str]:
    """Make patch_dir hold `contents` ({name: bytes}, in series order) and a
    series file listing them, with the old series file's comment and section
    lines kept (`layout_series`); `old` is the series it held. Every file is
    written in full under a temporary name before any is replaced, and old
    patch files are deleted only once the new ones and the series are in
    place: a failure part-way loses no patch. Returns notes for the user on
    where new patches went in the series file."""
    patch_dir.mkdir(exist_ok=True)
    series, notes = layout_series(read_series_file(patch_dir), list(contents))
    notes = [f"{patch_dir.name}/series: {note}" for note in notes]
    staged: list[tuple[Path, Path]] = []
    try:
        for name, data in [*contents.items(), ("series", series.encode())]:
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
    return notes


def patch_slug(name: str) -> str:
    """A patch file's name without its number: what stays when patches before
    it are added or dropped."""
    return Path(name).name.split("-", 1)[-1]


def layout_series(old: list[SeriesLine], names: list[str]) -> tuple[str, list[str]]:
    """The series file that lists `names`, in this order, with every comment
    and section line of the `old` file kept above the patch it stood above.
    Old and new patches are matched by their names without the number
    (numbers shift when a patch is added or dropped), and a renamed patch
    (git format-patch names a patch after its subject) by its place between
    matched ones. The lines above a patch that is gone move down to the next
    one. A new patch follows the patch before it, so it is in that patch's
    section; a new first patch is in the first section. Returns (text,
    notes on where new patches went and on sections left without patches)."""
    entries = [line for line in old if line.name]
    above: list[list[str]] = []
    pending: list[str] = []
    for line in old:
        if line.name:
            above.append(pending)
            pending = []
        else:
            pending.append(line.text)
    match: dict[int, int] = {}  # index in names -> index in entries
    matcher = difflib.SequenceMatcher(None, [patch_slug(e.name or "") for e in entries],
                                      [patch_slug(n) for n in names], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag in ("equal", "replace"):
            match.update((j1 + k, i1 + k) for k in range(min(i2 - i1, j2 - j1)))
    out: list[str] = []
    done = 0  # entries whose lines above are in `out`
    for j, name in enumerate(names):
        if (i := match.get(j)) is not None:
            for k in range(done, i + 1):
                out += above[k]
            done = i + 1
            text = entries[i].text
            comment = text.find("#")
            out.append(name + (text[len(text[:comment].rstrip()):] if comment >= 0 else ""))
        else:
            if j == 0 and done < len(entries):  # no patch before it: the first section
                out += above[done]
                above[done] = []
            out.append(name)
    for k in range(done, len(entries)):
        out += above[k]
    out += pending
    text = "".join(f"{line}\n" for line in out)
    new = parse_series(text)
    notes = []
    if any(line.title for line in new):
        section = {line.name: line.section for line in new if line.name}
        for j in sorted(set(range(len(names))) - set(match)):
            where = (f"that of {names[j - 1]}, the patch before it" if j
                     else "the first section")
            listed = (f"in section `{section[names[j]]}` ({where})" if section[names[j]]
                      else "outside any section")
            notes.append(f"{names[j]} is new; it is listed {listed}. If it belongs to another "
                         "area, put a `# == <section>` line above it")
        notes += [f"section `{s}` (line {n}) lists no patch now; remove that line"
                  for s, n in empty_sections(new)]
    return text, notes


def empty_sections(lines: list[SeriesLine]) -> list[tuple[str, int]]:
    """(section, line) of each section line with no patch line before the next
    section line or the end of the file."""
    empty, current = [], None
    for line in lines:
        if line.name:
            current = None
        elif line.section:
            if current:
                empty.append(current)
            current = (line.section, line.lineno)
    return empty + ([current] if current else [])


def section_rule_violations(patch_dir: Path = PATCH_DIR) -> list[str]:
    """Where the series breaks the rule of docs/series.md: a patch that changes
    a file an earlier patch of the series creates is in that patch's section."""
    section = {line.name: line.section for line in read_series_file(patch_dir) if line.name}
    creator: dict[str, str] = {}
    bad = []
    for name, ours in section.items():
        path = patch_dir / name
        if not path.is_file():
            continue
        info = read_patch(path)
        for f in info.modified + info.deleted:
            if f in creator and (theirs := section[creator[f]]) != ours:
                fix = (f"move the change into a patch of section `{theirs}`, or put a "
                       f"`# == {theirs}` line above {name}" if theirs
                       else "every patch needs a section")
                bad.append(
                    f"{name} ({f'section `{ours}`' if ours else 'in no section'}) changes {f}, "
                    f"which {creator[f]} creates in "
                    f"{f'section `{theirs}`' if theirs else 'no section'}: {fix}")
        creator.update((f, name) for f in info.created)
    return bad


def series_digest(patches: list[Path]) -> str:
    """Digest of the series' names and contents: identifies the series."""
    digest = hashlib.sha256()
    for path in patches:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def version_label(digest: str) -> str:
    """A series digest as the last segment of the wheel's local version,
    written as PEP 440 normalizes it: a segment of digits alone is a
    number, so pip names the wheel without its leading zeros, and tools
    that look for the file by the version must do the same."""
    return str(int(digest)) if digest.isdigit() else digest


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
