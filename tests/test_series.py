"""Applying patches/series and exporting it back (scripts/patchseries/tree.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from patchseries import SeriesError
from patchseries import tree as tree_module
from patchseries.gitrepo import UPSTREAM_TAG, git
from patchseries.patchfile import layout_series, read_series, read_series_file, series_digest
from patchseries.pin import Pin, load_pin
from patchseries.tree import apply_series, export_series


def run_git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True,
                          capture_output=True, text=True).stdout.strip()


def make_fixture(tmp_path: Path) -> tuple[Path, Pin]:
    """A tiny 'upstream' checkout and a pin naming its commit."""
    up = tmp_path / "upstream"
    up.mkdir()
    run_git(up, "init", "-q", "-b", "main")
    (up / "a.py").write_text("".join(f"line {i}\n" for i in range(20)))
    (up / "b.py").write_text("b = 1\n")
    (up / ".gitignore").write_text("*.log\n.vscode/\n")
    run_git(up, "add", "-A")
    run_git(up, "commit", "-q", "-m", "release")
    sha = run_git(up, "rev-parse", "HEAD")
    pin = Pin(version="9.9.9", commit=sha[:12], sdist="vllm-9.9.9.tar.gz", sdist_sha256="0" * 64,
              wheel="vllm-9.9.9-x.whl", wheel_sha256="0" * 64, torch="2.11.0")
    return up, pin


def commit_change(tree: Path, path: str, old: str, new: str, subject: str) -> None:
    f = tree / path
    f.write_text(f.read_text().replace(old, new))
    run_git(tree, "commit", "-q", "-am", f"{subject}\n\nUpstream-Status: Pending")


@pytest.fixture
def fixture_series(tmp_path: Path, git_env):
    """Fixture upstream + a two-patch series exported by the tool itself."""
    up, pin = make_fixture(tmp_path)
    patches = tmp_path / "patches"
    tree = tmp_path / "tree"
    apply_series(pin, tree=tree, patch_dir=patches, src=up)
    commit_change(tree, "a.py", "line 3\n", "line three\n", "first change")
    commit_change(tree, "b.py", "b = 1\n", "b = 2\n", "second change")
    assert export_series(tree, patches)
    return up, pin, patches, tree


def test_fixture_round_trip_is_a_no_op(fixture_series, tmp_path):
    up, pin, patches, tree = fixture_series
    before = {p.name: p.read_bytes() for p in patches.iterdir()}
    assert (patches / "series").read_text().split() == sorted(n for n in before if n != "series")
    # Fresh tree from the exported series, then export again: same bytes.
    fresh = tmp_path / "fresh"
    apply_series(pin, tree=fresh, patch_dir=patches, src=up)
    assert not export_series(fresh, patches)
    assert {p.name: p.read_bytes() for p in patches.iterdir()} == before
    assert (fresh / "a.py").read_text() == (tree / "a.py").read_text()
    assert run_git(fresh, "log", "--format=%s", f"{UPSTREAM_TAG}..HEAD").split("\n") == [
        "second change", "first change"]


def test_conflict_names_patch_and_files_and_leaves_old_tree(fixture_series, tmp_path):
    up, pin, patches, tree = fixture_series
    # Upstream moves under the series: a.py's line 3 changed differently.
    commit_change(up, "a.py", "line 3\n", "line 3 (upstream edit)\n", "upstream edit")
    moved = Pin(**{**pin.__dict__, "commit": run_git(up, "rev-parse", "HEAD")[:12]})
    before = run_git(tree, "rev-parse", "HEAD")
    with pytest.raises(SeriesError) as err:
        apply_series(moved, tree=tree, patch_dir=patches, src=up)
    message = str(err.value)
    assert "0001-first-change.patch" in message and "a.py" in message
    # The existing tree is untouched and clean; no half-built tree remains.
    assert run_git(tree, "rev-parse", "HEAD") == before
    assert run_git(tree, "status", "--porcelain") == ""
    assert not (tmp_path / "tree.new").exists()


def test_conflict_into_a_new_tree_leaves_nothing(fixture_series, tmp_path):
    up, pin, patches, _ = fixture_series
    commit_change(up, "b.py", "b = 1\n", "b = 10\n", "upstream edit")
    moved = Pin(**{**pin.__dict__, "commit": run_git(up, "rev-parse", "HEAD")[:12]})
    target = tmp_path / "new-tree"
    with pytest.raises(SeriesError,
                       match=r"0002-second-change.patch does not apply; conflicts in: b.py"):
        apply_series(moved, tree=target, patch_dir=patches, src=up)
    assert not target.exists() and not (tmp_path / "new-tree.new").exists()


def test_unexported_work_is_never_discarded(fixture_series):
    up, pin, patches, tree = fixture_series
    commit_change(tree, "b.py", "b = 2\n", "b = 3\n", "work in progress")
    with pytest.raises(SeriesError, match="commits that are not in patches/"):
        apply_series(pin, tree=tree, patch_dir=patches, src=up)
    (tree / "b.py").write_text("dirty\n")
    with pytest.raises(SeriesError, match="uncommitted changes"):
        apply_series(pin, tree=tree, patch_dir=patches, src=up)
    assert (tree / "b.py").read_text() == "dirty\n"


def test_vllm_src_must_be_clean_and_at_the_pin(fixture_series, tmp_path):
    up, pin, patches, _ = fixture_series
    wrong = Pin(**{**pin.__dict__, "commit": "deadbeef"})
    with pytest.raises(SeriesError, match="is at .* the pin is"):
        apply_series(wrong, tree=tmp_path / "t1", patch_dir=patches, src=up)
    (up / "a.py").write_text("local edit\n")
    with pytest.raises(SeriesError, match="uncommitted changes"):
        apply_series(pin, tree=tmp_path / "t2", patch_dir=patches, src=up)


def test_series_applies_to_the_pinned_release_and_round_trips(repo, tmp_path, git_env):
    """The real series on the real sdist (downloaded once, cached)."""
    pin = load_pin()
    patches = read_series(repo / "patches")
    tree = apply_series(pin, tree=tmp_path / "vllm-src", patch_dir=repo / "patches")
    assert run_git(tree, "log", "-1", "--format=%s", UPSTREAM_TAG) == (
        f"vLLM {pin.version} (upstream {pin.commit})")
    assert int(run_git(tree, "rev-list", "--count", f"{UPSTREAM_TAG}..HEAD")) == len(patches)
    copy = tmp_path / "patches"
    copy.mkdir()
    for p in [repo / "patches" / "series", *patches]:
        copy.joinpath(p.name).write_bytes(p.read_bytes())
    assert not export_series(tree, copy), "re-exporting the applied series changed patches/"


def test_upstream_commit_is_reproducible(tmp_path, git_env):
    up, pin = make_fixture(tmp_path)
    a = apply_series(pin, tree=tmp_path / "a", patch_dir=tmp_path / "none", src=up)
    b = apply_series(pin, tree=tmp_path / "b", patch_dir=tmp_path / "none", src=up)
    assert git(a, "rev-parse", UPSTREAM_TAG).stdout == git(b, "rev-parse", UPSTREAM_TAG).stdout


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def newer_series(up: Path, pin: Pin, patches: Path, tmp_path: Path) -> dict[str, bytes]:
    """patches/ as a `git pull` would leave it: someone else changed patch
    0002 and exported. Returns the new contents."""
    other = apply_series(pin, tree=tmp_path / "other-clone", patch_dir=patches, src=up)
    commit_change(other, "b.py", "b = 2\n", "b = 22\n", "fixup! second change")
    subprocess.run(["git", "-C", str(other), "rebase", "-q", "-i", "--autosquash", UPSTREAM_TAG],
                   check=True, capture_output=True, env={**os.environ, "GIT_SEQUENCE_EDITOR": ":"})
    assert export_series(other, patches)
    return snapshot(patches)


def test_export_refuses_a_tree_applied_from_an_older_series(fixture_series, tmp_path):
    up, pin, patches, tree = fixture_series
    pulled = newer_series(up, pin, patches, tmp_path)
    # vllm-src/ still holds the series before the pull: exporting it would
    # silently revert the pulled change.
    with pytest.raises(SeriesError, match=r"not the series tree/ was applied from.*make apply"):
        export_series(tree, patches)
    assert snapshot(patches) == pulled
    # Work committed on top of the old series is refused the same way.
    commit_change(tree, "a.py", "line 5\n", "line five\n", "more work")
    with pytest.raises(SeriesError, match="not the series"):
        export_series(tree, patches)
    assert snapshot(patches) == pulled


def test_make_apply_then_export_after_a_pull(fixture_series, tmp_path):
    up, pin, patches, tree = fixture_series
    pulled = newer_series(up, pin, patches, tmp_path)
    apply_series(pin, tree=tree, patch_dir=patches, src=up)  # the tree held no work
    assert (tree / "b.py").read_text() == "b = 22\n"
    assert not export_series(tree, patches)
    assert snapshot(patches) == pulled
    commit_change(tree, "a.py", "line 5\n", "line five\n", "third change")
    assert export_series(tree, patches)
    assert (patches / "series").read_text().split()[-1] == "0003-third-change.patch"


@pytest.mark.parametrize("stop", ["edit", "break"])
def test_export_refuses_while_a_rebase_is_stopped(fixture_series, stop):
    up, pin, patches, tree = fixture_series
    before = snapshot(patches)
    # `git rebase -i` stopped after the first patch (state rebase-merge):
    # HEAD lacks the second patch and the work tree is clean.
    editor = ("sed -i '1s/^pick/edit/'" if stop == "edit" else "sed -i '1a break'")
    subprocess.run(["git", "-C", str(tree), "rebase", "-q", "-i", UPSTREAM_TAG], check=True,
                   capture_output=True, env={**os.environ, "GIT_SEQUENCE_EDITOR": editor})
    assert (tree / ".git" / "rebase-merge").is_dir()
    assert run_git(tree, "status", "--porcelain") == ""
    with pytest.raises(SeriesError, match=r"`git rebase` is in progress.*--continue"):
        export_series(tree, patches)
    with pytest.raises(SeriesError, match=r"`git rebase` is in progress"):
        apply_series(pin, tree=tree, patch_dir=patches, src=up)
    assert snapshot(patches) == before
    run_git(tree, "rebase", "--continue")
    assert not export_series(tree, patches)


def test_export_refuses_cherry_pick_merge_and_detached_head(fixture_series):
    up, pin, patches, tree = fixture_series
    before = snapshot(patches)
    run_git(tree, "checkout", "-q", "HEAD~1")
    with pytest.raises(SeriesError, match="detached HEAD"):
        export_series(tree, patches)
    run_git(tree, "checkout", "-q", "main")
    # What a merge or cherry-pick stopped by a conflict leaves in .git (the
    # conflict itself would also make the tree unclean).
    for state, what in (("MERGE_HEAD", "merge"), ("CHERRY_PICK_HEAD", "cherry-pick")):
        (tree / ".git" / state).write_text(run_git(tree, "rev-parse", "HEAD~1") + "\n")
        with pytest.raises(SeriesError, match=f"`git {what}` is in progress"):
            export_series(tree, patches)
        (tree / ".git" / state).unlink()
    assert snapshot(patches) == before
    assert not export_series(tree, patches)


def test_export_refuses_a_tree_on_another_release(fixture_series):
    up, pin, patches, tree = fixture_series
    before = snapshot(patches)
    moved = Pin(**{**pin.__dict__, "version": "9.9.10", "commit": "abcdef012345"})
    with pytest.raises(SeriesError, match=r"vLLM 9.9.9 .* vllm-pin.txt names vLLM 9.9.10"):
        export_series(tree, patches, pin=moved)
    assert snapshot(patches) == before
    assert not export_series(tree, patches, pin=pin)


def test_export_refuses_conflict_markers(fixture_series):
    up, pin, patches, tree = fixture_series
    before = snapshot(patches)
    commit_change(tree, "a.py", "line 7\n", "<<<<<<< HEAD\nline 7\n=======\nline seven\n"
                  ">>>>>>> theirs\n", "resolved badly")
    with pytest.raises(SeriesError, match=r"conflict markers in a\.py \(lines 8, 10, 12\)"):
        export_series(tree, patches)
    assert snapshot(patches) == before


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_apply_keeps_git_ignored_files(fixture_series, tmp_path, capsys, monkeypatch, exchange):
    up, pin, patches, tree = fixture_series
    if not exchange:  # a system without RENAME_EXCHANGE
        monkeypatch.setattr(tree_module, "_exchange", lambda a, b: False)
    (tree / ".vscode").mkdir()
    (tree / ".vscode" / "settings.json").write_text("{}\n")
    (tree / "serve.log").write_text("log\n")
    newer_series(up, pin, patches, tmp_path)
    capsys.readouterr()
    apply_series(pin, tree=tree, patch_dir=patches, src=up)  # rebuilds the tree
    assert (tree / "b.py").read_text() == "b = 22\n"
    assert (tree / ".vscode" / "settings.json").read_text() == "{}\n"
    assert (tree / "serve.log").read_text() == "log\n"
    assert "kept 2 git-ignored" in capsys.readouterr().out
    assert run_git(tree, "status", "--porcelain") == ""
    assert not (tmp_path / "tree.old").exists()


def test_two_applies_at_once_run_one_after_the_other(fixture_series, tmp_path, monkeypatch,
                                                    capfd):
    """A second `make apply` while one runs waits for it (lock beside the
    tree) instead of building in the same place at the same time."""
    up, pin, patches, _ = fixture_series
    target = tmp_path / "vllm-src"
    events: list[str] = []
    release = threading.Event()
    real = tree_module.import_upstream

    def slow_import(*args, **kwargs):
        name = threading.current_thread().name
        events.append(f"{name} imports")
        real(*args, **kwargs)
        if name == "first":
            release.wait(30)
        events.append(f"{name} imported")

    monkeypatch.setattr(tree_module, "import_upstream", slow_import)
    errors: list[BaseException] = []

    def run():
        try:
            apply_series(pin, tree=target, patch_dir=patches, src=up)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    first = threading.Thread(target=run, name="first")
    first.start()
    deadline = time.monotonic() + 60
    while not events and not errors and time.monotonic() < deadline:
        time.sleep(0.05)
    assert events == ["first imports"], (events, errors)
    second = threading.Thread(target=run, name="second")
    second.start()
    # The second run either says it waits, or (without the lock) starts to
    # build in the same place.
    err = ""
    while ("waiting for" not in err and "second imports" not in events
           and time.monotonic() < deadline):
        time.sleep(0.05)
        err += capfd.readouterr().err
    release.set()
    assert "waiting for" in err and "vllm-src.lock" in err
    first.join(60)
    second.join(60)
    assert not errors, errors
    # The second run did not start until the first was done; then it found
    # the tree up to date.
    assert events == ["first imports", "first imported"]
    assert int(run_git(target, "rev-list", "--count", f"{UPSTREAM_TAG}..HEAD")) == 2
    assert run_git(target, "status", "--porcelain") == ""
    assert (target / "b.py").read_text() == "b = 2\n"


def test_ignored_file_the_new_series_tracks_is_left_in_old(fixture_series, tmp_path, capsys):
    up, pin, patches, tree = fixture_series
    (tree / "serve.log").write_text("mine\n")
    other = apply_series(pin, tree=tmp_path / "other-clone", patch_dir=patches, src=up)
    (other / "serve.log").write_text("tracked\n")
    run_git(other, "add", "-f", "serve.log")
    run_git(other, "commit", "-q", "-m", "track a log\n\nUpstream-Status: Pending")
    assert export_series(other, patches)
    capsys.readouterr()
    apply_series(pin, tree=tree, patch_dir=patches, src=up)
    assert (tree / "serve.log").read_text() == "tracked\n"
    assert (tmp_path / "tree.old" / "serve.log").read_text() == "mine\n"
    assert "they are in tree.old/: serve.log" in capsys.readouterr().err
    with pytest.raises(SeriesError, match=r"tree.old/ is left from an earlier `make apply`.*"
                                          "take what you need"):
        apply_series(pin, tree=tree, patch_dir=patches, src=up)


def test_a_patch_listed_twice_under_another_spelling_is_refused(fixture_series, tmp_path):
    """`./0001-…` is the file `0001-…` names: apply would skip it as already
    applied, and export would delete it twice and crash."""
    up, pin, patches, tree = fixture_series
    series = patches / "series"
    series.write_text(series.read_text() + "./0001-first-change.patch\n")
    before = snapshot(patches)
    twice = (r"series:3: \./0001-first-change\.patch is listed twice \(also line 1, as "
             r"0001-first-change\.patch\)")
    with pytest.raises(SeriesError, match=twice):
        apply_series(pin, tree=tmp_path / "fresh", patch_dir=patches, src=up)
    with pytest.raises(SeriesError, match=twice):
        export_series(tree, patches)
    assert snapshot(patches) == before
    assert not (tmp_path / "fresh").exists()


def test_export_deletes_no_patch_before_the_new_ones_are_written(fixture_series):
    """A patch file that cannot be written (here: a folder holds its name)
    stops the export before any old patch file is deleted."""
    up, pin, patches, tree = fixture_series
    before = snapshot(patches)
    run_git(tree, "commit", "-q", "--amend", "-m", "second change renamed\n\n"
            "Upstream-Status: Pending")
    (patches / "0002-second-change-renamed.patch").mkdir()
    with pytest.raises(OSError):
        export_series(tree, patches)
    (patches / "0002-second-change-renamed.patch").rmdir()
    assert snapshot(patches) == before
    assert export_series(tree, patches)
    assert (patches / "series").read_text().split() == [
        "0001-first-change.patch", "0002-second-change-renamed.patch"]
    assert sorted(p.name for p in patches.iterdir()) == [
        "0001-first-change.patch", "0002-second-change-renamed.patch", "series"]


def test_a_patch_saved_with_crlf_line_endings_is_named(fixture_series, tmp_path):
    """An editor that saved a patch with Windows line endings: `git am
    --keep-cr` fails on it with a conflict that names some file, not the cause."""
    up, pin, patches, tree = fixture_series
    patch = patches / "0002-second-change.patch"
    patch.write_bytes(patch.read_bytes().replace(b"\n", b"\r\n"))
    before = snapshot(patches)
    with pytest.raises(SeriesError, match=r"series:2: 0002-second-change\.patch has CRLF "
                                          r"\(Windows\) line endings \(line 1\).*sed -i"):
        apply_series(pin, tree=tmp_path / "fresh", patch_dir=patches, src=up)
    with pytest.raises(SeriesError, match="CRLF"):
        export_series(tree, patches)
    assert snapshot(patches) == before


def test_apply_refuses_to_drop_other_branches_tags_and_stash(fixture_series, tmp_path):
    """Rebuilding vllm-src/ after a pull would lose what is not on main:
    refused, naming each, until they are gone or the tree is moved aside."""
    up, pin, patches, tree = fixture_series
    run_git(tree, "checkout", "-q", "-b", "experiment", "HEAD~1")
    commit_change(tree, "a.py", "line 9\n", "line nine\n", "an experiment")
    run_git(tree, "checkout", "-q", "main")
    run_git(tree, "tag", "before-pull")
    (tree / "a.py").write_text("stashed edit\n")
    run_git(tree, "stash", "-q")
    newer_series(up, pin, patches, tmp_path)
    head = run_git(tree, "rev-parse", "HEAD")
    with pytest.raises(SeriesError, match=r"would lose branch `experiment`, tag `before-pull`, "
                                          r"stash@\{0\} \(WIP on main: .*\).*mv tree tree\.keep"):
        apply_series(pin, tree=tree, patch_dir=patches, src=up)
    assert run_git(tree, "rev-parse", "HEAD") == head
    assert run_git(tree, "log", "-1", "--format=%s", "experiment") == "an experiment"
    assert run_git(tree, "stash", "list").count("\n") == 0 and run_git(tree, "stash", "list")
    # Once the user has kept or dropped them, the rebuild goes ahead.
    run_git(tree, "branch", "-D", "experiment")
    run_git(tree, "tag", "-d", "before-pull")
    run_git(tree, "stash", "clear")
    apply_series(pin, tree=tree, patch_dir=patches, src=up)
    assert (tree / "b.py").read_text() == "b = 22\n"


# --------------------------------------------------------------------------
# Sections of patches/series
# --------------------------------------------------------------------------

def sectioned(one: list[str], two: list[str]) -> str:
    """A series file with two sections, a comment above and one below."""
    return "".join(f"{line}\n" for line in [
        "# the fixture series", "# == one: the first area (upstream: Pending)", *one,
        "# == two: the second area", *two, "# the end"])


FIRST = "0001-first-change.patch  # a note"


def amend_content(tree: Path) -> None:
    commit_change(tree, "b.py", "b = 2\n", "b = 3\n", "fixup! second change")
    subprocess.run(["git", "-C", str(tree), "rebase", "-q", "-i", "--autosquash", UPSTREAM_TAG],
                   check=True, capture_output=True, env={**os.environ, "GIT_SEQUENCE_EDITOR": ":"})


def reword_second(tree: Path) -> None:
    run_git(tree, "commit", "-q", "--amend", "-m", "second change reworded\n\n"
            "Upstream-Status: Pending")


def append_third(tree: Path) -> None:
    commit_change(tree, "a.py", "line 5\n", "line five\n", "third change")


def insert_between(tree: Path) -> None:
    second = run_git(tree, "rev-parse", "HEAD")
    run_git(tree, "reset", "-q", "--hard", "HEAD~1")
    commit_change(tree, "a.py", "line 9\n", "line nine\n", "inserted change")
    run_git(tree, "cherry-pick", second)


def insert_first(tree: Path) -> None:
    head = run_git(tree, "rev-parse", "HEAD")
    run_git(tree, "reset", "-q", "--hard", UPSTREAM_TAG)
    commit_change(tree, "a.py", "line 9\n", "line nine\n", "new first change")
    run_git(tree, "cherry-pick", f"{UPSTREAM_TAG}..{head}")


def drop_first(tree: Path) -> None:
    run_git(tree, "rebase", "-q", "--onto", UPSTREAM_TAG, "HEAD~1")


@pytest.mark.parametrize(("change", "one", "two", "note"), [
    (amend_content, [FIRST], ["0002-second-change.patch"], None),
    (reword_second, [FIRST], ["0002-second-change-reworded.patch"], None),
    (append_third, [FIRST], ["0002-second-change.patch", "0003-third-change.patch"],
     "0003-third-change.patch is new; it is listed in section `two` (that of 0002-second"),
    (insert_between, [FIRST, "0002-inserted-change.patch"], ["0003-second-change.patch"],
     "0002-inserted-change.patch is new; it is listed in section `one` (that of 0001-first"),
    (insert_first, ["0001-new-first-change.patch", "0002-first-change.patch  # a note"],
     ["0003-second-change.patch"],
     "0001-new-first-change.patch is new; it is listed in section `one` (the first section)"),
    (drop_first, [], ["0001-second-change.patch"],
     "section `one` (line 2) lists no patch now; remove that line"),
], ids=["amend", "reword", "append", "insert", "insert-first", "drop"])
def test_export_keeps_the_section_lines(fixture_series, capsys, change, one, two, note):
    """`make patches` rewrites the list of patches, never the comment and
    section lines around it; a new patch joins the section of the one before."""
    up, pin, patches, tree = fixture_series
    (patches / "series").write_text(sectioned([FIRST], ["0002-second-change.patch"]))
    change(tree)
    capsys.readouterr()
    assert export_series(tree, patches)
    assert (patches / "series").read_text() == sectioned(one, two)
    out = capsys.readouterr().out
    assert (note in out) if note else "patches/series:" not in out
    assert sorted(p.name for p in patches.iterdir()) == sorted(
        [*(line.split()[0] for line in one + two), "series"])
    # The exported series is the applied one: no change on the next export.
    assert not export_series(tree, patches)


@pytest.mark.parametrize(("line", "message"), [
    ("# == Two: upper case", r"series:3: malformed section line '# == Two: upper case'"),
    ("# == two words", r"series:3: malformed section line"),
    ("#==", r"series:3: malformed section line '#=='"),
    ("# == two", r"series:3: section `two` is opened without a title"),
    ("# == one: another title", r"series:3: section `one` was opened on line 1 with another"),
    ("0002-second-change.patch -p1", r"series:3: '0002-second-change.patch -p1' is not one file"),
], ids=["upper-case", "no-colon", "no-name", "no-title", "two-titles", "quilt-option"])
def test_a_malformed_series_line_is_named_by_its_number(fixture_series, tmp_path, line, message):
    up, pin, patches, tree = fixture_series
    (patches / "series").write_text(f"# == one: the first area\n0001-first-change.patch\n{line}\n"
                                    "0002-second-change.patch\n")
    before = snapshot(patches)
    with pytest.raises(SeriesError, match=message):
        apply_series(pin, tree=tmp_path / "fresh", patch_dir=patches, src=up)
    with pytest.raises(SeriesError, match=message):
        export_series(tree, patches)
    assert snapshot(patches) == before
    assert not (tmp_path / "fresh").exists()


def test_section_lines_change_neither_the_order_nor_the_version(repo, tmp_path):
    """patches/series with its section lines lists the patches in the same
    order as the bare list of names, and the version digest (the patches'
    names and contents) is the same."""
    patches = read_series(repo / "patches")
    assert [p.name[:4] for p in patches] == [f"{i:04d}" for i in range(1, len(patches) + 1)]
    bare = tmp_path / "patches"
    bare.mkdir()
    for p in patches:
        (bare / p.name).write_bytes(p.read_bytes())
    (bare / "series").write_text("".join(f"{p.name}\n" for p in patches))
    assert [p.name for p in read_series(bare)] == [p.name for p in patches]
    assert series_digest(read_series(bare)) == series_digest(patches)
    # Rewriting the same patches (what `make patches` does) keeps the file as it is.
    text = (repo / "patches" / "series").read_text()
    assert layout_series(read_series_file(repo / "patches"), [p.name for p in patches]) == (
        text, [])
    listing = subprocess.run([sys.executable, str(repo / "scripts/series.py"), "sections"],
                             check=True, capture_output=True, text=True).stdout
    assert sorted(re.findall(r"^  (\S+\.patch)", listing, re.M)) == [p.name for p in patches]


def test_export_warns_of_a_change_outside_its_files_section(fixture_series, capsys):
    """A new patch that changes a file a patch of another section creates:
    the export writes it and names patch, file and the section it belongs to."""
    up, pin, patches, tree = fixture_series
    (patches / "series").write_text(sectioned([FIRST], ["0002-second-change.patch"]))
    second = run_git(tree, "rev-parse", "HEAD")
    run_git(tree, "reset", "-q", "--hard", "HEAD~1")
    (tree / "n.py").write_text("n = 1\n")
    run_git(tree, "add", "n.py")
    run_git(tree, "commit", "-q", "-m", "create n\n\nUpstream-Status: Pending")
    run_git(tree, "cherry-pick", second)
    commit_change(tree, "n.py", "n = 1\n", "n = 2\n", "change n")
    assert export_series(tree, patches)
    assert (patches / "series").read_text() == sectioned(
        [FIRST, "0002-create-n.patch"], ["0003-second-change.patch", "0004-change-n.patch"])
    err = capsys.readouterr().err
    assert ("warning: 0004-change-n.patch (section `two`) changes n.py, which "
            "0002-create-n.patch creates in section `one`") in err


def test_lint_holds_the_series_files_to_the_trees_own_ruff_rules(tmp_path, git_env, capfd):
    """series.py lint: ruff check and format, with the tree's configuration,
    on the .py files upstream..HEAD adds or changes; others are left alone."""
    from patchseries import lint

    tree = tmp_path / "tree"
    tree.mkdir()
    git(tree, "init", "-q")
    (tree / "pyproject.toml").write_text('[tool.ruff.lint]\nselect = ["F"]\n')
    (tree / "untouched.py").write_text("import os\nx  =  1\n")  # unformatted, unused import
    (tree / "gone.py").write_text("x = 1\n")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", "upstream")
    git(tree, "tag", UPSTREAM_TAG)
    (tree / "gone.py").unlink()
    (tree / "new.py").write_text("x = 1\n")
    (tree / "notes.txt").write_text("not python\n")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", "a patch")
    assert lint.series_python_files(tree) == ["new.py"]
    assert lint.lint(sys.executable, tree) == 0
    (tree / "new.py").write_text("import os\nx  =  1\n")
    git(tree, "commit", "-q", "-am", "a patch that fails both")
    assert lint.lint(sys.executable, tree) == 1
    out = capfd.readouterr().out
    assert "F401" in out and "new.py" in out and "untouched.py" not in out
    (tree / "new.py").write_text("x  =  1\n")
    git(tree, "commit", "-q", "-am", "unformatted only")
    assert lint.lint(sys.executable, tree) == 1
    with pytest.raises(SeriesError, match="make apply"):
        lint.series_python_files(tmp_path / "missing")


@pytest.mark.parametrize("digest,label", [("01951830", "1951830"), ("00000000", "0"),
                                          ("12345678", "12345678"), ("a7e4804c", "a7e4804c"),
                                          ("0abc1234", "0abc1234")])
def test_the_wheel_version_is_as_pip_writes_it(digest, label):
    """The version build.sh looks the built wheel up by is PEP 440's
    normal form: an all-digit digest loses its leading zeros in the
    wheel's name (series 01951830 failed to build before)."""
    from packaging.version import Version

    from patchseries.patchfile import version_label

    version = f"0.23.0+dsa.sm120.{version_label(digest)}"
    assert version_label(digest) == label
    assert str(Version(version)) == version
