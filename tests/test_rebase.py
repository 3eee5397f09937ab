"""Carrying the series to another vLLM (scripts/patchseries/rebase.py, with
release.py for the target and compat.py for docs/compatibility.md).

Fixture repositories cover the conflict / write / interrupt paths in seconds;
one test rebases the real series onto the real vLLM 0.24.0 release.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from patchseries import SeriesError, compat, release
from patchseries import rebase as rb
from patchseries.fetch import fetch_file
from patchseries.patchfile import read_series
from patchseries.pin import Pin, load_pin, pin_text
from patchseries.tree import apply_series, export_series


def run_git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True,
                          capture_output=True, text=True).stdout.strip()


def edit(repo: Path, path: str, old: str | None, new: str | None) -> None:
    """Replace text in a file (old None: create it; new None: delete it)."""
    f = repo / path
    if new is None:
        f.unlink()
    else:
        f.write_text(new if old is None else f.read_text().replace(old, new, 1))


def commit(repo: Path, subject: str) -> str:
    run_git(repo, "add", "-A")
    run_git(repo, "commit", "-q", "-m", f"{subject}\n\nUpstream-Status: Pending")
    return run_git(repo, "rev-parse", "HEAD")


def fake_pin(version: str, commit_id: str) -> Pin:
    return Pin(version=version, commit=commit_id[:12], sdist=f"vllm-{version}.tar.gz",
               sdist_sha256="1" * 64, wheel=f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl",
               wheel_sha256="2" * 64, torch="2.11.0")


def snapshot(*dirs: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for d in dirs for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def project(tmp_path: Path, git_env):
    """A fixture 'vLLM' checkout at release 1.0, and a copy of the project's
    patches/ + vllm-pin.txt holding a four-patch series made by the tools."""
    up = tmp_path / "upstream"
    up.mkdir()
    run_git(up, "init", "-q", "-b", "main")
    edit(up, "a.py", None, "".join(f"line {i}\n" for i in range(20)))
    edit(up, "b.py", None, "b = 1\n")
    edit(up, "c.py", None, "c = 1\n")
    v1 = commit(up, "release 1.0")
    pin = fake_pin("1.0", v1)
    proj = tmp_path / "project"
    proj.mkdir()
    pin_file = proj / "vllm-pin.txt"
    pin_file.write_text(pin_text(pin))
    patches, work = proj / "patches", proj / "vllm-src"
    apply_series(pin, tree=work, patch_dir=patches, src=up)
    edit(work, "a.py", "line 10\n", "line ten\n")
    commit(work, "edit a")
    edit(work, "b.py", "b = 1\n", "b = 2\n")
    commit(work, "edit b")
    edit(work, "c.py", "c = 1\n", "c = 2\n")
    commit(work, "edit c")
    edit(work, "d.py", None, "d = 1\n")
    commit(work, "add d")
    assert export_series(work, patches)
    return up, pin, pin_file, patches


def target_at(up: Path, version: str, with_pin: bool = True) -> release.Target:
    sha = run_git(up, "rev-parse", "HEAD")
    return release.Target(version=version, commit=sha[:12], checkout=up, ref=sha,
                     pin=fake_pin(version, sha) if with_pin else None)


def statuses(outcome: rb.RebaseOutcome) -> list[str]:
    return [r.status for r in outcome.results]


def test_write_regenerates_a_series_that_reproduces_the_rebased_tree(project, tmp_path):
    up, pin, pin_file, patches = project
    # Release 2.0: lines inserted above a.py's edit and a line of its
    # context changed (3-way merge), b's change already made upstream, c.py
    # deleted, an unrelated new file.
    edit(up, "a.py", "line 0\n", "header 1\nheader 2\nline 0\n")
    edit(up, "a.py", "line 12\n", "line 12 (upstream)\n")
    edit(up, "b.py", "b = 1\n", "b = 2\n")
    edit(up, "c.py", "", None)
    edit(up, "e.py", None, "e = 1\n")
    commit(up, "release 2.0")
    target = target_at(up, "2.0")
    work = tmp_path / "rebase"
    outcome = rb.rebase(target, pin, patches, work, write=True, pin_file=pin_file)

    assert statuses(outcome) == [rb.OFFSETS, rb.OBSOLETE, rb.OBSOLETE, rb.APPLIED]
    assert outcome.results[0].detail == "3-way merge"
    assert "already upstream" in outcome.results[1].detail
    assert outcome.results[2].detail == "gone upstream: c.py"
    assert outcome.carried and outcome.written
    # Obsolete patches are dropped and the rest renumbered; the pin moved.
    assert (patches / "series").read_text() == "0001-edit-a.patch\n0002-add-d.patch\n"
    assert sorted(p.name for p in patches.iterdir()) == ["0001-edit-a.patch", "0002-add-d.patch",
                                                          "series"]
    assert load_pin(pin_file) == target.pin
    # The new series on the new base is exactly the rebased tree ...
    fresh = apply_series(load_pin(pin_file), tree=tmp_path / "fresh", patch_dir=patches, src=up)
    assert run_git(fresh, "rev-parse", "HEAD^{tree}") == run_git(work, "rev-parse", "main^{tree}")
    assert (fresh / "a.py").read_text().startswith("header 1\nheader 2\nline 0\n")
    assert "\nline 9\nline ten\nline 11\nline 12 (upstream)\n" in (fresh / "a.py").read_text()
    # ... and re-exports byte for byte.
    assert not export_series(fresh, patches)


@pytest.mark.parametrize(("d_upstream", "expected", "note"), [
    (False, ["# == ab: a and b (upstream: Pending)", "0001-edit-a.patch", "# == cd: c and d",
             "0002-add-d.patch"], None),
    (True, ["# == ab: a and b (upstream: Pending)", "0001-edit-a.patch", "# == cd: c and d"],
     "patches/series: section `cd` (line 3) lists no patch now; remove that line"),
], ids=["a-patch-left", "section-emptied"])
def test_write_keeps_the_section_lines(project, tmp_path, capsys, d_upstream, expected, note):
    """Obsolete patches leave the series; the section lines stay, and one
    that no longer lists a patch is named."""
    up, pin, pin_file, patches = project
    (patches / "series").write_text(
        "# == ab: a and b (upstream: Pending)\n0001-edit-a.patch\n0002-edit-b.patch\n"
        "# == cd: c and d\n0003-edit-c.patch\n0004-add-d.patch\n")
    edit(up, "b.py", "b = 1\n", "b = 2\n")
    edit(up, "c.py", "", None)
    if d_upstream:
        edit(up, "d.py", None, "d = 1\n")
    commit(up, "release 2.0")
    capsys.readouterr()
    outcome = rb.rebase(target_at(up, "2.0"), pin, patches, tmp_path / "rebase", write=True,
                        pin_file=pin_file)
    assert outcome.written
    assert (patches / "series").read_text() == "".join(f"{line}\n" for line in expected)
    out = capsys.readouterr().out
    assert (note in out) if note else "patches/series:" not in out


def test_conflict_leaves_patches_and_pin_byte_identical(project, tmp_path):
    up, pin, pin_file, patches = project
    edit(up, "a.py", "line 10\n", "line 10 (changed upstream)\n")
    commit(up, "release 2.0")
    before = snapshot(patches) | {"pin": pin_file.read_bytes()}
    work = tmp_path / "rebase"
    outcome = rb.rebase(target_at(up, "2.0"), pin, patches, work, write=True, pin_file=pin_file)

    assert statuses(outcome) == [rb.CONFLICT, rb.APPLIED, rb.APPLIED, rb.APPLIED]
    assert outcome.results[0].detail == "a.py (1 hunk)"
    assert not outcome.carried and not outcome.written
    assert snapshot(patches) | {"pin": pin_file.read_bytes()} == before
    # The work tree is stopped in `git am` at the conflict, markers in place,
    # the later patches queued: the user can finish by hand.
    assert (work / ".git" / "rebase-apply").is_dir()
    assert "<<<<<<<" in (work / "a.py").read_text()
    assert "git am --continue" in rb.instructions(work, outcome)
    # A second rebase refuses to throw that work away.
    with pytest.raises(SeriesError, match="unfinished `git am`"):
        rb.rebase(target_at(up, "2.0"), pin, patches, work, pin_file=pin_file)
    assert snapshot(patches) | {"pin": pin_file.read_bytes()} == before

    # Resolve, continue, then --finish writes the hand-made series.
    edit(work, "a.py", None, "".join(f"line {i}\n" for i in range(20)).replace(
        "line 10\n", "line ten (changed upstream)\n"))
    run_git(work, "add", "a.py")
    subprocess.run(["git", "-C", str(work), "am", "--continue"], check=True, capture_output=True)
    with pytest.raises(SeriesError, match="resolved by hand"):  # not before --finish
        rb.rebase(target_at(up, "2.0"), pin, patches, work, pin_file=pin_file)
    written = rb.finish(work, patches, pin_file)
    assert [p.name for p in written] == [p.name for p in read_series(patches)]
    assert len(written) == 4 and load_pin(pin_file).commit == target_at(up, "2.0").commit
    fresh = apply_series(load_pin(pin_file), tree=tmp_path / "fresh", patch_dir=patches, src=up)
    assert run_git(fresh, "rev-parse", "HEAD^{tree}") == run_git(work, "rev-parse", "HEAD^{tree}")


def test_finish_refuses_conflict_markers(project, tmp_path):
    up, pin, pin_file, patches = project
    edit(up, "a.py", "line 10\n", "line 10 (changed upstream)\n")
    commit(up, "release 2.0")
    before = snapshot(patches) | {"pin": pin_file.read_bytes()}
    work = tmp_path / "rebase"
    rb.rebase(target_at(up, "2.0"), pin, patches, work, write=True, pin_file=pin_file)
    # The user marks the file resolved without resolving it.
    run_git(work, "add", "a.py")
    subprocess.run(["git", "-C", str(work), "am", "--continue"], check=True, capture_output=True)
    with pytest.raises(SeriesError, match=r"conflict markers in a\.py \(lines \d+, \d+, \d+\)"):
        rb.finish(work, patches, pin_file)
    assert snapshot(patches) | {"pin": pin_file.read_bytes()} == before
    # Resolved there, but markers in a later patch's file: refused, named.
    edit(work, "a.py", None, "".join(f"line {i}\n" for i in range(20)))
    run_git(work, "commit", "-q", "-a", "-m", "resolved")
    edit(work, "c.py", "c = 2\n", "<<<<<<< ours\nc = 2\n=======\nc = 3\n>>>>>>> theirs\n")
    run_git(work, "commit", "-q", "-a", "-m", "markers")
    with pytest.raises(SeriesError, match=r"conflict markers in c\.py \(lines 1, 3, 5\):"):
        rb.finish(work, patches, pin_file)
    assert snapshot(patches) | {"pin": pin_file.read_bytes()} == before


def test_interrupted_rebase_changes_nothing(project, tmp_path, monkeypatch):
    up, pin, pin_file, patches = project
    edit(up, "e.py", None, "e = 1\n")
    commit(up, "release 2.0")
    before = snapshot(patches) | {"pin": pin_file.read_bytes()}
    real, calls = rb._classify, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(rb, "_classify", interrupted)
    with pytest.raises(KeyboardInterrupt):
        rb.rebase(target_at(up, "2.0"), pin, patches, tmp_path / "rebase", write=True,
                  pin_file=pin_file)
    assert snapshot(patches) | {"pin": pin_file.read_bytes()} == before
    assert (tmp_path / "rebase" / ".git").is_dir()  # the partial work stays


def test_write_needs_a_release(project, tmp_path):
    up, pin, pin_file, patches = project
    edit(up, "e.py", None, "e = 1\n")
    edit(up, "a.py", "line 0\n", "header\nline 0\n")
    commit_id = commit(up, "main, no release")
    before = snapshot(patches) | {"pin": pin_file.read_bytes()}
    with pytest.raises(SeriesError, match="not a vLLM release"):
        rb.rebase(target_at(up, commit_id[:9], with_pin=False), pin, patches, tmp_path / "r",
                  write=True, pin_file=pin_file)
    assert snapshot(patches) | {"pin": pin_file.read_bytes()} == before
    # Without --write it still reports.
    outcome = rb.rebase(target_at(up, commit_id[:9], with_pin=False), pin, patches,
                        tmp_path / "r", pin_file=pin_file)
    assert outcome.carried and statuses(outcome) == [rb.OFFSETS] + [rb.APPLIED] * 3
    assert outcome.results[0].detail == "line offsets"


def test_patch_built_on_a_dropped_patch_follows_it(tmp_path, git_env):
    up = tmp_path / "up"
    up.mkdir()
    run_git(up, "init", "-q", "-b", "main")
    edit(up, "loader.py", None, "x = 1\n")
    edit(up, "other.py", None, "y = 1\n")
    pin = fake_pin("1.0", commit(up, "1.0"))
    patches, work = tmp_path / "patches", tmp_path / "src"
    apply_series(pin, tree=work, patch_dir=patches, src=up)
    edit(work, "loader.py", "x = 1\n", "x = 1\nimport helper\n")
    edit(work, "helper.py", None, "h = 1\n")
    commit(work, "loader uses helper")
    edit(work, "helper.py", "h = 1\n", "h = 2\n")
    commit(work, "tune helper")
    edit(work, "helper.py", "h = 2\n", "h = 3\n")
    edit(work, "other.py", "y = 1\n", "y = 2\n")
    commit(work, "tune helper and other")
    export_series(work, patches)
    edit(up, "loader.py", "x = 1\n", "x = 2\n")  # upstream edits the same line
    commit(up, "1.1")
    outcome = rb.rebase(target_at(up, "1.1"), pin, patches, tmp_path / "r", pin_file=tmp_path / "p")
    assert statuses(outcome) == [rb.CONFLICT, rb.CONFLICT, rb.CONFLICT]
    assert outcome.results[1].detail == (
        "builds on 0001-loader-uses-helper.patch, which did not carry over")
    assert outcome.results[2].detail == (
        "helper.py (from 0001-loader-uses-helper.patch, which did not carry over)")
    edit(up, "loader.py", "", None)  # upstream removed the loader
    commit(up, "2.0")
    outcome = rb.rebase(target_at(up, "2.0"), pin, patches, tmp_path / "r2",
                        pin_file=tmp_path / "p")
    assert statuses(outcome) == [rb.OBSOLETE, rb.OBSOLETE, rb.CONFLICT]
    assert "0001-loader-uses-helper.patch" in outcome.results[1].detail


def test_obsolete_if_header(project, tmp_path):
    up, pin, pin_file, patches = project
    p1, p2 = read_series(patches)[:2]
    p1.write_text(p1.read_text().replace(
        "Upstream-Status: Pending",
        "Upstream-Status: Pending\nObsolete-If: a.py matches ^line 10 fixed$", 1))
    p2.write_text(p2.read_text().replace(
        "Upstream-Status: Pending", "Upstream-Status: Pending\nObsolete-If: c.py is gone", 1))
    edit(up, "a.py", "line 10\n", "line 10 fixed\n")
    commit(up, "2.0")
    outcome = rb.rebase(target_at(up, "2.0"), pin, patches, tmp_path / "r", pin_file=pin_file)
    # Without the header 0001 would conflict; c.py is still there.
    assert statuses(outcome) == [rb.OBSOLETE, rb.APPLIED, rb.APPLIED, rb.APPLIED]
    assert "a.py matches" in outcome.results[0].detail
    edit(up, "c.py", "", None)
    commit(up, "2.1")
    outcome = rb.rebase(target_at(up, "2.1"), pin, patches, tmp_path / "r", pin_file=pin_file)
    assert statuses(outcome) == [rb.OBSOLETE, rb.OBSOLETE, rb.OBSOLETE, rb.APPLIED]
    assert outcome.results[1].detail == "Obsolete-If holds: c.py is gone"


def test_collides_if_header_reports_upstream_work_of_the_same_name(project, tmp_path):
    """`Collides-If:` is judged on the target release alone: the file the
    patch creates itself is no collision; upstream's own one is, reported
    beside the patch's status, in the table and in docs/compatibility.md."""
    up, pin, pin_file, patches = project
    p4 = read_series(patches)[3]  # "add d": creates d.py
    p4.write_text(p4.read_text().replace(
        "Upstream-Status: Pending",
        "Upstream-Status: Pending\nCollides-If: d.py exists\n"
        "Collides-If: b.py matches ^d_too = True$", 1))
    edit(up, "e.py", None, "e = 1\n")
    commit(up, "1.5")
    quiet = rb.rebase(target_at(up, "1.5"), pin, patches, tmp_path / "r1", pin_file=pin_file)
    assert statuses(quiet) == [rb.APPLIED] * 4 and not quiet.results[3].collisions
    edit(up, "d.py", None, "d = 'upstream'\n")
    edit(up, "b.py", "b = 1\n", "b = 1\nd_too = True\n")
    commit(up, "2.0")
    outcome = rb.rebase(target_at(up, "2.0"), pin, patches, tmp_path / "r2", pin_file=pin_file)
    assert outcome.results[3].collisions == ["upstream has d.py",
                                            "upstream's b.py matches `^d_too = True$`"]
    assert "COLLIDES: upstream has d.py" in rb.format_table(outcome.results)
    text = compat.compat_markdown(pin, read_series(patches), {"2.0": outcome.results})
    assert "## Where upstream has work of the same name" in text
    assert "  - 2.0: upstream has d.py" in text
    p4.write_text(p4.read_text().replace("Collides-If: d.py exists", "Collides-If: d.py", 1))
    with pytest.raises(SeriesError, match="neither `<path> matches <regex>` nor `<path> exists`"):
        rb.rebase(target_at(up, "2.0"), pin, patches, tmp_path / "r3", pin_file=pin_file)


def test_index_lookup_picks_sdist_and_newest_wheel(tmp_path):
    names = ["vllm-0.23.0.tar.gz", "vllm-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl",
             "vllm-0.23.0-2-cp38-abi3-manylinux_2_28_x86_64.whl",
             "vllm-0.23.0-2-cp38-abi3-manylinux_2_28_aarch64.whl",
             "vllm-0.24.0.tar.gz", "vllm-0.9.2.tar.gz", "vllm-0.30.0rc1.tar.gz"]
    page = tmp_path / "simple" / "vllm"
    page.mkdir(parents=True)
    links = "".join(f'<a href="../../f/{n}#sha256={hashlib.sha256(n.encode()).hexdigest()}">{n}</a>'
                    for n in names)
    links += '<a href="../../f/vllm-0.99.0.tar.gz#sha256=00" data-yanked="">yanked</a>'
    (page / "index.html").write_text(f"<html><body>{links}</body></html>")
    files = release.release_hashes([(tmp_path / "simple").as_uri()])
    assert files["vllm-0.24.0.tar.gz"] == hashlib.sha256(b"vllm-0.24.0.tar.gz").hexdigest()
    assert release.newest_release(files) == "0.24.0"  # not the rc, not the yanked one
    assert release.release_files("0.23.0", files) == (
        "vllm-0.23.0.tar.gz", "vllm-0.23.0-2-cp38-abi3-manylinux_2_28_x86_64.whl")
    with pytest.raises(SeriesError, match="no x86_64 manylinux wheel"):
        release.release_files("0.9.2", files)


def test_compat_markdown_has_a_row_per_patch_and_a_sentence_per_problem(tmp_path):
    pin = fake_pin("1.0", "a" * 40)
    patches = []
    for name in ("0001-loader.patch", "0002-kernel.patch"):
        patches.append(tmp_path / name)
        patches[-1].write_text(name)
    table = {
        "0.9": [rb.PatchResult("0001-loader.patch", rb.CONFLICT, "x.py (2 hunks)", ["x.py"]),
                rb.PatchResult("0002-kernel.patch", rb.APPLIED)],
        "1.1": [rb.PatchResult("0001-loader.patch", rb.OBSOLETE, "gone upstream: x.py", ["x.py"]),
                rb.PatchResult("0002-kernel.patch", rb.OFFSETS, "3-way merge")],
    }
    text = compat.compat_markdown(pin, patches, table, newest="1.1")
    assert "| patch | 0.9 | 1.1 (newest) |" in text
    assert "| `0001-loader.patch` | conflict | obsolete |" in text
    assert "| `0002-kernel.patch` | applied | applied with offsets/fuzz |" in text
    assert "Carries over without manual work to: 1.1." in text
    assert "0.9: conflict in `x.py` (2 hunks)" in text
    assert "1.1: obsolete, `x.py`, which it patches, is gone upstream" in text
    assert "0002-kernel.patch`\n" not in text  # no note for a patch that applies everywhere


def test_backport_is_obsolete_from_the_release_it_names(project, tmp_path):
    up, pin, pin_file, patches = project
    p2 = read_series(patches)[1]
    p2.write_text(p2.read_text().replace("Upstream-Status: Pending",
                                         "Upstream-Status: Backport [vLLM 2.0]", 1))
    edit(up, "e.py", None, "e = 1\n")
    commit(up, "next")
    older = rb.rebase(target_at(up, "1.5"), pin, patches, tmp_path / "r", pin_file=pin_file)
    newer = rb.rebase(target_at(up, "2.0.1"), pin, patches, tmp_path / "r", pin_file=pin_file)
    assert statuses(older) == [rb.APPLIED] * 4
    assert statuses(newer) == [rb.APPLIED, rb.OBSOLETE, rb.APPLIED, rb.APPLIED]
    assert newer.results[1].detail == "backport of vLLM 2.0, which upstream has"


def test_committed_pin_is_what_make_rebase_writes(repo):
    """pin_text is the one place the pin's text (comments too) is written."""
    pin_file = repo / "vllm-pin.txt"
    assert pin_file.read_text() == pin_text(load_pin(pin_file))


# The real series on vLLM 0.24.0, the release that deleted the GGUF loader.
# Every patch must be listed: a new patch makes this test fail until its
# expected fate is recorded here.
EXPECTED_ON_0_24 = {  # patch number: (status, text in the detail)
    # 0.24.0 deleted the GGUF loader that these two patch.
    "0001": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    "0002": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # Its header: obsolete once GGUF support (gguf_utils.py) is gone, as in 0.24.
    "0003": (rb.OBSOLETE, "vllm/transformers_utils/gguf_utils.py"),
    # The Triton sparse MLA backend: new files plus a registry entry.
    "0004": (rb.OFFSETS, ""),
    # 0.24.0 reworked SparseAttnIndexer.
    "0005": (rb.CONFLICT, "vllm/model_executor/layers/sparse_attn_indexer.py"),
    # The CUDA priority lists: its docs rows live in the last patch.
    "0006": (rb.OFFSETS, ""),
    # The SM90 Gluon fast path: a new file plus hunks in 0004's module.
    "0007": (rb.APPLIED, ""),
    # The GGUF loader fixes and checks go with the loader.
    "0008": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    "0009": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # GLM-5.2's indexer_types: its model hunk needs rework on the new
    # DeepSeek-V2 code, its loader half went with 0001.
    "0010": (rb.CONFLICT, "vllm/model_executor/models/deepseek_v2.py"),
    "0011": (rb.OBSOLETE, "vllm/transformers_utils/gguf_utils.py"),
    "0012": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    "0013": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # GLM-5's indexer RoPE default; the MTP draft's hf_config_path: 0.24
    # still has both bugs.
    "0014": (rb.OFFSETS, ""),
    "0015": (rb.OFFSETS, ""),
    # The GGUF loader's model_config for drafts goes with the loader.
    "0016": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # The fp16 indexer K-cache writer: 0.24 still calls the compiled op
    # (and its CUDA kernel still reads fp16 bits as integers).
    "0017": (rb.OFFSETS, ""),
    # File and config held to each other: goes with the GGUF loader.
    "0018": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # vllm serve's prompt checks: 0.24's input processor has the lines it edits.
    "0019": (rb.APPLIED, ""),
    # Gate and up experts of different GGUF types: goes with the loader.
    "0020": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # The quiet shutdown of the output handler: 0.24 has the same race.
    "0021": (rb.APPLIED, ""),
    # Prefill-size GGUF batches through the float kernels: goes with the loader.
    "0022": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # The fused GGUF MoE kernel behind 0022's switch: goes with the loader.
    "0023": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # The Triton dequantizer of 0022's float paths: goes with the loader.
    "0024": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # The imatrix types in 0024's dequantizer: goes with the loader.
    "0025": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # The generated backend table in the docs moved on.
    "0026": (rb.CONFLICT, "docs/design/attention_backends.md"),
    # IQ3_S loaded as Q6_K: goes with the loader.
    "0027": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # The Marlin repack of GGUF experts: goes with the loader.
    "0028": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # One GGUF reader a file within a load: goes with the loader.
    "0029": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # The progress bar of the GGUF load: goes with the loader.
    "0030": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # The faster GGUF header parse: goes with the loader.
    "0031": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # The small linears' float path from 8 tokens: goes with the loader.
    "0032": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # A TP rank's GGUF tensors read from the file's map: goes with the loader.
    "0033": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # Shared top-k layers without an indexer: builds on 0010's model hunk.
    "0034": (rb.CONFLICT, "vllm/model_executor/models/deepseek_v2.py"),
    # Fused GGUF linears of one type as one weight: goes with the loader.
    "0035": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # GGUF linears' dense Marlin copy at decode sizes: goes with the loader.
    "0036": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # The lm_head's float weight kept from load: goes with the loader.
    "0037": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # The GGUF engine config's refusals and defaults (offload, dtype,
    # tokenizer, a folder of files, expert parallelism): go with the loader.
    "0038": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    "0039": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    "0040": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    "0041": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    "0042": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    # The fp16 MTP block's residual: 0.24's deepseek_mtp.py has the same bug.
    "0043": (rb.OFFSETS, ""),
    # The Triton vector kernel for IQ experts' down projection: goes with the loader.
    "0044": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    "0045": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    "0046": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    "0047": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    "0048": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    "0049": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
    "0050": (rb.OBSOLETE, "vllm/model_executor/model_loader/gguf_loader.py"),
}


# vLLM 0.24.0's sdist as the package index lists it; pinned here so that
# re-runs need no network once fetch.py has cached it.
SDIST_0_24 = ("vllm-0.24.0.tar.gz",
              "0862453adc1f3339f1a0c9dca1179c34d6ed6e118f87b6e5bddd120af614ac66")


def test_real_series_on_vllm_0_24(repo, tmp_path, git_env):
    """Downloads the 0.24.0 sdist once (37 MB, cached by fetch.py)."""
    patches = read_series(repo / "patches")
    if not patches:
        pytest.skip("patches/series is empty")
    sdist = fetch_file("vllm", *SDIST_0_24)
    commit_id, torch = release.release_metadata(sdist)
    assert (commit_id, torch) == ("ee0da84ab", "2.11.0")
    target = release.Target(version="0.24.0", commit=commit_id, sdist=sdist)
    outcome = rb.rebase(target, load_pin(repo / "vllm-pin.txt"), repo / "patches",
                        tmp_path / "rebase", replay=False, pin_file=repo / "vllm-pin.txt")
    table = rb.format_table(outcome.results)
    got = {r.name[:4]: r for r in outcome.results}
    assert set(got) == set(EXPECTED_ON_0_24), table
    for number, (status, detail) in EXPECTED_ON_0_24.items():
        assert got[number].status == status, table
        assert detail in got[number].detail, table
    assert {rb.APPLIED, rb.OFFSETS} & {r.status for r in outcome.results}, table
    assert any(r.status == rb.OBSOLETE
               and "vllm/model_executor/model_loader/gguf_loader.py" in r.detail
               for r in outcome.results), table


def test_finish_refuses_to_drop_patches_that_git_am_left_out(project, tmp_path):
    """After a conflict the user follows git's hint and runs `git am --abort`:
    vllm-rebase/ then holds no patch, and --finish would write an empty series
    on the new pin. Refused, naming what is missing; a patch dropped on purpose
    (`git am --skip`) is written once its line is gone from patches/series."""
    up, pin, pin_file, patches = project
    edit(up, "a.py", "line 10\n", "line 10 (changed upstream)\n")
    commit(up, "release 2.0")
    before = snapshot(patches) | {"pin": pin_file.read_bytes()}
    work = tmp_path / "rebase"
    rb.rebase(target_at(up, "2.0"), pin, patches, work, pin_file=pin_file)
    run_git(work, "am", "--abort")
    with pytest.raises(SeriesError, match=r"rebase/ lacks 4 patches of the series: "
                                          r"0001-edit-a\.patch, 0002-edit-b\.patch, "
                                          r"0003-edit-c\.patch, 0004-add-d\.patch.*Nothing was "
                                          r"written"):
        rb.finish(work, patches, pin_file)
    assert snapshot(patches) | {"pin": pin_file.read_bytes()} == before

    work = tmp_path / "rebase-skip"
    rb.rebase(target_at(up, "2.0"), pin, patches, work, pin_file=pin_file)
    run_git(work, "am", "--skip")
    with pytest.raises(SeriesError, match=r"lacks 1 patch of the series: 0001-edit-a\.patch"):
        rb.finish(work, patches, pin_file)
    assert snapshot(patches) | {"pin": pin_file.read_bytes()} == before
    series = patches / "series"
    series.write_text(series.read_text().replace("0001-edit-a.patch\n", ""))
    written = rb.finish(work, patches, pin_file)
    assert [p.name for p in written] == ["0001-edit-b.patch", "0002-edit-c.patch",
                                         "0003-add-d.patch"]
    assert load_pin(pin_file).commit == target_at(up, "2.0").commit


def test_rerun_refuses_to_wipe_work_made_in_the_rebase_tree(project, tmp_path):
    """The series carried over; the user commits a fix in vllm-rebase/ and
    re-runs with WRITE=1, as the output suggests. The re-run would rebuild
    the tree from scratch: refused, naming the work, until --finish has
    written it (or the tree is gone)."""
    up, pin, pin_file, patches = project
    edit(up, "e.py", None, "e = 1\n")
    commit(up, "release 2.0")
    work = tmp_path / "rebase"
    outcome = rb.rebase(target_at(up, "2.0"), pin, patches, work, pin_file=pin_file)
    assert outcome.carried and not outcome.written
    edit(work, "b.py", "b = 2\n", "b = 3\n")
    fix = commit(work, "tune b")
    run_git(work, "branch", "idea", "HEAD~1")
    edit(work, "c.py", "c = 2\n", "c = 3\n")
    before = snapshot(patches) | {"pin": pin_file.read_bytes()}
    with pytest.raises(SeriesError, match=rf"rebase/ holds work that a new rebase would delete: "
                                          rf"commit {fix[:12]} tune b, branch `idea`, uncommitted "
                                          rf"changes.*rebase --finish"):
        rb.rebase(target_at(up, "2.0"), pin, patches, work, write=True, pin_file=pin_file)
    assert run_git(work, "rev-parse", "HEAD") == fix
    assert (work / "c.py").read_text() == "c = 3\n"
    assert snapshot(patches) | {"pin": pin_file.read_bytes()} == before
    # Written with --finish (the stray edit and branch dropped), a re-run starts afresh.
    run_git(work, "checkout", "-q", "c.py")
    run_git(work, "branch", "-D", "idea")
    assert [p.name for p in rb.finish(work, patches, pin_file)][-1] == "0005-tune-b.patch"
    outcome = rb.rebase(target_at(up, "2.0"), load_pin(pin_file), patches, work,
                        pin_file=pin_file)
    assert statuses(outcome) == [rb.APPLIED] * 5
