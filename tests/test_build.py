"""build.sh and the Makefile, run for real on a copy of them whose collaborators
are stand-ins: a fake scripts/series.py (the real jobs rule, a one-commit
vllm-src/) and a fake build venv whose `pip wheel` writes, fails or hangs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

VERSION = "0.23.0+dsa.sm120.test"

FAKE_SERIES = """\
import os, subprocess, sys
sys.path.insert(0, os.environ["REAL_SCRIPTS"])
from patchseries import SeriesError
from patchseries.jobs import jobs_from_environment

command = sys.argv[1:]
if command == ["pin", "torch"]:
    print("2.11.0")
elif command == ["version"]:
    print("{version}")
elif command == ["fetch", "wheel"]:
    print(os.path.abspath("upstream.whl"))
elif command == ["jobs"]:
    try:
        print(*jobs_from_environment())
    except SeriesError as e:
        sys.exit(f"error: {{e}}")
elif command == ["apply"]:
    if not os.path.isdir("vllm-src"):
        os.mkdir("vllm-src")
        open("vllm-src/setup.py", "w").write("# vLLM\\n")
        for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "release"]):
            subprocess.run(["git", "-C", "vllm-src", *args], check=True)
else:
    sys.exit(f"fake series.py: unexpected {{command}}")
""".format(version=VERSION)

# The build venv's python. `-m pip wheel ... -w DIR ...` per $FAKE_PIP:
#   ok: writes a wheel; fail: writes half a wheel and fails;
#   hang: writes half a wheel, starts a child (like pip's build backend), ignores
#         SIGINT as pip does when a script runs it with `&`, and waits for ever.
FAKE_PYTHON = """\
#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
[ "$1 $2 $3" = "-m pip wheel" ] || exit 0
prev=
for arg in "$@"; do [ "$prev" = -w ] && dir=$arg; prev=$arg; done
wheel="$dir/vllm-{version}-cp38-abi3-linux_x86_64.whl"
case "$FAKE_PIP" in
  ok) echo wheel > "$wheel";;
  fail) echo half > "$wheel"; exit 1;;
  hang) trap '' INT
        echo half > "$wheel"
        sleep 1000 &
        echo $! >> "$FAKE_PIDS"; echo $$ >> "$FAKE_PIDS"
        wait;;
esac
""".format(version=VERSION)

TOOLS = ("bash", "sh", "env", "git", "tar", "cat", "ls", "head", "tail", "grep", "mkdir", "rm",
         "mv", "cp", "sleep", "mktemp", "dirname", "seq", "make", "ps", "sed", "tr", "date")


class FakeRepo:
    def __init__(self, root: Path, real: Path) -> None:
        self.root = root
        (root / "scripts").mkdir(parents=True)
        for name in ("build.sh", "Makefile"):
            shutil.copy2(real / name, root / name)
        for path in (real / "scripts").glob("*.py"):
            if path.name != "series.py":
                shutil.copy2(path, root / "scripts" / path.name)
        (root / "scripts/series.py").write_text(FAKE_SERIES)
        python = root / "venv/bin/python"
        python.parent.mkdir(parents=True)
        python.write_text(FAKE_PYTHON)
        python.chmod(0o755)
        (root / "upstream.whl").write_bytes(b"upstream")
        # A PATH with the tools the build uses, and python3 = this interpreter.
        self.bin = root / "tools"
        self.bin.mkdir()
        for tool in TOOLS:
            if found := shutil.which(tool):
                (self.bin / tool).symlink_to(found)
        (self.bin / "python3").symlink_to(sys.executable)
        self.log = root / "python.log"
        self.pids = root / "pids"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("MAX_JOBS", "NVCC_THREADS", "BUILD_MODE", "FORCE", "VLLM_SRC")}
        env.update(PATH=str(self.bin), VENV=str(self.root / "venv"), FAKE_LOG=str(self.log),
                   FAKE_PIDS=str(self.pids), FAKE_PIP="ok",
                   REAL_SCRIPTS=str(Path(__file__).resolve().parents[1] / "scripts"),
                   GIT_AUTHOR_NAME="test", GIT_AUTHOR_EMAIL="test@localhost.invalid",
                   GIT_COMMITTER_NAME="test", GIT_COMMITTER_EMAIL="test@localhost.invalid")
        env.update(extra)
        return env

    def pip_calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def fake_nvcc(self) -> None:
        nvcc = self.bin / "nvcc"
        nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0'\n")
        nvcc.chmod(0o755)


@pytest.fixture
def fake_repo(tmp_path: Path, repo: Path) -> FakeRepo:
    return FakeRepo(tmp_path / "repo", repo)


def build(fake: FakeRepo, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["./build.sh"], cwd=fake.root, env=fake.env(**env), text=True,
                          capture_output=True, timeout=timeout)


def test_fake_build_writes_the_wheel(fake_repo):
    result = build(fake_repo)
    assert result.returncode == 0, result.stderr
    wheel = fake_repo.root / "dist" / f"vllm-{VERSION}-cp38-abi3-linux_x86_64.whl"
    assert wheel.read_text() == "wheel\n"
    assert (fake_repo.root / "dist" / (wheel.name + ".mode")).read_text() == "precompiled\n"


def test_source_build_without_nvcc_stops_before_the_environment(fake_repo):
    result = build(fake_repo, BUILD_MODE="source")
    assert result.returncode == 1
    assert "error: BUILD_MODE=source needs nvcc (CUDA toolkit) on PATH" in result.stderr
    assert fake_repo.pip_calls() == []  # no torch install first


@pytest.mark.parametrize("name, value", [("MAX_JOBS", "abc"), ("NVCC_THREADS", "abc"),
                                         ("NVCC_THREADS", "0"), ("NVCC_THREADS", "-1"),
                                         ("MAX_JOBS", "-4")])
def test_source_build_with_bad_parallelism_is_a_message(fake_repo, name, value):
    fake_repo.fake_nvcc()
    result = build(fake_repo, BUILD_MODE="source", **{name: value})
    assert result.returncode == 1
    assert f"error: {name}='{value}': expected a whole number of at least 1" in result.stderr
    assert "Traceback" not in result.stderr
    assert fake_repo.pip_calls() == []


def test_source_build_passes_the_thread_budget(fake_repo):
    fake_repo.fake_nvcc()
    result = build(fake_repo, BUILD_MODE="source", MAX_JOBS="12", NVCC_THREADS="2")
    assert result.returncode == 0, result.stderr
    assert "MAX_JOBS=12 NVCC_THREADS=2: 6 nvcc jobs x 2 threads" in result.stdout
