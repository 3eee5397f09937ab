"""Download release files from the package index pip is configured with
(or its find-links; with no-index set, from find-links only).

Files land in a cache outside the repository (`$VLLM_DSA_CACHE`, else
`$XDG_CACHE_HOME/vllm-dsa-series`, else `~/.cache/vllm-dsa-series`), are checked
against a pinned sha256 before use, and appear under their final name only
once complete and verified, so an interrupted or corrupt download never
poisons the cache; the partial file of a download that was killed outright is
deleted by the next fetch. A verified cached file is used without touching the
network.
"""

from __future__ import annotations

import hashlib
import html.parser
import json
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from . import SeriesError

_CHUNK = 1 << 20


def cache_dir() -> Path:
    if env := os.environ.get("VLLM_DSA_CACHE"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(xdg) / "vllm-dsa-series"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class PipSources:
    indexes: list[str]     # index-url then extra-index-urls; none with no-index
    find_links: list[str]  # folders or pages of links
    no_index: bool


def pip_sources() -> PipSources:
    """Where `pip download` would look, exactly as it sees it (configuration
    files and PIP_* variables, pip's own default otherwise)."""
    probe = ("import json\n"
             "from pip._internal.commands import create_command\n"
             "o, _ = create_command('download').parse_args([])\n"
             "print(json.dumps([o.index_url, o.extra_index_urls, o.find_links, o.no_index]))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if result.returncode:
        raise SeriesError(f"cannot read pip's index configuration:\n{result.stderr.strip()}")
    index_url, extra, find_links, no_index = json.loads(result.stdout)
    return PipSources([] if no_index else [index_url, *extra], find_links, bool(no_index))


def pip_index_urls() -> list[str]:
    """index-url then extra-index-urls as `pip download` sees them; none when
    pip is set to use no index (PIP_NO_INDEX, no-index in pip.conf)."""
    return pip_sources().indexes


def find_links_url(filename: str, find_links: list[str]) -> str | None:
    """The URL of `filename` in pip's find-links: a folder that holds it, or a
    page that links to it."""
    for link in find_links:
        parsed = urllib.parse.urlparse(link)
        folder = (Path(urllib.parse.unquote(parsed.path)) if parsed.scheme == "file"
                  else Path(link) if not parsed.scheme else None)
        if folder is not None and folder.is_dir():
            if (folder / filename).is_file():
                return (folder / filename).resolve().as_uri()
            continue
        page = folder.resolve().as_uri() if folder is not None else link
        try:
            with urllib.request.urlopen(page, timeout=60) as response:
                parser = _Links()
                parser.feed(response.read().decode(errors="replace"))
        except (urllib.error.URLError, OSError, ValueError):
            continue
        for href, _ in parser.links:
            url = urllib.parse.urljoin(page, href).split("#", 1)[0]
            if urllib.parse.unquote(url.rsplit("/", 1)[-1]) == filename:
                return url
    return None


@dataclass(frozen=True)
class IndexFile:
    url: str
    sha256: str  # "" where the index gives none
    yanked: bool


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, bool]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "a" and a.get("href"):
            self.links.append((a["href"], "data-yanked" in a))


def index_files(project: str, indexes: list[str] | None = None) -> dict[str, IndexFile]:
    """A project's files on the package indexes (PEP 503 HTML or PEP 691 JSON
    simple pages); the first index that names a file wins."""
    files: dict[str, IndexFile] = {}
    failed = []
    for index in indexes if indexes is not None else pip_index_urls():
        page = index.rstrip("/") + "/" + project + "/"
        parsed = urllib.parse.urlparse(page)
        if parsed.scheme == "file":  # a directory index on disk
            page = (Path(urllib.parse.unquote(parsed.path)) / "index.html").as_uri()
        request = urllib.request.Request(
            page, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                body = response.read().decode()
                kind = response.headers.get("Content-Type", "")
        except (urllib.error.URLError, OSError) as e:
            failed.append(f"{index} ({getattr(e, 'reason', e)})")
            continue  # an index without the project, or offline: try the next
        if "json" in kind:
            for f in json.loads(body)["files"]:
                files.setdefault(f["filename"], IndexFile(
                    urllib.parse.urljoin(page, f["url"]).split("#", 1)[0],
                    f.get("hashes", {}).get("sha256", ""), bool(f.get("yanked"))))
            continue
        parser = _Links()
        parser.feed(body)
        for href, yanked in parser.links:
            url = urllib.parse.urlparse(urllib.parse.urljoin(page, href))
            name = urllib.parse.unquote(url.path.rsplit("/", 1)[-1])
            sha = urllib.parse.parse_qs(url.fragment).get("sha256", [""])[0]
            files.setdefault(name, IndexFile(url._replace(fragment="").geturl(), sha, yanked))
    if not files and failed:
        raise SeriesError(f"cannot read {project}'s page on the package indexes: "
                          + ", ".join(failed))
    return files


def find_file_url(project: str, filename: str, indexes: list[str]) -> str:
    found = index_files(project, indexes).get(filename)
    if found is None:
        raise SeriesError(f"{filename} not found on the configured package indexes: "
                          + ", ".join(indexes))
    return found.url


def _download(url: str, dest: Path) -> None:
    with urllib.request.urlopen(url, timeout=120) as response, open(dest, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0)
        done, shown = 0, -1
        while chunk := response.read(_CHUNK):
            out.write(chunk)
            done += len(chunk)
            if total and done * 10 // total != shown:  # a line every 10 %
                shown = done * 10 // total
                print(f"  {dest.name[:-5]}: {done >> 20}/{total >> 20} MiB", file=sys.stderr,
                      flush=True)
        if total and done != total:
            raise SeriesError(f"download of {dest.name[:-5]} truncated: {done} of {total} bytes")


def _disagreement(project: str, cached: Path, pinned: str, actual: str,
                  indexes: list[str] | None) -> str:
    """What to tell the user when a cached file does not match its pin. The
    cache only takes files that matched the pin when they were downloaded, so
    either the pin changed since or the file did; the index's sha256, where it
    can be read, says which."""
    lines = [f"vllm-pin.txt and the cached file disagree about {cached.name}:",
             f"  vllm-pin.txt says sha256 {pinned}",
             f"  {cached} has sha256 {actual}"]
    try:
        listed = index_files(project, indexes).get(cached.name)
        listed_sha = listed.sha256 if listed else ""
        reason = f"{cached.name} is not on it" if not listed else "it lists no sha256"
    except SeriesError as e:
        listed_sha, reason = "", str(e)
    if listed_sha == actual:
        lines.append("  the package index lists the cached file's sha256: vllm-pin.txt is wrong; "
                     "restore it (`git diff vllm-pin.txt`) or correct the value")
    elif listed_sha == pinned:
        lines.append("  the package index lists the pinned sha256: the cached file is damaged; "
                     f"delete {cached} and re-run to download it again")
    else:
        lines.append("  the package index cannot tell which is right "
                     f"({reason or 'it lists ' + listed_sha})")
        lines.append("  if vllm-pin.txt was edited by mistake, restore it "
                     "(`git diff vllm-pin.txt`); if the file was changed after its download, "
                     f"delete {cached} and re-run")
    return "\n".join(lines)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_stale_parts(cache: Path) -> None:
    """Delete partial downloads (`<file>.<pid>.part`) whose process is gone:
    what a run killed outright (SIGKILL, power loss) left behind."""
    for part in cache.glob("*.part"):
        pid = part.name[:-len(".part")].rpartition(".")[2]
        if pid.isdigit() and not _running(int(pid)):
            part.unlink(missing_ok=True)


def fetch_file(project: str, filename: str, sha256: str, indexes: list[str] | None = None) -> Path:
    """Return the cached, verified path of `filename`, downloading it if needed."""
    cache = cache_dir()
    target = cache / filename
    if cache.is_dir():
        remove_stale_parts(cache)
    if target.exists():
        actual = sha256_of(target)
        if actual == sha256:
            return target
        raise SeriesError(_disagreement(project, target, sha256, actual, indexes))
    cache.mkdir(parents=True, exist_ok=True)
    sources = PipSources(indexes, [], False) if indexes is not None else pip_sources()
    url = find_links_url(filename, sources.find_links)
    if url is None and sources.no_index:
        raise SeriesError(
            f"the pinned {filename} is not cached in {cache} and pip is set to use no package "
            f"index (PIP_NO_INDEX or no-index in pip's configuration)"
            + (f"; its find-links ({', '.join(sources.find_links)}) do not have it either"
               if sources.find_links else "")
            + f": copy the file (sha256 {sha256}) into {cache}, or allow the index")
    if url is None:
        url = find_file_url(project, filename, sources.indexes)
    part = cache / f"{filename}.{os.getpid()}.part"
    print(f"downloading {filename}", file=sys.stderr, flush=True)
    try:
        _download(url, part)
        actual = sha256_of(part)
        if actual != sha256:
            raise SeriesError(
                f"sha256 mismatch for {filename}: expected {sha256}, got {actual}; "
                "nothing was cached"
            )
        os.replace(part, target)
    except (urllib.error.URLError, OSError) as e:
        raise SeriesError(f"download of {filename} failed: {getattr(e, 'reason', e)}") from None
    finally:
        part.unlink(missing_ok=True)
    return target
