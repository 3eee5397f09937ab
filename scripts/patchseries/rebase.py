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
"""

from __future__ import annotations

import re
import shutil
import signal
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import PATCH_DIR, PIN_FILE, REPO_ROOT, SeriesError
from .fetch import fetch_file, index_files
from .pin import Pin, load_pin, parse_pin
from .tree import (_AM_IDENTITY, _BASE_ENV, UPSTREAM_TAG, commit_release, export_patches, git,
                   read_series, series_digest)

REBASE_TREE = REPO_ROOT / "vllm-rebase"
COMPAT_DOC = REPO_ROOT / "docs" / "compatibility.md"
# The releases docs/compatibility.md reports on, besides the newest on the index.
COMPAT_VERSIONS = ("0.16.0", "0.20.2", "0.22.1", "0.23.0", "0.24.0")

OLD_TAG = "old-upstream"
_TARGET_PIN = "patchseries-target-pin"  # in .git: vllm-pin.txt for the target
_HAND_WORK = "patchseries-needs-finish"  # in .git: conflicts were left to the user
# --keep-non-patch: a subject like "[Kernel] ..." keeps its tag (plain `git am`
# strips every leading [...], which renames the patch on export).
_AM = (*_AM_IDENTITY, "am", "--3way", "--keep-cr", "--keep-non-patch")

APPLIED = "applied"
OFFSETS = "applied with offsets/fuzz"
CONFLICT = "conflict"
OBSOLETE = "obsolete"


# --------------------------------------------------------------------------
# The target: a release on the package index, or a commit of a git checkout
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """What to rebase onto. Exactly one of sdist / checkout is set."""
    version: str
    commit: str
    sdist: Path | None = None
    checkout: Path | None = None
    ref: str | None = None
    pin: Pin | None = None  # what vllm-pin.txt becomes; None when not a release

    def describe(self) -> str:
        return f"vLLM {self.version} (upstream {self.commit})"


def release_hashes(indexes: list[str] | None = None) -> dict[str, str]:
    """{file name: sha256} of vLLM's non-yanked files on the package indexes."""
    return {name: f.sha256 for name, f in index_files("vllm", indexes).items()
            if f.sha256 and not f.yanked}


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def newest_release(files: dict[str, str]) -> str:
    """Highest final release (no rc/dev/post) with an sdist among `files`."""
    versions = [m.group(1) for name in files
                if (m := re.fullmatch(r"vllm-(\d+(?:\.\d+)*)\.tar\.gz", name))]
    if not versions:
        raise SeriesError("no vLLM sdist found on the configured package indexes")
    return max(versions, key=_version_key)


def release_files(version: str, files: dict[str, str]) -> tuple[str, str]:
    """(sdist, x86_64 manylinux wheel) names of a release; the wheel with the
    highest build tag wins (0.23.0 has an untagged and a `-2` wheel)."""
    sdist = f"vllm-{version}.tar.gz"
    if sdist not in files:
        raise SeriesError(f"{sdist} is not on the configured package indexes")
    wheels = []
    for name in files:
        m = re.fullmatch(
            rf"vllm-{re.escape(version)}(?:-(\d+))?-cp\d+-abi3-manylinux\w*_x86_64\.whl", name)
        if m:
            wheels.append((int(m.group(1) or 0), name))
    if not wheels:
        raise SeriesError(f"no x86_64 manylinux wheel of vLLM {version} on the package indexes")
    return sdist, max(wheels)[1]


_TORCH_PIN = re.compile(r"""^\s*['"]?torch\s*==\s*([0-9][^\s;'",]*)""", re.M)


def release_metadata(sdist: Path) -> tuple[str, str]:
    """(upstream commit, torch version) recorded in a release sdist: the
    commit in vllm/_version.py, torch in requirements/cuda.txt (older
    releases: requirements-cuda.txt, pyproject.toml)."""
    commit = torch = None
    torch_files = ("requirements/cuda.txt", "requirements-cuda.txt", "pyproject.toml")
    with tarfile.open(sdist) as tar:
        for member in tar:
            name = member.name.partition("/")[2]
            if not member.isreg() or name not in ("vllm/_version.py", *torch_files):
                continue
            text = tar.extractfile(member).read().decode(errors="replace")
            if name == "vllm/_version.py":
                m = re.search(r"""__commit_id__\s*=.*?['"]g?([0-9a-f]{7,40})['"]""", text)
                commit = m.group(1) if m else None
            elif (m := _TORCH_PIN.search(text)) and not torch:
                torch = m.group(1)
            if commit and torch:
                return commit, torch
    if not commit:
        raise SeriesError(f"{sdist.name}: no __commit_id__ in vllm/_version.py")
    raise SeriesError(f"{sdist.name}: cannot find the torch version it pins")


def release_target(version: str, indexes: list[str] | None = None) -> Target:
    files = release_hashes(indexes)
    if version == "newest":
        version = newest_release(files)
    sdist_name, wheel_name = release_files(version, files)
    sdist = fetch_file("vllm", sdist_name, files[sdist_name], indexes)
    commit, torch = release_metadata(sdist)
    pin = Pin(version=version, commit=commit, sdist=sdist_name, sdist_sha256=files[sdist_name],
              wheel=wheel_name, wheel_sha256=files[wheel_name], torch=torch)
    return Target(version=version, commit=commit, sdist=sdist, pin=pin)


def checkout_target(src: Path, ref: str, indexes: list[str] | None = None) -> Target:
    """A commit of a vLLM git checkout. When it carries a release tag (vX.Y.Z)
    whose files are on the index, the target also gets that release's pin."""
    if not (src / ".git").exists():
        raise SeriesError(f"VLLM_SRC={src} is not a git checkout")
    result = git(src, "rev-parse", "--verify", "-q", f"{ref}^{{commit}}", check=False)
    if result.returncode:
        raise SeriesError(f"VLLM_REF={ref} is not a commit of {src}")
    commit = result.stdout.strip()
    described = git(src, "describe", "--tags", "--always", "--match", "v[0-9]*", commit,
                    check=False).stdout.strip()
    version = described[1:] if described.startswith("v") else described
    pin = None
    if re.fullmatch(r"\d+(\.\d+)*", version):
        try:
            files = release_hashes(indexes)
            sdist_name, wheel_name = release_files(version, files)
            sdist = fetch_file("vllm", sdist_name, files[sdist_name], indexes)
            released, torch = release_metadata(sdist)
            if commit.startswith(released):
                pin = Pin(version=version, commit=released, sdist=sdist_name,
                          sdist_sha256=files[sdist_name], wheel=wheel_name,
                          wheel_sha256=files[wheel_name], torch=torch)
        except SeriesError:
            pin = None
    return Target(version=version, commit=commit[:12], checkout=src, ref=commit, pin=pin)


# --------------------------------------------------------------------------
# Patch files
# --------------------------------------------------------------------------

@dataclass
class PatchInfo:
    path: Path
    modified: list[str]
    created: list[str]
    deleted: list[str]
    obsolete_if: list[tuple[str, str | None]]  # `Obsolete-If:` (path, regex; None: is gone)
    backport_of: str | None = None      # X of `Upstream-Status: Backport [vLLM X]`

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def files(self) -> list[str]:
        return self.modified + self.created + self.deleted


def read_patch(path: Path) -> PatchInfo:
    text = path.read_text(errors="replace")
    head = text.split("\n---\n", 1)[0]
    obsolete_if = []
    for m in re.finditer(r"^Obsolete-If:\s*(.*?)\s*$", head, re.M):
        cond = re.fullmatch(r"(\S+)\s+(?:matches\s+(.+)|(is gone))", m.group(1))
        if not cond:
            raise SeriesError(f"{path.name}: `Obsolete-If: {m.group(1)}` is neither "
                              "`<path> matches <regex>` nor `<path> is gone`")
        if cond.group(2):
            try:
                re.compile(cond.group(2))
            except re.error as e:
                raise SeriesError(f"{path.name}: bad regex in Obsolete-If: {e}") from None
        obsolete_if.append((cond.group(1), cond.group(2)))
    backport = re.search(r"^Upstream-Status:\s*Backport\s*\[(?:vLLM\s+)?v?(\d+(?:\.\d+)+)",
                         head, re.M | re.I)
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
    return PatchInfo(path, modified, created, deleted, obsolete_if,
                     backport.group(1) if backport else None)


# --------------------------------------------------------------------------
# The work tree
# --------------------------------------------------------------------------

@dataclass
class PatchResult:
    name: str
    status: str
    detail: str = ""
    files: list[str] = field(default_factory=list)

    @property
    def carried(self) -> bool:
        return self.status != CONFLICT


def _has(tree: Path, rev: str, path: str) -> bool:
    return not git(tree, "cat-file", "-e", f"{rev}:{path}", check=False).returncode


def _conflict_detail(tree: Path, patch: Path, gone: list[str],
                     dropped: dict[str, tuple[str, str]]) -> tuple[str, list[str]]:
    """Files and hunks of a failed `git am --3way` (still in progress)."""
    unmerged = git(tree, "diff", "--name-only", "--diff-filter=U").stdout.split()
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
        check = git(tree, "apply", "--check", str(patch), check=False).stderr
        failed: dict[str, int] = {}
        for m in re.finditer(r"^error: patch failed: (.+?):\d+$", check, re.M):
            failed[m.group(1)] = failed.get(m.group(1), 0) + 1
        for m in re.finditer(r"^error: (.+?): (does not exist|already exists)", check, re.M):
            failed.setdefault(m.group(1), 0)
        for f, n in failed.items():
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
    return _version_key(m.group(1)) if m else None


def _classify(tree: Path, info: PatchInfo, dropped: dict[str, tuple[str, str]],
              version: str = "") -> PatchResult:
    """Try one patch on the clean HEAD of `tree` (vLLM `version`); commit it
    when it applies. `dropped` maps each file created by an earlier patch that
    was not carried to (that patch's name, its status)."""
    release = _release_of(version)
    if info.backport_of and release and release >= _version_key(info.backport_of):
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
    result = git(tree, *_AM, str(info.path), check=False)
    if result.returncode:
        detail, files = _conflict_detail(tree, info.path, gone, dropped)
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
                     f"patches/series on vLLM {pin.version}", env=_BASE_ENV).stdout.strip()
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
        print(f"[{i}/{len(patches)}] {patch.name}: {r.status}", flush=True)
        if r.status in (CONFLICT, OBSOLETE):
            for f in info.created:
                dropped[f] = (patch.name, r.status)
        results.append(r)
    return results


def format_table(results: list[PatchResult]) -> str:
    width = max([len("patch")] + [len(r.name) for r in results])
    lines = [f"{'patch':<{width}}  {'status':<25}  detail", f"{'-' * width}  {'-' * 25}  ------"]
    lines += [f"{r.name:<{width}}  {r.status:<25}  {r.detail}".rstrip() for r in results]
    return "\n".join(lines)


# --------------------------------------------------------------------------
# vllm-pin.txt and patches/
# --------------------------------------------------------------------------

def pin_text(pin: Pin) -> str:
    text = f"""\
# The vLLM release this patch series applies to. One `key = value` per line;
# parsed by scripts/patchseries/pin.py, the only reader of this file.
# Written by `make rebase` (scripts/patchseries/rebase.py).
version = {pin.version}
# Upstream commit of the release, as recorded in its version metadata
# (vllm/_version.py of the sdist). A VLLM_SRC checkout must be at it.
commit = {pin.commit}
sdist = {pin.sdist}
sdist_sha256 = {pin.sdist_sha256}
# x86_64 wheel whose compiled ops the default build reuses (the highest build
# tag on the index when a release has several).
wheel = {pin.wheel}
wheel_sha256 = {pin.wheel_sha256}
# torch that the release pins (requirements/cuda.txt).
torch = {pin.torch}
"""
    parse_pin(text)  # never write a pin the tools cannot read
    return text


def write_series(work: Path, pin: Pin, patch_dir: Path = PATCH_DIR,
                 pin_file: Path = PIN_FILE) -> list[Path]:
    """Export upstream..HEAD of `work` into patch_dir and write pin_file.
    Everything is prepared first; the repository files change at the end."""
    text = pin_text(pin)
    if (work / ".git" / "rebase-apply").exists():
        raise SeriesError(f"{work.name}/: a `git am` is in progress; finish it first")
    if git(work, "status", "--porcelain", "--untracked-files=no").stdout.strip():
        raise SeriesError(f"{work.name}/ has uncommitted changes; commit them first")
    with tempfile.TemporaryDirectory() as tmp:
        new = export_patches(work, Path(tmp))
        contents = {p.name: p.read_bytes() for p in new}
    old = read_series(patch_dir)
    try:
        unchanged = load_pin(pin_file) == pin
    except SeriesError:
        unchanged = False
    # Ctrl-C waits until patches/ and the pin are consistent.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        patch_dir.mkdir(exist_ok=True)
        for p in old:
            if p.name not in contents:
                p.unlink()
        for name, data in contents.items():
            (patch_dir / name).write_bytes(data)
        (patch_dir / "series").write_text("".join(f"{n}\n" for n in contents))
        if not unchanged:  # keep the file, comments and all, when the pin is the same
            tmp_pin = pin_file.with_name(pin_file.name + ".new")
            tmp_pin.write_text(text)
            tmp_pin.replace(pin_file)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
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
    if carried:
        # The probe branch already holds exactly the carried patches.
        git(work, "checkout", "-q", "-B", "main", "probe")
    else:
        git(work, "checkout", "-q", "-f", "-B", "main", UPSTREAM_TAG)
        (work / ".git" / _HAND_WORK).write_text("")
        if keep:
            git(work, *_AM, *map(str, keep), check=False)
    git(work, "branch", "-q", "-D", "probe")
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
    written = write_series(work, pin, patch_dir, pin_file)
    (work / ".git" / _HAND_WORK).unlink(missing_ok=True)
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


# --------------------------------------------------------------------------
# docs/compatibility.md
# --------------------------------------------------------------------------

def _sentence(r: PatchResult, version: str) -> str:
    """One sentence on why a patch does not simply apply to `version`."""
    files = ", ".join(f"`{f}`" for f in r.files)
    if r.status == CONFLICT:
        if r.detail.startswith("builds on"):
            return f"{version}: conflict; it {r.detail}."
        where = re.sub(r"(\S+?) \(", r"`\1` (", r.detail)
        if "did not carry over" in r.detail:
            return f"{version}: conflict in {where}; port it by hand."
        return (f"{version}: conflict in {where}: upstream changed the code it edits; "
                "port it by hand.")
    if r.detail.startswith("gone upstream"):
        text = (f"{files}, which it patches, {'is' if len(r.files) == 1 else 'are'} "
                "gone upstream")
        if "builds on" in r.detail:
            text += "; it " + r.detail.split("; ", 1)[1]
    elif r.detail.startswith("builds on"):
        text = f"it {r.detail}"
    elif r.detail.startswith("backport"):
        text = f"it is a {r.detail} (`Upstream-Status: Backport`)"
    elif r.detail.startswith("Obsolete-If"):
        text = f"its header's condition holds: {r.detail.removeprefix('Obsolete-If holds: ')}"
    else:
        text = r.detail
    return f"{version}: obsolete, {text}; a rebase drops it."


def compat_markdown(pin: Pin, patches: list[Path], table: dict[str, list[PatchResult]],
                    newest: str | None = None) -> str:
    versions = list(table)
    heads = [f"{v} (newest)" if v == newest else v for v in versions]
    out = [
        "# Compatibility of the patch series with vLLM releases",
        "",
        "Generated by `make compat` (`scripts/series.py compat`); do not edit. The series",
        f"(`patches/series`, digest `{series_digest(patches)[:12]}`) is pinned to vLLM "
        f"{pin.version};",
        "each column is what `make rebase VLLM_VERSION=<release>` reports for that release.",
        "",
        "- **applied**: applies as it is.",
        "- **applied with offsets/fuzz**: applies at shifted lines or through the 3-way merge.",
        "- **conflict**: upstream changed the lines it edits; a rebase stops there.",
        "- **obsolete**: its change is already upstream, the files it patches are gone, or its",
        "  header says so (`Upstream-Status: Backport [vLLM X]`, `Obsolete-If:`); a rebase",
        "  drops it from the series.",
        "",
        "| patch | " + " | ".join(heads) + " |",
        "|---|" + "---|" * len(versions),
    ]
    for i, patch in enumerate(patches):
        out.append(f"| `{patch.name}` | " + " | ".join(table[v][i].status for v in versions) + " |")
    carried = [v for v in versions if all(r.carried for r in table[v])]
    out += ["", "Carries over without manual work to: "
            + (", ".join(carried) if carried else "none of these") + "."]
    notes = []
    for i, patch in enumerate(patches):
        lines = [f"  - {_sentence(table[v][i], v)}" for v in versions
                 if table[v][i].status in (OBSOLETE, CONFLICT)]
        if lines:
            notes += [f"- `{patch.name}`", *lines]
    if notes:
        out += ["", "## Why a patch does not apply", "", *notes]
    return "\n".join(out) + "\n"


def compat(versions: list[str] | None = None, patch_dir: Path = PATCH_DIR,
           doc: Path = COMPAT_DOC, pin_file: Path = PIN_FILE) -> str:
    pin = load_pin(pin_file)
    patches = read_series(patch_dir)
    newest = None
    if versions is None:
        newest = newest_release(release_hashes())
        versions = list(COMPAT_VERSIONS) + ([newest] if newest not in COMPAT_VERSIONS else [])
    table: dict[str, list[PatchResult]] = {}
    with tempfile.TemporaryDirectory(prefix="vllm-compat-") as tmp:
        for version in versions:
            work = Path(tmp) / version
            outcome = rebase(release_target(version), pin, patch_dir, work, replay=False,
                             pin_file=pin_file)
            table[version] = outcome.results
            shutil.rmtree(work)
            print(format_table(outcome.results), flush=True)
    text = compat_markdown(pin, patches, table, newest)
    doc.parent.mkdir(exist_ok=True)
    doc.write_text(text)
    return text
