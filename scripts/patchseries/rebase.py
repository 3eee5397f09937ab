"""Carry patches/series to another vLLM and say, patch by patch, what happened.

The rebase work tree (vllm-rebase/, ignored by our repo) is a git repository:

    old-upstream  the pinned release (vllm-pin.txt)
    old-series    old-upstream + patches/series (gives `git am --3way` the blobs
                  each patch was made against)
    upstream      the target release, committed on top of old-upstream
    probe         upstream + each patch tried on its own, to classify it
    main          upstream + the patches that still matter, replayed in one
                  `git am --3way` session; on a conflict it stops there so the
                  user can resolve it and `git am --continue`

Each patch is classified as

    applied                     applies as it is
    applied with offsets/fuzz   applies at shifted lines or needs the 3-way merge
    conflict                    upstream changed the lines it edits (files, hunks)
    obsolete                    its change is already upstream, the files it
                                edits are gone upstream, the target is at or
                                past the release its header names
                                (`Upstream-Status: Backport [vLLM X]`), or a
                                condition its header declares holds
                                (`Obsolete-If: <path> matches <regex>` or
                                `Obsolete-If: <path> is gone`)

patches/ and vllm-pin.txt are rewritten only when nothing conflicts and the
caller asks for it; obsolete patches are dropped from the series then.

The parts live beside this module: release.py (the target), patchfile.py
(what a patch's header says), gitrepo.py (git am, format-patch), compat.py
(docs/compatibility.md).
"""

from __future__ import annotations

import re
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import PATCH_DIR, PIN_FILE, REPO_ROOT, SeriesError
from .fetch import fetch_file
from .gitrepo import (
    RELEASE_ENV,
    UPSTREAM_TAG,
    am,
    apply_failures,
    commit_release,
    conflict_markers,
    export_patches,
    git,
    operation_in_progress,
    other_refs,
)
from .patchfile import PatchInfo, patch_slug, read_patch, read_series, write_patches
from .pin import Pin, load_pin, parse_pin, pin_text
from .release import Target, version_key

REBASE_TREE = REPO_ROOT / "vllm-rebase"

OLD_TAG = "old-upstream"
_TARGET_PIN = "patchseries-target-pin"  # in .git: vllm-pin.txt for the target
_HAND_WORK = "patchseries-needs-finish"  # in .git: conflicts were left to the user
_CARRIED = "patchseries-carried"  # in .git: the patches branch main was given, one a line
_MAIN = "patchseries-main"  # in .git: the commit the tools last left branch main at

APPLIED = "applied"
OFFSETS = "applied with offsets/fuzz"
CONFLICT = "conflict"
OBSOLETE = "obsolete"


# --------------------------------------------------------------------------
# The work tree
# --------------------------------------------------------------------------

@dataclass
class PatchResult:
    name: str
    status: str
    detail: str = ""
    files: list[str] = field(default_factory=list)
    # what its `Collides-If:` found in the target release
    collisions: list[str] = field(default_factory=list)

    @property
    def carried(self) -> bool:
        return self.status != CONFLICT


def _has(tree: Path, rev: str, path: str) -> bool:
    return not git(tree, "cat-file", "-e", f"{rev}:{path}", check=False).returncode


def _conflict_detail(tree: Path, patch: Path, unmerged: list[str], gone: list[str],
                     dropped: dict[str, tuple[str, str]]) -> tuple[str, list[str]]:
    """Files and hunks of a failed `git am --3way` (still in progress) that
    left `unmerged` files."""
    parts, files = [], []
    for f in unmerged:
        files.append(f)
        path = tree / f
        if f in dropped:
            parts.append(f"{f} (from {dropped[f][0]}, which did not carry over)")
            continue
        if f in gone or not path.exists():
            parts.append(f"{f} (removed upstream)")
            continue
        hunks = len(re.findall(r"^<{7}( |$)", path.read_text(errors="replace"), re.M))
        parts.append(f"{f} ({hunks} hunk{'s' if hunks != 1 else ''})" if hunks else f)
    if not unmerged:  # no 3-way merge was possible: ask which hunks fail
        for f, n in apply_failures(tree, patch).items():
            files.append(f)
            if f in dropped:
                note = f"from {dropped[f][0]}, which did not carry over"
            elif f in gone:
                note = "removed upstream"
            else:
                note = f"{n} hunk{'s' if n != 1 else ''}" if n else "already exists upstream"
            parts.append(f"{f} ({note})")
    return ", ".join(parts) or "git am failed", files


def _offsets(tree: Path, patch: Path) -> tuple[bool, bool]:
    """(applies without 3-way, needs offsets) for `git apply` on HEAD."""
    result = git(tree, "apply", "--check", "-v", str(patch), check=False)
    shifted = re.search(r"^Hunk #\d+ succeeded at \d+ \(offset", result.stderr, re.M)
    return result.returncode == 0, bool(shifted)


def _release_of(version: str) -> tuple[int, ...] | None:
    """(0, 33, 0) for "0.33.0" or a later commit "0.33.0-12-gabc"; None for a bare hash."""
    m = re.match(r"(\d+(?:\.\d+)+)(?![\w.])", version)
    return version_key(m.group(1)) if m else None


def _classify(tree: Path, info: PatchInfo, dropped: dict[str, tuple[str, str]],
              version: str = "") -> PatchResult:
    """Try one patch on the clean HEAD of `tree` (vLLM `version`); commit it
    when it applies. `dropped` maps each file created by an earlier patch that
    was not carried to (that patch's name, its status)."""
    release = _release_of(version)
    if info.backport_of and release and release >= version_key(info.backport_of):
        return PatchResult(info.name, OBSOLETE,
                           f"backport of vLLM {info.backport_of}, which upstream has", [])
    for path, regex in info.obsolete_if:
        target = tree / path
        if regex is None and not target.exists():
            return PatchResult(info.name, OBSOLETE,
                               f"Obsolete-If holds: {path} is gone", [path])
        if regex and target.is_file() and re.search(regex, target.read_text(errors="replace"),
                                                    re.M):
            return PatchResult(info.name, OBSOLETE,
                               f"Obsolete-If holds: {path} matches `{regex}`", [path])
    gone = [f for f in info.modified + info.deleted if not _has(tree, "HEAD", f)]
    # Earlier patches that were not carried and would have created files this
    # one edits: its fate follows theirs.
    needs = {dropped[f] for f in gone if f in dropped}
    needs_names = ", ".join(sorted(n for n, _ in needs))
    if gone and len(gone) == len(info.modified + info.deleted):
        if any(s != OBSOLETE for _, s in needs):
            return PatchResult(info.name, CONFLICT,
                               f"builds on {needs_names}, which did not carry over", gone)
        upstream_gone = [f for f in gone if f not in dropped]
        detail = "; ".join(([f"gone upstream: {', '.join(upstream_gone)}"] if upstream_gone else [])
                           + ([f"builds on {needs_names} (obsolete)"] if needs else []))
        return PatchResult(info.name, OBSOLETE, detail, upstream_gone or gone)
    if git(tree, "apply", "--check", "-R", str(info.path), check=False).returncode == 0:
        return PatchResult(info.name, OBSOLETE, "its change is already upstream", info.files)
    clean, shifted = _offsets(tree, info.path)
    before = git(tree, "rev-parse", "HEAD").stdout.strip()
    result = am(tree, [info.path], abort=False)
    if not result.ok:
        detail, files = _conflict_detail(tree, info.path, result.unmerged, gone, dropped)
        git(tree, "am", "--abort", check=False)
        git(tree, "reset", "-q", "--hard", before)
        if needs and "did not carry over" not in detail:
            detail += f"; builds on {needs_names}, which did not carry over"
        return PatchResult(info.name, CONFLICT, detail, files)
    if git(tree, "rev-parse", "HEAD").stdout.strip() == before or not git(
            tree, "diff", "--name-only", "HEAD~1", "HEAD").stdout.strip():
        if git(tree, "rev-parse", "HEAD").stdout.strip() != before:
            git(tree, "reset", "-q", "--hard", before)
        return PatchResult(info.name, OBSOLETE, "its change is already upstream (3-way merge)",
                           info.files)
    if clean and not shifted:
        return PatchResult(info.name, APPLIED, "", info.files)
    return PatchResult(info.name, OFFSETS, "line offsets" if clean else "3-way merge", info.files)


def _collisions(work: Path, info: PatchInfo) -> list[str]:
    """What a patch's `Collides-If:` finds in the target release itself
    (not in the series applied on it, which may create the same file)."""
    found = []
    for path, regex in info.collides_if:
        if not _has(work, UPSTREAM_TAG, path):
            continue
        if regex is None:
            found.append(f"upstream has {path}")
        elif re.search(regex, git(work, "show", f"{UPSTREAM_TAG}:{path}").stdout, re.M):
            found.append(f"upstream's {path} matches `{regex}`")
    return found


def _user_work(work: Path) -> list[str]:
    """What the user made in `work` since the tools last left it: commits on
    main, other branches, tags and stash entries, uncommitted changes."""
    lost = []
    if not git(work, "rev-parse", "-q", "--verify", "refs/heads/main", check=False).returncode:
        stamp = work / ".git" / _MAIN
        # No stamp: a tree from before the tools kept one; every patch counts.
        base = stamp.read_text().strip() if stamp.exists() else UPSTREAM_TAG
        log = git(work, "log", "--reverse", "--format=commit %h %s", "--abbrev=12",
                  f"{base}..main", check=False).stdout
        lost += log.splitlines()
    lost += other_refs(work, ("main", "old-series", "probe"), (OLD_TAG, UPSTREAM_TAG))
    if git(work, "status", "--porcelain", check=False).stdout.strip():
        lost.append("uncommitted changes")
    return lost


def _stamp_main(work: Path) -> None:
    (work / ".git" / _MAIN).write_text(git(work, "rev-parse", "main").stdout)


def prepare_tree(work: Path, pin: Pin, target: Target, patches: list[Path]) -> None:
    """Build `work` up to the `upstream` commit (the target) on branch probe."""
    if work.exists():
        if (work / ".git" / "rebase-apply").exists():
            raise SeriesError(f"{work.name}/ holds an unfinished `git am`; finish it "
                              f"(`git am --continue`, then `series.py rebase --finish`) or "
                              f"remove {work.name}/ first")
        if (work / ".git" / _HAND_WORK).exists():
            raise SeriesError(f"{work.name}/ holds conflicts resolved by hand that are not "
                              "written yet: run `series.py rebase --finish`, or remove "
                              f"{work.name}/ first")
        if (work / ".git").is_dir() and (lost := _user_work(work)):
            raise SeriesError(
                f"{work.name}/ holds work that a new rebase would delete: {', '.join(lost)}. "
                f"Nothing was changed. Commit it on main and write it to patches/ with "
                f"`python3 scripts/series.py rebase --finish`, or move the tree aside (`mv "
                f"{work.name} {work.name}.keep`), or remove {work.name}/ to discard it")
        shutil.rmtree(work)
    work.mkdir(parents=True)
    git(work, "init", "-q", "-b", "main")
    # The old base: the pinned commit from the same checkout when it has it
    # (offline, and the diff to the target is upstream's own), else the sdist.
    old_message = f"vLLM {pin.version} (upstream {pin.commit})"
    if target.checkout is not None and not git(target.checkout, "rev-parse", "-q", "--verify",
                                                f"{pin.commit}^{{commit}}", check=False).returncode:
        print(f"importing {target.checkout} at {pin.commit} (pinned vLLM {pin.version})",
              flush=True)
        old = commit_release(work, old_message, None, checkout=target.checkout, ref=pin.commit)
    else:
        sdist = fetch_file("vllm", pin.sdist, pin.sdist_sha256)
        print(f"importing {sdist.name} (pinned)", flush=True)
        old = commit_release(work, old_message, None, sdist=sdist)
    git(work, "tag", OLD_TAG, old)
    # The series on the old base, applied to an index only: it puts the blobs
    # every patch was made against into the repository for `git am --3way`.
    index = work / ".git" / "patchseries-old-index"
    env = {"GIT_INDEX_FILE": str(index)}
    git(work, "read-tree", old, env=env)
    for patch in patches:
        if git(work, "apply", "--cached", str(patch), env=env, check=False).returncode:
            raise SeriesError(f"{patch.name} does not apply to the pinned vLLM {pin.version}; "
                              "run `make apply` and fix the series first")
    tree_id = git(work, "write-tree", env=env).stdout.strip()
    index.unlink()
    old_series = git(work, "commit-tree", tree_id, "-p", old, "-m",
                     f"patches/series on vLLM {pin.version}", env=RELEASE_ENV).stdout.strip()
    git(work, "branch", "old-series", old_series)
    print(f"importing {target.sdist.name if target.sdist else target.ref} (target)", flush=True)
    new = commit_release(work, target.describe(), old, sdist=target.sdist, checkout=target.checkout,
                  ref=target.ref)
    git(work, "tag", UPSTREAM_TAG, new)
    git(work, "checkout", "-q", "-f", "-B", "probe", new)


def classify_series(work: Path, patches: list[Path], version: str = "") -> list[PatchResult]:
    """Try each patch on branch probe in order; conflicting and obsolete ones
    are left out so that later patches are judged on their own."""
    results = []
    dropped: dict[str, tuple[str, str]] = {}
    for i, patch in enumerate(patches, 1):
        info = read_patch(patch)
        r = _classify(work, info, dropped, version)
        r.collisions = _collisions(work, info)
        collides = (f"; COLLIDES: {'; '.join(r.collisions)} (its header says what to do)"
                    if r.collisions else "")
        print(f"[{i}/{len(patches)}] {patch.name}: {r.status}{collides}", flush=True)
        if r.status in (CONFLICT, OBSOLETE):
            for f in info.created:
                dropped[f] = (patch.name, r.status)
        results.append(r)
    return results


def format_table(results: list[PatchResult]) -> str:
    width = max([len("patch")] + [len(r.name) for r in results])
    lines = [f"{'patch':<{width}}  {'status':<25}  detail", f"{'-' * width}  {'-' * 25}  ------"]
    for r in results:
        detail = "; ".join(x for x in [r.detail, *(f"COLLIDES: {c}" for c in r.collisions)]
                           if x)
        lines.append(f"{r.name:<{width}}  {r.status:<25}  {detail}".rstrip())
    return "\n".join(lines)




# --------------------------------------------------------------------------
# vllm-pin.txt and patches/
# --------------------------------------------------------------------------

def write_series(work: Path, pin: Pin, patch_dir: Path = PATCH_DIR,
                 pin_file: Path = PIN_FILE, carried: list[str] | None = None) -> list[Path]:
    """Export upstream..HEAD of `work` into patch_dir and write pin_file.
    Everything is prepared first; the repository files change at the end.
    `carried`: the patches the rebase gave branch main; each one still in
    patches/series must be in the export (a `git am --abort` drops them all)."""
    text = pin_text(pin)
    if op := operation_in_progress(work):
        raise SeriesError(op)
    if git(work, "status", "--porcelain", "--untracked-files=no").stdout.strip():
        raise SeriesError(f"{work.name}/ has uncommitted changes; commit them first")
    if markers := conflict_markers(work, UPSTREAM_TAG):
        raise SeriesError(
            f"{work.name}/ has conflict markers in {', '.join(markers)}: resolve them and "
            "amend the commit they are in (`git commit --fixup`, `git rebase -i --autosquash "
            f"{UPSTREAM_TAG}`); patches/ and vllm-pin.txt are unchanged")
    with tempfile.TemporaryDirectory() as tmp:
        new = export_patches(work, Path(tmp))
        contents = {p.name: p.read_bytes() for p in new}
    old = read_series(patch_dir)
    listed, exported = {p.name for p in old}, {patch_slug(n) for n in contents}
    if missing := [n for n in carried or [] if n in listed and patch_slug(n) not in exported]:
        many = len(missing) > 1
        them = "them" if many else "it"
        raise SeriesError(
            f"{work.name}/ lacks {len(missing)} patch{'es' if many else ''} of the series: "
            f"{', '.join(missing)} (a `git am --abort` or `git am --skip` left {them} out); "
            f"writing it would delete {them} from {patch_dir.name}/. Nothing was written. To "
            f"carry {them}, remove {work.name}/, run `make rebase` again and resolve the "
            f"conflicts there (`git am --continue`); to drop a patch on purpose, delete it "
            f"from {patch_dir.name}/ and {patch_dir.name}/series first")
    try:
        unchanged = pin_file.read_text() == text
    except (OSError, UnicodeDecodeError):
        unchanged = False
    # Ctrl-C waits until patches/ and the pin are consistent.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        notes = write_patches(patch_dir, contents, old)
        if not unchanged:
            tmp_pin = pin_file.with_name(pin_file.name + ".new")
            tmp_pin.write_text(text)
            tmp_pin.replace(pin_file)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    for note in notes:
        print(note)
    return [patch_dir / n for n in contents]


# --------------------------------------------------------------------------
# The whole rebase
# --------------------------------------------------------------------------

@dataclass
class RebaseOutcome:
    results: list[PatchResult]
    carried: bool    # every patch applied or is obsolete
    written: bool    # patches/ and vllm-pin.txt were rewritten


def rebase(target: Target, pin: Pin | None = None, patch_dir: Path = PATCH_DIR,
           work: Path = REBASE_TREE, write: bool = False, pin_file: Path = PIN_FILE,
           replay: bool = True) -> RebaseOutcome:
    """Rebase the series in patch_dir from `pin` onto `target` in `work`.

    With replay, branch main of `work` gets the carried patches in one
    `git am --3way` session (left stopped at the first conflict). With write,
    and only when nothing conflicts, patch_dir and pin_file are rewritten.
    """
    pin = pin or load_pin(pin_file)
    if write and target.pin is None:
        raise SeriesError(
            f"{target.describe()} is not a vLLM release on the package index, so "
            "vllm-pin.txt cannot name its sdist and wheel; rebase onto a release tag "
            "(VLLM_REF=v<version>) or VLLM_VERSION to write the series")
    patches = read_series(patch_dir.resolve())  # git runs elsewhere: absolute paths
    print(f"rebasing {len(patches)} patches from vLLM {pin.version} onto "
          f"{target.describe()} in {work.name}/", flush=True)
    prepare_tree(work, pin, target, patches)
    if target.pin is not None:
        (work / ".git" / _TARGET_PIN).write_text(pin_text(target.pin))
    results = classify_series(work, patches, target.version)
    carried = all(r.carried for r in results)
    outcome = RebaseOutcome(results, carried, False)
    if not replay:
        return outcome
    keep = [p for p, r in zip(patches, results) if r.status != OBSOLETE]
    (work / ".git" / _CARRIED).write_text("".join(f"{p.name}\n" for p in keep))
    if carried:
        # The probe branch already holds exactly the carried patches.
        git(work, "checkout", "-q", "-B", "main", "probe")
    else:
        git(work, "checkout", "-q", "-f", "-B", "main", UPSTREAM_TAG)
        (work / ".git" / _HAND_WORK).write_text("")
        if keep:
            am(work, keep, abort=False)
    git(work, "branch", "-q", "-D", "probe")
    _stamp_main(work)
    if carried and write:
        write_series(work, target.pin, patch_dir, pin_file)
        outcome.written = True
    return outcome


def finish(work: Path = REBASE_TREE, patch_dir: Path = PATCH_DIR,
           pin_file: Path = PIN_FILE) -> list[Path]:
    """After resolving conflicts by hand in `work`: write its series and pin."""
    stored = work / ".git" / _TARGET_PIN
    if not stored.exists():
        raise SeriesError(f"{work.name}/ holds no rebase onto a release; run `make rebase` first")
    pin = parse_pin(stored.read_text(), stored.name)
    if git(work, "symbolic-ref", "-q", "--short", "HEAD", check=False).stdout.strip() != "main":
        raise SeriesError(f"{work.name}/ is not on branch main")
    carried = work / ".git" / _CARRIED
    written = write_series(work, pin, patch_dir, pin_file,
                           carried.read_text().split() if carried.exists() else None)
    (work / ".git" / _HAND_WORK).unlink(missing_ok=True)
    _stamp_main(work)  # written: a new rebase may start afresh
    return written


def instructions(work: Path, outcome: RebaseOutcome) -> str:
    rel = work.name
    conflicts = [r.name for r in outcome.results if r.status == CONFLICT]
    return f"""
The series does not carry over: {', '.join(conflicts)} conflict{'s' if len(conflicts) == 1 else ''}.
patches/ and vllm-pin.txt are unchanged. {rel}/ is stopped in `git am` at the
first conflicting patch, with the merge conflicts in its files:

    cd {rel}
    git status                      # the conflicting files
    # edit them, then
    git add <files> && git am --continue      # or: git am --skip to drop the patch
    cd .. && python3 scripts/series.py rebase --finish   # write patches/ and vllm-pin.txt
"""

