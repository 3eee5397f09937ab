"""The patched vLLM work tree: import upstream, apply patches/, export back.

The work tree (vllm-src/, ignored by our repo) is a git repository whose first
commit, tagged `upstream`, is the pristine release; each later commit is one
patch of the series. A new tree is always built beside the old one and only
swapped in when every patch applied, so a failure never destroys work.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from . import PATCH_DIR, WORK_TREE, SeriesError
from .fetch import fetch_file
from .pin import Pin

UPSTREAM_TAG = "upstream"
# The upstream commit is made with a fixed identity and date so that it is the
# same commit on every machine.
_BASE_ENV = {
    "GIT_AUTHOR_NAME": "vLLM release",
    "GIT_AUTHOR_EMAIL": "release@vllm.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "vLLM release",
    "GIT_COMMITTER_EMAIL": "release@vllm.invalid",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
# Identity for commits `git am` makes when the user has none configured.
_AM_IDENTITY = ["-c", "user.name=patch series", "-c", "user.email=series@localhost.invalid"]
_STAMP = "patchseries-applied"  # in .git: digest of the series last applied


def git(repo: Path, *args: str, env: dict[str, str] | None = None, check: bool = True,
        **kwargs) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "LC_ALL": "C", **(env or {})}
    result = subprocess.run(["git", "-C", str(repo), *args], env=full_env,
                            capture_output=True, text=True, **kwargs)
    if check and result.returncode:
        raise SeriesError(f"git {' '.join(args)} failed in {repo}:\n{result.stderr.strip()}")
    return result


def read_series(patch_dir: Path = PATCH_DIR) -> list[Path]:
    series = patch_dir / "series"
    if not series.exists():
        return []
    patches = []
    for lineno, raw in enumerate(series.read_text().splitlines(), 1):
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        path = patch_dir / name
        if not path.is_file():
            raise SeriesError(f"{series}:{lineno}: {name} does not exist")
        patches.append(path)
    return patches


def series_digest(patches: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in patches:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _quote(path: str) -> str:
    if not re.search(r'["\\\n]', path) and not path.startswith('"'):
        return path
    return '"' + path.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _import_tar(tree: Path, tar: tarfile.TarFile, strip_top: bool, message: str,
                parent: str | None) -> str:
    """Commit the files of a tar stream (an sdist, or `git archive`) with
    `git fast-import`, without unpacking them: the same tree `git add -A -f`
    of the unpacked files gives, in a fraction of the time. Returns the commit."""
    ref = "refs/patchseries/import"
    # Light compression: the objects are read once or twice, then thrown away.
    proc = subprocess.Popen(["git", "-C", str(tree), "-c", "pack.compression=1", "fast-import",
                             "--quiet", "--done"],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    out = proc.stdin
    entries: dict[str, tuple[str, int]] = {}
    try:
        for mark, member in enumerate(tar, 1):
            name = member.name.partition("/")[2] if strip_top else member.name
            if not name or member.isdir():
                continue
            if member.issym():
                data, mode = member.linkname.encode(), "120000"
            elif member.isreg():
                data = tar.extractfile(member).read()
                mode = "100755" if member.mode & 0o100 else "100644"
            elif member.islnk():
                target = member.linkname if not strip_top else member.linkname.partition("/")[2]
                if target in entries:
                    entries[name] = entries[target]
                continue
            else:
                continue
            out.write(b"blob\nmark :%d\ndata %d\n%s\n" % (mark, len(data), data))
            entries[name] = (mode, mark)
        who = f"{_BASE_ENV['GIT_AUTHOR_NAME']} <{_BASE_ENV['GIT_AUTHOR_EMAIL']}> 946684800 +0000"
        msg = message.encode()
        out.write(f"commit {ref}\nauthor {who}\ncommitter {who}\n".encode()
                  + b"data %d\n%s\n" % (len(msg), msg)
                  + (f"from {parent}\n".encode() if parent else b"")
                  + b"deleteall\n")
        for name, (mode, mark) in sorted(entries.items()):
            out.write(f"M {mode} :{mark} {_quote(name)}\n".encode())
        out.write(b"\ndone\n")
        out.close()
    except BrokenPipeError:
        pass
    if proc.wait():
        raise SeriesError(f"git fast-import failed in {tree}:\n{proc.stderr.read().decode()}")
    commit = git(tree, "rev-parse", ref).stdout.strip()
    git(tree, "update-ref", "-d", ref)
    return commit


def commit_release(tree: Path, message: str, parent: str | None, sdist: Path | None = None,
                   checkout: Path | None = None, ref: str | None = None) -> str:
    """Commit a release sdist, or a checkout's commit, into `tree`."""
    if sdist is not None:
        with tarfile.open(sdist) as tar:
            return _import_tar(tree, tar, True, message, parent)
    archive = subprocess.Popen(["git", "-C", str(checkout), "archive", "--format=tar", ref],
                               stdout=subprocess.PIPE)
    with tarfile.open(fileobj=archive.stdout, mode="r|") as tar:
        commit = _import_tar(tree, tar, False, message, parent)
    if archive.wait():
        raise SeriesError(f"git archive {ref} failed in {checkout}")
    return commit


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
        # --keep-non-patch: a "[Kernel] ..." subject keeps its tag on export.
        result = git(tree, *_AM_IDENTITY, "am", "--3way", "--keep-cr", "--keep-non-patch",
                     str(patch), check=False)
        if result.returncode:
            conflicts = git(tree, "diff", "--name-only", "--diff-filter=U").stdout.split()
            git(tree, "am", "--abort", check=False)
            if not conflicts:  # no 3-way merge possible: ask which hunks fail
                check = git(tree, "apply", "--check", str(patch), check=False).stderr
                conflicts = sorted(set(re.findall(r"^error: patch failed: (.+?):\d+$", check, re.M)
                                       + re.findall(r"^error: (.+?): does not exist", check, re.M)))
            detail = (f"conflicts in: {', '.join(conflicts)}" if conflicts
                      else result.stderr.strip() or result.stdout.strip())
            raise SeriesError(f"patch {patch.name} does not apply; {detail}")


def export_patches(tree: Path, out_dir: Path) -> list[Path]:
    """Write upstream..HEAD as patch files into the empty directory out_dir."""
    # Fixed abbreviation, zero From-hash and no version signature keep a
    # re-export of unchanged commits byte-identical.
    result = git(tree, "-c", "core.abbrev=12", "-c", "diff.noprefix=false",
                 "-c", "diff.mnemonicPrefix=false", "-c", "diff.algorithm=myers",
                 "format-patch", "--zero-commit", "--no-signature", "-N", "--no-renames",
                 "-o", str(out_dir), f"{UPSTREAM_TAG}..HEAD")
    return [Path(line) for line in result.stdout.split()]


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
