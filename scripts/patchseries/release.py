"""What a rebase targets: a vLLM release on the package index (its sdist,
wheel, upstream commit and torch), or a commit of a vLLM git checkout."""

from __future__ import annotations

import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from . import SeriesError
from .fetch import fetch_file, index_files
from .gitrepo import git
from .pin import Pin


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


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def newest_release(files: dict[str, str]) -> str:
    """Highest final release (no rc/dev/post) with an sdist among `files`."""
    versions = [m.group(1) for name in files
                if (m := re.fullmatch(r"vllm-(\d+(?:\.\d+)*)\.tar\.gz", name))]
    if not versions:
        raise SeriesError("no vLLM sdist found on the configured package indexes")
    return max(versions, key=version_key)


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

