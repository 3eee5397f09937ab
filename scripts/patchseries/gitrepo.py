"""The git operations the series tools share: run git, commit a release,
replay patch files with `git am`, export commits as patch files, and tell
whether a repository is safe to read the series from.

Used by tree.py (vllm-src/) and rebase.py (vllm-rebase/) alike.
"""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from . import SeriesError

UPSTREAM_TAG = "upstream"
# A release commit is made with a fixed identity and date so that it is the
# same commit on every machine.
RELEASE_ENV = {
    "GIT_AUTHOR_NAME": "vLLM release",
    "GIT_AUTHOR_EMAIL": "release@vllm.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "vLLM release",
    "GIT_COMMITTER_EMAIL": "release@vllm.invalid",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
# Identity for commits `git am` makes when the user has none configured.
_AM_IDENTITY = ("-c", "user.name=patch series", "-c", "user.email=series@localhost.invalid")
# --keep-non-patch: a subject like "[Kernel] ..." keeps its tag (plain `git am`
# strips every leading [...], which renames the patch on export).
_AM = (*_AM_IDENTITY, "am", "--3way", "--keep-cr", "--keep-non-patch")


def git(repo: Path, *args: str, env: dict[str, str] | None = None, check: bool = True,
        **kwargs) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "LC_ALL": "C", **(env or {})}
    result = subprocess.run(["git", "-C", str(repo), *args], env=full_env,
                            capture_output=True, text=True, **kwargs)
    if check and result.returncode:
        raise SeriesError(f"git {' '.join(args)} failed in {repo}:\n{result.stderr.strip()}")
    return result


# --------------------------------------------------------------------------
# Importing a release
# --------------------------------------------------------------------------

def _quote(path: str) -> str:
    if not re.search(r'["\\\n]', path) and not path.startswith('"'):
        return path
    return '"' + path.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _import_tar(repo: Path, tar: tarfile.TarFile, strip_top: bool, message: str,
                parent: str | None) -> str:
    """Commit the files of a tar stream (an sdist, or `git archive`) with
    `git fast-import`, without unpacking them: the same tree `git add -A -f`
    of the unpacked files gives, in a fraction of the time. Returns the commit."""
    ref = "refs/patchseries/import"
    # Light compression: the objects are read once or twice, then thrown away.
    proc = subprocess.Popen(["git", "-C", str(repo), "-c", "pack.compression=1", "fast-import",
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
        who = (f"{RELEASE_ENV['GIT_AUTHOR_NAME']} <{RELEASE_ENV['GIT_AUTHOR_EMAIL']}> "
               "946684800 +0000")
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
        raise SeriesError(f"git fast-import failed in {repo}:\n{proc.stderr.read().decode()}")
    commit = git(repo, "rev-parse", ref).stdout.strip()
    git(repo, "update-ref", "-d", ref)
    return commit


def commit_release(repo: Path, message: str, parent: str | None, sdist: Path | None = None,
                   checkout: Path | None = None, ref: str | None = None) -> str:
    """Commit a release sdist, or a checkout's commit, into `repo`."""
    if sdist is not None:
        with tarfile.open(sdist) as tar:
            return _import_tar(repo, tar, True, message, parent)
    archive = subprocess.Popen(["git", "-C", str(checkout), "archive", "--format=tar", ref],
                               stdout=subprocess.PIPE)
    with tarfile.open(fileobj=archive.stdout, mode="r|") as tar:
        commit = _import_tar(repo, tar, False, message, parent)
    if archive.wait():
        raise SeriesError(f"git archive {ref} failed in {checkout}")
    return commit


# --------------------------------------------------------------------------
# Patch files in and out
# --------------------------------------------------------------------------

@dataclass
class AmResult:
    ok: bool
    unmerged: list[str] = field(default_factory=list)  # files the 3-way merge left conflicted
    message: str = ""                                   # git's output when it failed


def am(repo: Path, patches: list[Path], abort: bool = True) -> AmResult:
    """Replay patch files on HEAD of `repo` with `git am --3way`, one commit
    each. On failure the session is aborted (HEAD as before), or with
    abort=False left stopped at the failing patch for the user to resolve."""
    result = git(repo, *_AM, *map(str, patches), check=False)
    if not result.returncode:
        return AmResult(True)
    unmerged = git(repo, "diff", "--name-only", "--diff-filter=U").stdout.split()
    if abort:
        git(repo, "am", "--abort", check=False)
    return AmResult(False, unmerged, result.stderr.strip() or result.stdout.strip())


def apply_failures(repo: Path, patch: Path) -> dict[str, int]:
    """Where `git apply` fails with `patch` on the work tree of `repo`: for
    each file, the number of hunks that fail (0: the file is missing, or
    already exists for a patch that creates it). For patches that `git am
    --3way` could not even merge."""
    check = git(repo, "apply", "--check", str(patch), check=False).stderr
    failed: dict[str, int] = {}
    for m in re.finditer(r"^error: patch failed: (.+?):\d+$", check, re.M):
        failed[m.group(1)] = failed.get(m.group(1), 0) + 1
    for m in re.finditer(r"^error: (.+?): (does not exist|already exists)", check, re.M):
        failed.setdefault(m.group(1), 0)
    return failed


def export_patches(repo: Path, out_dir: Path) -> list[Path]:
    """Write upstream..HEAD as patch files into the empty directory out_dir."""
    # Fixed abbreviation, zero From-hash and no version signature keep a
    # re-export of unchanged commits byte-identical.
    result = git(repo, "-c", "core.abbrev=12", "-c", "diff.noprefix=false",
                 "-c", "diff.mnemonicPrefix=false", "-c", "diff.algorithm=myers",
                 "format-patch", "--zero-commit", "--no-signature", "-N", "--no-renames",
                 "-o", str(out_dir), f"{UPSTREAM_TAG}..HEAD")
    return [Path(line) for line in result.stdout.split()]


# --------------------------------------------------------------------------
# Is the repository in a state the series can be read from?
# --------------------------------------------------------------------------

# (file in the git directory, what is in progress, the git command that ends it)
_OPERATIONS = (
    ("rebase-merge", "a `git rebase`", "rebase"),
    ("rebase-apply/applying", "a `git am`", "am"),
    ("rebase-apply", "a `git rebase`", "rebase"),
    ("MERGE_HEAD", "a `git merge`", "merge"),
    ("CHERRY_PICK_HEAD", "a `git cherry-pick`", "cherry-pick"),
    ("REVERT_HEAD", "a `git revert`", "revert"),
    ("sequencer", "a `git cherry-pick` or `git revert` of several commits", "cherry-pick"),
    ("BISECT_LOG", "a `git bisect`", "bisect"),
)


def operation_in_progress(repo: Path) -> str | None:
    """A sentence naming the rebase/am/merge/cherry-pick/revert/bisect that
    is stopped in `repo` and how to end it; None when there is none."""
    git_dir = Path(git(repo, "rev-parse", "--absolute-git-dir").stdout.strip())
    for name, what, command in _OPERATIONS:
        if (git_dir / name).exists():
            end = ("`git bisect reset`" if command == "bisect" else
                   f"`git {command} --continue` or `git {command} --abort`")
            return f"{what} is in progress in {repo.name}/; finish it ({end}) first"
    return None


def other_refs(repo: Path, branches: tuple[str, ...], tags: tuple[str, ...]) -> list[str]:
    """What deleting `repo` would lose besides the given branches and tags:
    "branch `x`", "tag `y`", "stash@{0} (WIP on main: …)"."""
    lost = []
    refs = git(repo, "for-each-ref", "--format=%(refname)", "refs/heads", "refs/tags").stdout
    for ref in refs.split():
        kind, _, name = ref.removeprefix("refs/").partition("/")
        if name not in (branches if kind == "heads" else tags):
            lost.append(f"{'branch' if kind == 'heads' else 'tag'} `{name}`")
    stash = git(repo, "stash", "list", "--format=%gd (%gs)", check=False).stdout
    return lost + stash.splitlines()


def conflict_markers(repo: Path, base: str) -> list[str]:
    """"file (lines 3, 5, 7)" for each file where the commits base..HEAD or
    uncommitted edits in the work tree add conflict markers (<<<<<<<,
    =======, >>>>>>>)."""
    out = git(repo, "diff", "--check", base, check=False).stdout
    lines: dict[str, list[str]] = {}
    for m in re.finditer(r"^(.+?):(\d+): leftover conflict marker$", out, re.M):
        lines.setdefault(m.group(1), []).append(m.group(2))
    return [f"{f} (line{'s' if len(n) > 1 else ''} {', '.join(n)})" for f, n in lines.items()]
