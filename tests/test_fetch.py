"""Downloads: verified before use, nothing half-written left in the cache."""

import hashlib
from pathlib import Path

import pytest

from patchseries import SeriesError
from patchseries.fetch import fetch_file, pip_index_urls


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
        '<html><body><a href="../../files/demo-1.0.tar.gz#sha256=x">demo-1.0.tar.gz</a></body></html>')
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
    with pytest.raises(SeriesError, match="cached .*demo-1.0.tar.gz has sha256"):
        fetch_file("demo", "demo-1.0.tar.gz", sha, indexes=[url])


def test_missing_file_names_the_indexes(index):
    url, sha, cache, _ = index
    with pytest.raises(SeriesError, match="demo-2.0.tar.gz not found"):
        fetch_file("demo", "demo-2.0.tar.gz", sha, indexes=[url])


def test_index_urls_come_from_pip(monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "file:///nonexistent/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///elsewhere/simple")
    assert pip_index_urls() == ["file:///nonexistent/simple", "file:///elsewhere/simple"]
