"""Downloads: verified before use, nothing half-written left in the cache."""

import hashlib
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from patchseries import SeriesError
from patchseries.fetch import fetch_file, pip_index_urls
from patchseries.pin import load_pin


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A PEP 503 index on disk holding one file, and an empty cache."""
    payload = b"pretend release contents\n" * 1000
    files = tmp_path / "files"
    files.mkdir()
    (files / "demo-1.0.tar.gz").write_bytes(payload)
    page = tmp_path / "simple" / "demo"
    page.mkdir(parents=True)
    (page / "index.html").write_text(
        '<html><body><a href="../../files/demo-1.0.tar.gz#sha256=x">demo-1.0.tar.gz</a>'
        '</body></html>')
    cache = tmp_path / "cache"
    monkeypatch.setenv("VLLM_DSA_CACHE", str(cache))
    return (tmp_path / "simple").as_uri(), hashlib.sha256(payload).hexdigest(), cache, files


def test_download_verifies_and_caches(index):
    url, sha, cache, files = index
    path = fetch_file("demo", "demo-1.0.tar.gz", sha, indexes=[url])
    assert path == cache / "demo-1.0.tar.gz"
    assert path.read_bytes() == (files / "demo-1.0.tar.gz").read_bytes()
    # Offline re-run: the index is gone, the verified cache answers.
    (files / "demo-1.0.tar.gz").unlink()
    assert fetch_file("demo", "demo-1.0.tar.gz", sha, indexes=[url]) == path


def test_sha_mismatch_is_refused_and_nothing_cached(index):
    url, sha, cache, _ = index
    wrong = "0" * 64
    with pytest.raises(SeriesError) as err:
        fetch_file("demo", "demo-1.0.tar.gz", wrong, indexes=[url])
    message = str(err.value)
    assert "demo-1.0.tar.gz" in message and wrong in message and sha in message
    assert list(cache.iterdir()) == []


def test_corrupt_cached_file_is_named_not_used(index):
    url, sha, cache, _ = index
    cache.mkdir()
    (cache / "demo-1.0.tar.gz").write_bytes(b"truncated")
    with pytest.raises(SeriesError) as err:
        fetch_file("demo", "demo-1.0.tar.gz", sha, indexes=[url])
    message = str(err.value)
    assert str(cache / "demo-1.0.tar.gz") in message and sha in message
    assert hashlib.sha256(b"truncated").hexdigest() in message
    assert (cache / "demo-1.0.tar.gz").read_bytes() == b"truncated"  # not used, not deleted


def test_wrong_pin_with_good_cache_says_they_disagree(index):
    """A mistyped sha256 in vllm-pin.txt must not send the user off to delete
    a valid cached file: the message shows both values and where each is from."""
    url, sha, cache, _ = index
    fetch_file("demo", "demo-1.0.tar.gz", sha, indexes=[url])  # a good cache entry
    wrong = "0" * 64
    with pytest.raises(SeriesError) as err:
        fetch_file("demo", "demo-1.0.tar.gz", wrong, indexes=[url])
    message = str(err.value)
    assert "disagree" in message
    assert f"vllm-pin.txt says sha256 {wrong}" in message
    assert f"{cache / 'demo-1.0.tar.gz'} has sha256 {sha}" in message
    assert "git diff vllm-pin.txt" in message  # how to resolve
    assert (cache / "demo-1.0.tar.gz").exists()


@pytest.mark.parametrize("listed, verdict", [
    ("file", "the package index lists the cached file's sha256: vllm-pin.txt is wrong"),
    ("pin", "the package index lists the pinned sha256: the cached file is damaged"),
])
def test_disagreement_names_the_side_the_index_takes(index, listed, verdict):
    url, sha, cache, files = index
    fetch_file("demo", "demo-1.0.tar.gz", sha, indexes=[url])
    wrong = "0" * 64
    page = Path(urllib.parse.urlparse(url).path) / "demo" / "index.html"
    listed_sha = sha if listed == "file" else wrong
    page.write_text(page.read_text().replace("#sha256=x", f"#sha256={listed_sha}"))
    with pytest.raises(SeriesError, match=verdict):
        fetch_file("demo", "demo-1.0.tar.gz", wrong, indexes=[url])


def test_missing_file_names_the_indexes(index):
    url, sha, cache, _ = index
    with pytest.raises(SeriesError, match="demo-2.0.tar.gz not found"):
        fetch_file("demo", "demo-2.0.tar.gz", sha, indexes=[url])


def test_index_urls_come_from_pip(monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "file:///nonexistent/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///elsewhere/simple")
    assert pip_index_urls() == ["file:///nonexistent/simple", "file:///elsewhere/simple"]


def pip_env(monkeypatch: pytest.MonkeyPatch, config: str = "", **settings: str) -> None:
    """pip's configuration for a test: no files but `config`, only these PIP_* variables."""
    for key in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(key)
    pip_conf = Path(os.environ["VLLM_DSA_CACHE"]).parent / "pip.conf"
    pip_conf.write_text(config)
    monkeypatch.setenv("PIP_CONFIG_FILE", str(pip_conf))
    for key, value in settings.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("where", ["environment", "config"])
def test_pip_no_index_is_honoured(index, monkeypatch, where):
    """PIP_NO_INDEX (or no-index in pip.conf): no download; the message says
    the pinned file is not cached and where it goes."""
    url, sha, cache, _ = index
    if where == "environment":
        pip_env(monkeypatch, PIP_INDEX_URL=url, PIP_NO_INDEX="1")
    else:
        pip_env(monkeypatch, f"[global]\nindex-url = {url}\nno-index = true\n")
    with pytest.raises(SeriesError, match=rf"the pinned demo-1\.0\.tar\.gz is not cached in "
                                          rf"{cache} and pip is set to use no package index"):
        fetch_file("demo", "demo-1.0.tar.gz", sha)
    assert not cache.exists() or not any(cache.iterdir())


def test_pip_find_links_serve_the_file_without_an_index(index, monkeypatch):
    url, sha, cache, files = index
    pip_env(monkeypatch, PIP_INDEX_URL="file:///nonexistent/simple", PIP_NO_INDEX="1",
            PIP_FIND_LINKS=str(files))
    path = fetch_file("demo", "demo-1.0.tar.gz", sha)
    assert path == cache / "demo-1.0.tar.gz"
    assert path.read_bytes() == (files / "demo-1.0.tar.gz").read_bytes()


def test_stale_partial_downloads_are_removed(index):
    """A run killed outright (SIGKILL) leaves <file>.<pid>.part behind; the next
    fetch deletes those whose process is gone and keeps a running one's."""
    url, sha, cache, _ = index
    cache.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        stale = [cache / f"demo-1.0.tar.gz.{dead.pid}.part", cache / f"other.whl.{dead.pid}.part"]
        running = cache / f"other.whl.{alive.pid}.part"
        for path in (*stale, running):
            path.write_bytes(b"partial")
        fetch_file("demo", "demo-1.0.tar.gz", sha, indexes=[url])
        assert sorted(p.name for p in cache.iterdir()) == sorted(["demo-1.0.tar.gz", running.name])
    finally:
        alive.kill()
        alive.wait()


class _SlowFile(http.server.BaseHTTPRequestHandler):
    """An index page for vllm and a download that trickles in."""
    filename = ""

    def do_GET(self) -> None:
        if self.path.startswith("/simple/"):
            body = f'<a href="/files/{self.filename}">{self.filename}</a>'.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(64 << 20))
        self.end_headers()
        try:
            for _ in range(1024):
                self.wfile.write(b"x" * (64 << 10))
                time.sleep(0.05)
        except OSError:
            pass  # the client went away

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_download_leaves_no_partial_file(repo, tmp_path, signum):
    """`series.py fetch` stopped by Ctrl-C or SIGTERM mid-download: it exits,
    and no .part file is left in the cache."""
    pin = load_pin()
    _SlowFile.filename = pin.sdist
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowFile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(VLLM_DSA_CACHE=str(cache), PIP_CONFIG_FILE=os.devnull,
               PIP_INDEX_URL=f"http://127.0.0.1:{server.server_port}/simple")
    fetch = subprocess.Popen([sys.executable, str(repo / "scripts/series.py"), "fetch", "sdist"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list(cache.glob("*.part")):
            assert fetch.poll() is None, fetch.communicate()
            assert time.monotonic() < deadline, "the download never started"
            time.sleep(0.05)
        time.sleep(0.3)
        fetch.send_signal(signum)
        _, stderr = fetch.communicate(timeout=20)
    finally:
        fetch.kill()
        server.shutdown()
        server.server_close()
    assert fetch.returncode != 0
    assert "Traceback" not in stderr
    assert list(cache.iterdir()) == []
