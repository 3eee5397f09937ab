"""The patched vLLM work tree: import upstream, apply patches/, export back.

The work tree (vllm-src/, ignored by our repo) is a git repository whose first
commit, tagged `upstream`, is the pristine release; each later commit is one
patch of the series. A new tree is always built beside the old one and only
swapped in when every patch applied, so a failure never destroys work.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from . import PATCH_DIR, WORK_TREE, SeriesError
from .fetch import fetch_file
from .gitrepo import UPSTREAM_TAG, am, apply_failures, commit_release, export_patches, git
from .patchfile import read_series, series_digest
from .pin import Pin

__all__ = ["UPSTREAM_TAG", "apply_series", "export_series", "read_series", "series_digest"]

_STAMP = "patchseries-applied"  # in .git: digest of the series last applied


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
    message = f"vLLM {pin.version} (upstream {pin.commit})"
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
    if (tree / ".git" / "rebase-apply").exists():
        raise SeriesError(f"{tree}: a `git am` is in progress; finish or abort it first")
    if git(tree, "status", "--porcelain").stdout.strip():
        raise SeriesError(f"{tree} has uncommitted changes; commit them (one commit per "
                          "patch) or discard them first")


def _tree_digest(tree: Path) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        return series_digest(export_patches(tree, Path(tmp)))


def apply_series(pin: Pin, tree: Path = WORK_TREE, patch_dir: Path = PATCH_DIR,
                 src: Path | None = None) -> Path:
    """Create (or refresh) the patched work tree. Returns its path."""
    patches = read_series(patch_dir)
    wanted = series_digest(patches)
    base_subject = f"vLLM {pin.version} (upstream {pin.commit})"
    if tree.exists():
        if not (tree / ".git").exists() or git(tree, "rev-parse", "-q", "--verify",
                                                UPSTREAM_TAG, check=False).returncode:
            raise SeriesError(f"{tree} exists but was not made by this tool; move it away")
        _check_clean(tree)
        current = _tree_digest(tree)
        same_base = git(tree, "log", "-1", "--format=%s", UPSTREAM_TAG).stdout.strip() == base_subject
        if current == wanted and same_base:
            print(f"{tree.name} already holds vLLM {pin.version} + {len(patches)} patches")
            return tree
        stamp = tree / ".git" / _STAMP
        if not stamp.exists() or stamp.read_text().strip() != current:
            raise SeriesError(
                f"{tree.name} has commits that are not in patches/; export them with "
                f"`make patches`, or remove {tree.name} to discard them")
    tmp = tree.with_name(tree.name + ".new")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        import_upstream(pin, tmp, src)
        apply_patches(tmp, patches)
        (tmp / ".git" / _STAMP).write_text(wanted + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if tree.exists():
        shutil.rmtree(tree)  # holds no work: its commits equal the last applied series
    tmp.rename(tree)
    print(f"{tree.name}: vLLM {pin.version} + {len(patches)} patches applied")
    return tree


def export_series(tree: Path = WORK_TREE, patch_dir: Path = PATCH_DIR) -> bool:
    """Write the tree's commits to patch_dir. Returns whether anything changed."""
    if not (tree / ".git").exists():
        raise SeriesError(f"{tree} does not exist; run `make apply` first")
    _check_clean(tree)
    with tempfile.TemporaryDirectory() as tmp:
        new = export_patches(tree, Path(tmp))
        series = "".join(f"{p.name}\n" for p in new)
        old = read_series(patch_dir)
        unchanged = ([p.name for p in old] == [p.name for p in new]
                     and all((patch_dir / p.name).read_bytes() == p.read_bytes() for p in new))
        if unchanged:
            print("patches/ is up to date")
            return False
        patch_dir.mkdir(exist_ok=True)
        for p in old:
            p.unlink()
        for p in new:
            shutil.copyfile(p, patch_dir / p.name)
        (patch_dir / "series").write_text(series)
    (tree / ".git" / _STAMP).write_text(series_digest(read_series(patch_dir)) + "\n")
    print(f"exported {len(new)} patches to {patch_dir.name}/")
    return True
