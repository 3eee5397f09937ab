"""The patched vLLM work tree: import upstream, apply patches/, export back.

The work tree (vllm-src/, ignored by our repo) is a git repository whose first
commit, tagged `upstream`, is the pristine release; each later commit is one
patch of the series. A new tree is always built beside the old one and only
swapped in when every patch applied, so a failure never destroys work; the
old tree's git-ignored files move into the new one.

The tree remembers (in .git/patchseries-applied) the digest of the series it
was last applied from or exported to. Export writes patches/ only when that
is still what patches/ holds, and only from a branch with no rebase, am,
merge or cherry-pick in progress. Apply and export hold vllm-src.lock.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from . import PATCH_DIR, WORK_TREE, SeriesError
from .fetch import fetch_file
from .gitrepo import (
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
from .patchfile import read_series, section_rule_violations, series_digest, write_patches
from .pin import Pin

__all__ = ["UPSTREAM_TAG", "apply_series", "export_series", "read_series", "series_digest"]

_STAMP = "patchseries-applied"  # in .git: digest of the series last applied or exported


def _check_checkout(src: Path, pin: Pin) -> None:
    if not (src / ".git").exists():
        raise SeriesError(f"VLLM_SRC={src} is not a git checkout")
    head = git(src, "rev-parse", "HEAD").stdout.strip()
    if not head.startswith(pin.commit):
        raise SeriesError(f"VLLM_SRC={src} is at {head}, the pin is vLLM {pin.version} "
                          f"at {pin.commit}")
    if git(src, "status", "--porcelain", "--untracked-files=no").stdout.strip():
        raise SeriesError(f"VLLM_SRC={src} has uncommitted changes; use a clean checkout")


def import_upstream(pin: Pin, dest: Path, src: Path | None = None) -> None:
    """Make `dest` a git repo whose one commit, tagged upstream, is the release."""
    dest.mkdir(parents=True)
    git(dest, "init", "-q", "-b", "main")
    message = _base_subject(pin)
    if src is None:
        sdist = fetch_file("vllm", pin.sdist, pin.sdist_sha256)
        print(f"importing {sdist.name}", flush=True)
        commit = commit_release(dest, message, None, sdist=sdist)
    else:
        _check_checkout(src, pin)
        print(f"importing {src} at {pin.commit}", flush=True)
        commit = commit_release(dest, message, None, checkout=src, ref="HEAD")
    git(dest, "reset", "-q", "--hard", commit)
    git(dest, "tag", UPSTREAM_TAG)


def apply_patches(tree: Path, patches: list[Path]) -> None:
    for i, patch in enumerate(patches, 1):
        print(f"[{i}/{len(patches)}] {patch.name}", flush=True)
        result = am(tree, [patch])
        if not result.ok:
            conflicts = result.unmerged or sorted(apply_failures(tree, patch))
            detail = (f"conflicts in: {', '.join(conflicts)}" if conflicts
                      else result.message)
            raise SeriesError(f"patch {patch.name} does not apply; {detail}")


def _check_clean(tree: Path) -> None:
    if op := operation_in_progress(tree):
        raise SeriesError(op)
    if git(tree, "status", "--porcelain").stdout.strip():
        raise SeriesError(f"{tree} has uncommitted changes; commit them (one commit per "
                          "patch) or discard them first")


def _tree_digest(tree: Path) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        return series_digest(export_patches(tree, Path(tmp)))


def _base_subject(pin: Pin) -> str:
    return f"vLLM {pin.version} (upstream {pin.commit})"


@contextmanager
def _locked(tree: Path) -> Iterator[None]:
    """Hold <tree>.lock while one `make apply` or `make patches` works on
    the tree and patches/; a second one waits for it."""
    path = tree.with_name(tree.name + ".lock")
    with open(path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            print(f"waiting for {holder}, which holds {path.name} (another `make apply` or "
                  f"`make patches` in this checkout) ...", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.seek(0)
        lock.truncate()
        lock.write(f"`{' '.join(os.path.basename(a) for a in sys.argv[:2])}` "
                   f"(pid {os.getpid()})\n")
        lock.flush()
        try:
            yield
        finally:
            lock.truncate(0)


def _ignored_files(tree: Path) -> list[str]:
    """git-ignored files and folders of the work tree (editor settings, logs)."""
    out = git(tree, "ls-files", "-z", "--others", "--ignored", "--exclude-standard",
              "--directory").stdout
    return [name.rstrip("/") for name in out.split("\0") if name]


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False
    where the system or file system cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(ctypes.get_errno(), f"cannot swap {a} and {b}", str(a))


def _swap_in(tmp: Path, tree: Path) -> None:
    """Put the finished tree `tmp` in the place of `tree` in one step and
    carry the old tree's git-ignored files over. The old tree is deleted
    only when everything in it that is not in the series has been moved;
    else it stays as <tree>.old with what is left."""
    if not tree.exists():
        os.rename(tmp, tree)
        return
    old = tree.with_name(tree.name + ".old")
    ignored = _ignored_files(tree)
    # Ctrl-C waits until the new tree is in place.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        if _exchange(tmp, tree):
            os.rename(tmp, old)
        else:  # two renames: for an instant there is no tree
            os.rename(tree, old)
            os.rename(tmp, tree)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    kept, left = [], []
    for name in ignored:
        dest = tree / name
        try:
            if os.path.lexists(dest):
                raise FileExistsError
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.rename(old / name, dest)
            kept.append(name)
        except OSError:
            left.append(name)
    if kept:
        shown = ", ".join(kept[:8]) + (f" and {len(kept) - 8} more" if len(kept) > 8 else "")
        print(f"kept {len(kept)} git-ignored file{'s' if len(kept) != 1 else ''} or "
              f"folder{'s' if len(kept) != 1 else ''} of the old {tree.name}/: {shown}")
    if left:
        print(f"could not move {len(left)} git-ignored files back into {tree.name}/ (the new "
              f"series has a file there): they are in {old.name}/: {', '.join(left)}",
              file=sys.stderr)
    elif old.exists():
        shutil.rmtree(old)


def apply_series(pin: Pin, tree: Path = WORK_TREE, patch_dir: Path = PATCH_DIR,
                 src: Path | None = None) -> Path:
    """Create (or refresh) the patched work tree. Returns its path."""
    with _locked(tree):
        return _apply_series(pin, tree, patch_dir, src)


def _apply_series(pin: Pin, tree: Path, patch_dir: Path, src: Path | None) -> Path:
    patches = read_series(patch_dir)
    wanted = series_digest(patches)
    old = tree.with_name(tree.name + ".old")
    if old.exists():
        raise SeriesError(
            f"{old.name}/ is left from an earlier `make apply`: "
            + (f"the files in it could not be moved into {tree.name}/; take what you need "
               f"from it, then remove it" if tree.exists() else
               f"it is the previous {tree.name}/ (that run was interrupted); rename it back "
               f"(mv {old.name} {tree.name}) and run again"))
    if tree.exists():
        if not (tree / ".git").exists() or git(tree, "rev-parse", "-q", "--verify",
                                                UPSTREAM_TAG, check=False).returncode:
            raise SeriesError(f"{tree} exists but was not made by this tool; move it away")
        _check_clean(tree)
        current = _tree_digest(tree)
        same_base = (git(tree, "log", "-1", "--format=%s", UPSTREAM_TAG).stdout.strip()
                     == _base_subject(pin))
        if current == wanted and same_base:
            print(f"{tree.name} already holds vLLM {pin.version} + {len(patches)} patches")
            return tree
        if _applied_from(tree) != current:
            raise SeriesError(
                f"{tree.name} has commits that are not in patches/; export them with "
                f"`make patches`, or remove {tree.name} to discard them")
        if lost := other_refs(tree, ("main",), (UPSTREAM_TAG,)):
            name = tree.name
            raise SeriesError(
                f"{name}/ must be rebuilt ({patch_dir.name}/ or the pin changed since it was "
                f"applied), which would lose {', '.join(lost)}. Nothing was changed. To keep "
                f"them, move the tree aside (`mv {name} {name}.keep`), run `make apply` again "
                f"and take them from {name}.keep/ (`git -C {name} fetch ../{name}.keep "
                f"<branch>:<branch>`); if you do not need them, delete them (`git -C {name} "
                f"branch -D`, `tag -d`, `stash drop`) and run again")
    tmp = tree.with_name(tree.name + ".new")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        import_upstream(pin, tmp, src)
        apply_patches(tmp, patches)
        (tmp / ".git" / _STAMP).write_text(wanted + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _swap_in(tmp, tree)  # the old tree holds no work: its commits equal the last applied series
    print(f"{tree.name}: vLLM {pin.version} + {len(patches)} patches applied")
    return tree


def _applied_from(tree: Path) -> str | None:
    """Digest of the series the tree was last applied from or exported to."""
    stamp = tree / ".git" / _STAMP
    return stamp.read_text().strip() if stamp.exists() else None


def series_files(diff_filter: str, pathspec: str, tree: Path = WORK_TREE) -> list[str]:
    """Paths, relative to the tree, that upstream..HEAD changes with git's
    --diff-filter (A added, M modified, ...) under pathspec; a renamed file
    counts as deleted and added."""
    if not (tree / ".git").exists():
        raise SeriesError(f"{tree.name}/ is missing; `make apply` (or make build-wheel) "
                          f"creates it")
    out = git(tree, "diff", "--no-renames", "--name-only", f"--diff-filter={diff_filter}",
              "-z", f"{UPSTREAM_TAG}..HEAD", "--", pathspec).stdout
    return sorted(p for p in out.split("\0") if p)


def _check_exportable(tree: Path, patch_dir: Path, pin: Pin | None) -> None:
    """Refuse to export a tree whose commits are not the series plus the
    user's edits: a rebase or similar stopped half-way, a detached HEAD, a
    tree applied from another series or release, conflict markers."""
    _check_clean(tree)
    if git(tree, "symbolic-ref", "-q", "HEAD", check=False).returncode:
        raise SeriesError(
            f"{tree.name}/ is on a detached HEAD; the export takes upstream..HEAD of a branch. "
            f"Go back to it (`git -C {tree.name} checkout main`) first")
    if _applied_from(tree) != series_digest(read_series(patch_dir)):
        raise SeriesError(
            f"{patch_dir.name}/ is not the series {tree.name}/ was applied from: it changed since "
            f"(a git pull, checkout or merge?), and exporting would undo that change. Nothing "
            f"was written. If {tree.name}/ holds no new work, run `make apply` to rebuild it "
            f"from {patch_dir.name}/. If it does, save that work first (`git -C {tree.name} "
            f"format-patch -o ../my-work <first-new-commit>^..HEAD`), remove {tree.name}/, run "
            f"`make apply` and replay it there (`git am -3 ../my-work/*.patch`)")
    if pin is not None:
        base = git(tree, "log", "-1", "--format=%s", UPSTREAM_TAG).stdout.strip()
        if base != _base_subject(pin):
            raise SeriesError(
                f"{tree.name}/ is built on {base}, but vllm-pin.txt names vLLM {pin.version} "
                f"(upstream {pin.commit}); exporting would write patches for the wrong release. "
                f"Run `make apply` to rebuild {tree.name}/ on the pinned release")
    if markers := conflict_markers(tree, UPSTREAM_TAG):
        raise SeriesError(
            f"{tree.name}/ has conflict markers in {', '.join(markers)}; resolve them, amend "
            "the commit they belong to, then export")


def export_series(tree: Path = WORK_TREE, patch_dir: Path = PATCH_DIR,
                  pin: Pin | None = None) -> bool:
    """Write the tree's commits to patch_dir. Returns whether anything changed.
    With `pin`, the tree must be built on that release."""
    if not (tree / ".git").exists():
        raise SeriesError(f"{tree} does not exist; run `make apply` first")
    with _locked(tree):
        _check_exportable(tree, patch_dir, pin)
        return _export_series(tree, patch_dir)


def _export_series(tree: Path, patch_dir: Path) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        new = export_patches(tree, Path(tmp))
        old = read_series(patch_dir)
        unchanged = ([p.name for p in old] == [p.name for p in new]
                     and all((patch_dir / p.name).read_bytes() == p.read_bytes() for p in new))
        if unchanged:
            print("patches/ is up to date")
            return False
        notes = write_patches(patch_dir, {p.name: p.read_bytes() for p in new}, old)
    (tree / ".git" / _STAMP).write_text(series_digest(read_series(patch_dir)) + "\n")
    print(f"exported {len(new)} patches to {patch_dir.name}/")
    for note in notes:
        print(note)
    # Said now, not only by the lint: a fix exported into the wrong patch is
    # cheaper to move before it is committed (docs/series.md).
    for problem in section_rule_violations(patch_dir):
        print(f"warning: {problem} (docs/series.md)", file=sys.stderr)
    return True
