"""Applying patches/series and exporting it back (scripts/patchseries/tree.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from patchseries import SeriesError
from patchseries.pin import Pin, load_pin
from patchseries.gitrepo import UPSTREAM_TAG, git
from patchseries.patchfile import read_series
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
    with pytest.raises(SeriesError, match=r"0002-second-change.patch does not apply; conflicts in: b.py"):
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
