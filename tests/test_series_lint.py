"""Lint of patches/ and of the documents that describe the repository.

Small single-purpose checks; each reports every offender it finds, not only
the first. The header rules (see docs/series.md, "Working on the series"):

- `Upstream-Status:` once per patch, one of Pending, Submitted [where],
  Accepted, Backport [vLLM X], Denied, Inappropriate [why];
- `Tests:` names the test files that cover the patch (or says `none [why]`);
  every path it names exists in this repository;
- `Obsolete-If:` is `<path> is gone` or `<path> matches <regex>`.
- `Collides-If:` is `<path> exists` or `<path> matches <regex>`.

A field may go on over several lines (scripts/patchseries/patchfile.py).

The series rules (docs/series.md, "Sections"): every patch is in a section,
every section line lists patches, and a patch that changes a file an earlier
patch of the series creates is in that patch's section.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from patchseries import SeriesError
from patchseries.patchfile import (
    empty_sections,
    header_fields,
    paths_in_tests_field,
    read_patch,
    read_series_file,
    section_rule_violations,
    series_entries,
)

STATUS = re.compile(
    r"(?:Pending|Accepted|Denied)(?: \[.+\])?"
    r"|Submitted \[.+\]"
    r"|Backport \[vLLM \d+(?:\.\d+)+(?:[ ,;(].*)?\]"
    r"|Inappropriate \[.+\]")


def patches_in_series(patch_dir: Path) -> list[Path]:
    return [patch_dir / name for _, name in series_entries(patch_dir)
            if (patch_dir / name).is_file()]


def repo_files(repo: Path) -> set[str]:
    """Paths of the files in the repository's tree: tracked, or new and not
    ignored (what a commit would hold)."""
    result = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], capture_output=True, text=True)
    if result.returncode:  # not a git checkout (an unpacked archive): the files on disk
        return {str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file()}
    return {name for name in result.stdout.split("\0") if name and (repo / name).exists()}


def in_tree(path: str, files: set[str]) -> bool:
    """A file or directory of the repository's tree; globs match one file at least."""
    path = path.rstrip("/")
    if any(c in path for c in "*?["):
        pattern = re.compile(re.escape(path).replace(r"\*", "[^/]*").replace(r"\?", "[^/]"))
        return any(pattern.fullmatch(f) for f in files)
    return path in files or any(f.startswith(path + "/") for f in files)


# --------------------------------------------------------------------------
# patches/series
# --------------------------------------------------------------------------

def test_every_series_entry_exists(repo):
    patch_dir = repo / "patches"
    missing = [f"series:{n}: {name}" for n, name in series_entries(patch_dir)
               if not (patch_dir / name).is_file()]
    assert not missing, f"entries of patches/series that are not files: {missing}"


def test_no_duplicate_series_entries(repo):
    seen: dict[str, int] = {}
    twice = []
    for n, name in series_entries(repo / "patches"):
        key = os.path.normpath(name)  # ./0001-x.patch is 0001-x.patch
        if key in seen:
            twice.append(f"{name} (lines {seen[key]} and {n})")
        seen.setdefault(key, n)
    assert not twice, f"listed twice in patches/series: {twice}"


def test_no_patch_file_outside_the_series(repo):
    listed = {f"patches/{name}" for _, name in series_entries(repo / "patches")}
    stray = sorted(f for f in repo_files(repo) if f.endswith(".patch") and f not in listed)
    assert not stray, (f".patch files that patches/series does not list (add them to the "
                       f"series or remove them): {stray}")


def test_series_file_parses(repo):
    try:
        read_series_file(repo / "patches")
    except SeriesError as e:
        pytest.fail(str(e))


def test_every_patch_is_in_a_section(repo):
    outside = [f"series:{line.lineno}: {line.name}" for line in read_series_file(repo / "patches")
               if line.name and not line.section]
    assert not outside, ("patches above the first `# == <name>: <title>` line of patches/series; "
                         f"every patch is in a section: {outside}")


def test_every_section_line_lists_patches(repo):
    empty = [f"series:{n}: `# == {section}`"
             for section, n in empty_sections(read_series_file(repo / "patches"))]
    assert not empty, f"section lines of patches/series with no patch under them: {empty}"


def test_series_created_files_change_in_their_creators_section(repo):
    bad = section_rule_violations(repo / "patches")
    assert not bad, ("a patch changes a file that an earlier patch creates, from another "
                     "section (docs/series.md, \"Sections\"):\n" + "\n".join(bad))


def fake_patch(patches: Path, name: str, created: tuple[str, ...] = (),
               changed: tuple[str, ...] = (), deleted: tuple[str, ...] = ()) -> None:
    """A git format-patch file that creates, changes and deletes these files."""
    diffs = "".join(
        f"diff --git a/{f} b/{f}\n{mode}index 0000000..1111111\n--- a/{f}\n+++ b/{f}\n"
        "@@ -0,0 +1 @@\n+x\n"
        for files, mode in ((created, "new file mode 100644\n"), (changed, ""),
                            (deleted, "deleted file mode 100644\n"))
        for f in files)
    (patches / name).write_text(f"From 0\nSubject: [PATCH] {name}\n\nWhat.\nWhy.\n\n"
                                f"Upstream-Status: Pending\n---\n{diffs}")


@pytest.mark.parametrize(("series", "offender"), [
    # The creator and the patches that change its file in one section, or in
    # that section resumed further down: the rule holds.
    (["# == a: area a", "0001-create.patch", "0002-change.patch", "0003-delete.patch"], None),
    (["# == a: area a", "0001-create.patch", "# == b: area b", "0004-upstream.patch", "# == a",
      "0002-change.patch"], None),
    # An upstream file (no patch creates it) may change in any section.
    (["# == a: area a", "0001-create.patch", "# == b: area b", "0004-upstream.patch"], None),
    # A change from another section, or from no section, names patch, file and sections.
    (["# == a: area a", "0001-create.patch", "# == b: area b", "0002-change.patch"],
     ("0002-change.patch", "section `b`", "section `a`")),
    (["# == a: area a", "0001-create.patch", "# == b: area b", "0003-delete.patch"],
     ("0003-delete.patch", "section `b`", "section `a`")),
    (["0001-create.patch", "# == a: area a", "0002-change.patch"],
     ("0002-change.patch", "section `a`", "no section")),
], ids=["same-section", "resumed-section", "upstream-file", "other-section", "deleted-there",
        "creator-outside-sections"])
def test_section_rule(tmp_path, series, offender):
    patches = tmp_path / "patches"
    patches.mkdir()
    fake_patch(patches, "0001-create.patch", created=("pkg/new.py",), changed=("pkg/old.py",))
    fake_patch(patches, "0002-change.patch", changed=("pkg/new.py", "pkg/old.py"))
    fake_patch(patches, "0003-delete.patch", deleted=("pkg/new.py",))
    fake_patch(patches, "0004-upstream.patch", changed=("pkg/old.py",))
    (patches / "series").write_text("".join(f"{line}\n" for line in series))
    if offender is None:
        test_series_created_files_change_in_their_creators_section(tmp_path)
        return
    name, ours, theirs = offender
    message = f"{name} ({ours}) changes pkg/new.py, which 0001-create.patch creates in {theirs}"
    with pytest.raises(AssertionError, match=re.escape(message)):
        test_series_created_files_change_in_their_creators_section(tmp_path)


@pytest.mark.parametrize(("check", "series", "offender"), [
    (test_every_patch_is_in_a_section, "0001-create.patch\n# == a: area a\n0002-change.patch\n",
     "series:1: 0001-create.patch"),
    (test_every_section_line_lists_patches,
     "# == a: area a\n# a comment\n# == b: area b\n0001-create.patch\n# == a\n",
     "series:1: `# == a`', 'series:5: `# == a`"),
    (test_series_file_parses, "# == a: area a\n0001-create.patch\n# == A: area A\n",
     "series:3: malformed section line"),
], ids=["outside-sections", "empty-sections", "malformed"])
def test_section_checks_find_their_problem(tmp_path, check, series, offender):
    patches = tmp_path / "patches"
    patches.mkdir()
    fake_patch(patches, "0001-create.patch", created=("pkg/new.py",))
    fake_patch(patches, "0002-change.patch", changed=("pkg/new.py",))
    (patches / "series").write_text(series)
    with pytest.raises((AssertionError, pytest.fail.Exception), match=re.escape(offender)):
        check(tmp_path)


# --------------------------------------------------------------------------
# Patch headers
# --------------------------------------------------------------------------

def test_every_patch_says_what_and_why(repo):
    bad = []
    for patch in patches_in_series(repo / "patches"):
        head = patch.read_text().split("\n---\n", 1)[0]
        if "Subject: [PATCH]" not in head:
            bad.append(f"{patch.name}: no `Subject: [PATCH]` line (not git format-patch output)")
            continue
        body = head.split("Subject:", 1)[1]
        if len(body.strip().splitlines()) < 3:
            bad.append(f"{patch.name}: says nothing of what and why")
    assert not bad, "\n".join(bad)


def test_upstream_status_is_from_the_closed_set(repo):
    bad = []
    for patch in patches_in_series(repo / "patches"):
        values = header_fields(patch.read_text()).get("Upstream-Status", [])
        if len(values) != 1:
            bad.append(f"{patch.name}: {len(values)} `Upstream-Status:` fields, expected 1")
        bad += [f"{patch.name}: `Upstream-Status: {v}`" for v in values
                if not STATUS.fullmatch(v)]
    assert not bad, ("expected Pending | Submitted [where] | Accepted | Backport [vLLM X] | "
                     "Denied | Inappropriate [why]; found:\n" + "\n".join(bad))


def test_tests_field_names_files_that_exist(repo):
    files = repo_files(repo)
    bad = []
    for patch in patches_in_series(repo / "patches"):
        values = header_fields(patch.read_text()).get("Tests", [])
        if not values:
            bad.append(f"{patch.name}: no `Tests:` field")
        for value in values:
            paths = paths_in_tests_field(value)
            if not paths and not re.match(r"none\b", value, re.I):
                bad.append(f"{patch.name}: `Tests: {value[:60]}` names no test file "
                           "(say `Tests: none [why]` if there is none)")
            bad += [f"{patch.name}: Tests: {p} is not in the repository"
                    for p in paths if not in_tree(p, files)]
    assert not bad, "\n".join(bad)


def test_obsolete_if_conditions_parse(repo):
    bad = []
    for patch in patches_in_series(repo / "patches"):
        try:
            read_patch(patch)
        except SeriesError as e:
            bad.append(str(e))
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(("value", "valid"), [
    ("Pending", True), ("Submitted [vllm-project/vllm#12345]", True), ("Accepted", True),
    ("Backport [vLLM 0.33.0]", True), ("Denied", True),
    ("Inappropriate [vLLM removed the GGUF loader in 0.24]", True),
    ("pending", False), ("Submitted", False), ("Backport [0.33.0]", False),
    ("Backport [vLLM next]", False), ("Inappropriate", False), ("Inappropriate []", False),
    ("Upstreamed", False), ("Pending, see PR", False),
])
def test_status_rule(value, valid):
    assert bool(STATUS.fullmatch(value)) == valid


def test_fields_spanning_lines_and_node_ids():
    text = ("Subject: [PATCH] x\n\nWhat and why.\n\nUpstream-Status: Inappropriate [vLLM\n"
            " 0.24 removed the loader]\nTests: tests/a/test_one.py (numerics), tests/b/\n"
            "test_two.py::test_case*, and a note: fp16/bf16 on sm_120/121.\n\n"
            "Not a field: text.\n---\n diff\n")
    fields = header_fields(text)
    assert fields["Upstream-Status"] == ["Inappropriate [vLLM 0.24 removed the loader]"]
    assert STATUS.fullmatch(fields["Upstream-Status"][0])
    # A path broken at a line end cannot be told from two words; the common
    # case, `file.py::` then the test name on the next line, keeps the path.
    assert paths_in_tests_field("tests/b/test_sel.py:: test_explicit*, tests/k/") == [
        "tests/b/test_sel.py", "tests/k/"]
    assert paths_in_tests_field(fields["Tests"][0])[0] == "tests/a/test_one.py"


# --------------------------------------------------------------------------
# Documents refer only to files that are in the tree
# --------------------------------------------------------------------------

_TOP = ("scripts/", "tests/", "bench/", "docs/", "patches/", ".ci/")
_TOP_FILES = ("build.sh", "Makefile", "vllm-pin.txt", "README.md")


def referenced_paths(doc: str, text: str) -> list[str]:
    """Repository paths a markdown document refers to: its relative link
    targets (relative to the document) and, in README.md, `code` spans that
    start with one of the repository's folders or name a top-level file
    (other documents quote vLLM's paths in code spans). Placeholders (<...>,
    {...}, $VAR, ...) are skipped."""
    refs = []
    for m in re.finditer(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+:|/", m.group(1)):
            refs.append(os.path.normpath(os.path.join(os.path.dirname(doc), m.group(1))))
    for m in re.finditer(r"`([^`\s]+)`", text if doc == "README.md" else ""):
        word = m.group(1).split("::", 1)[0]
        if (word.startswith(_TOP) or word in _TOP_FILES) and not re.search(r"[<>…{}$]", word):
            refs.append(word)
    return refs


def test_documents_refer_only_to_files_in_the_tree(repo):
    files = repo_files(repo)
    bad = [f"{doc}: {ref}"
           for doc in sorted(f for f in files if f.endswith(".md"))
           for ref in referenced_paths(doc, (repo / doc).read_text())
           if not in_tree(ref, files)]
    assert not bad, "documents name files that are not in the tree:\n" + "\n".join(bad)


def test_each_check_finds_its_problem(tmp_path):
    """The checks above on a made-up repository with one fault each."""
    patches = tmp_path / "patches"
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_real.py").write_text("")
    patches.mkdir()

    def patch(name: str, fields: str) -> None:
        (patches / name).write_text(f"From 0\nSubject: [PATCH] {name}\n\nWhat.\nWhy.\n\n"
                                    f"{fields}\n---\n a | 1 +\n")

    patch("0001-good.patch", "Upstream-Status: Pending\nTests: tests/test_real.py")
    patch("0002-bad-status.patch", "Upstream-Status: Upstreamed\nTests: tests/test_real.py")
    patch("0003-missing-test.patch", "Upstream-Status: Denied\nTests: tests/test_gone.py")
    patch("0004-stray.patch", "Upstream-Status: Pending\nTests: tests/test_real.py")
    patch("0005-bad-obsolete-if.patch",
          "Upstream-Status: Pending\nObsolete-If: a.py vanishes\nTests: tests/test_real.py")
    (patches / "series").write_text("0001-good.patch\n0002-bad-status.patch\n"
                                    "0003-missing-test.patch\n0001-good.patch\n"
                                    "0005-bad-obsolete-if.patch\n0006-absent.patch\n")
    (tmp_path / "README.md").write_text("See [gone](docs/gone.md) and `scripts/gone.py`.\n")
    checks = {
        test_every_series_entry_exists: "0006-absent.patch",
        test_no_duplicate_series_entries: "0001-good.patch (lines 1 and 4)",
        test_no_patch_file_outside_the_series: "patches/0004-stray.patch",
        test_upstream_status_is_from_the_closed_set: "0002-bad-status.patch",
        test_tests_field_names_files_that_exist: "tests/test_gone.py",
        test_obsolete_if_conditions_parse: "0005-bad-obsolete-if.patch",
        test_documents_refer_only_to_files_in_the_tree: "docs/gone.md",
    }
    for check, offender in checks.items():
        with pytest.raises(AssertionError, match=re.escape(offender)):
            check(tmp_path)
    (tmp_path / "README.md").write_text("`scripts/gone.py`\n")
    with pytest.raises(AssertionError, match="scripts/gone.py"):
        test_documents_refer_only_to_files_in_the_tree(tmp_path)
