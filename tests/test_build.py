"""build.sh and the Makefile, run for real on a copy of them whose collaborators
are stand-ins: a fake scripts/series.py (the real jobs rule, a one-commit
vllm-src/) and a fake build venv whose `pip wheel` writes, fails or hangs."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

VERSION = "0.23.0+dsa.sm120.test"

# The real patchseries package comes from PYTHONPATH (FakeRepo.env).
FAKE_SERIES = """\
import os, subprocess, sys
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

# The build venv's python. Asked about torch.cuda, it has $FAKE_GPUS GPUs (default
# none). `-m pip wheel ... -w DIR ...` per $FAKE_PIP:
#   ok: writes a wheel; fail: writes half a wheel and fails;
#   hang: writes half a wheel, starts a child (like pip's build backend), ignores
#         SIGINT as pip does when a script runs it with `&`, and waits for ever.
FAKE_PYTHON = """\
#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
case "$*" in *torch.cuda*) echo "${{FAKE_GPUS:-0}}"; exit 0;; esac
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
        for path in [*(real / "scripts").glob("*.py"), *(real / "scripts").glob("*.sh")]:
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
                   PYTHONPATH=str(Path(__file__).resolve().parents[1] / "scripts"),
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


def leftovers(fake: FakeRepo) -> list[str]:
    """Live processes that the fake build started (all carry its FAKE_LOG)."""
    marker = f"FAKE_LOG={fake.log}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    environ = f.read().split(b"\0")
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in environ and state != b"Z":
                found.append(f"{entry.name}: {cmdline}")
    return found


def kill_leftovers(fake: FakeRepo) -> None:
    for line in leftovers(fake):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)


OLD_WHEEL = f"vllm-{VERSION}-cp38-abi3-linux_x86_64.whl"

# How the run is stopped: Ctrl-C in a terminal signals the whole foreground
# process group; `kill` signals one process (make passes SIGTERM on to the
# recipe); timeout(1) and service managers signal the whole group.
STOPS = {
    "ctrl-c": lambda proc: os.killpg(proc.pid, signal.SIGINT),
    "sigterm": lambda proc: proc.send_signal(signal.SIGTERM),
    "sigterm-group": lambda proc: os.killpg(proc.pid, signal.SIGTERM),
}


@pytest.mark.parametrize("stop", STOPS)
@pytest.mark.parametrize("command", [["./build.sh"], ["make", "build-wheel"], ["make", "test"]],
                         ids=["build.sh", "make-build-wheel", "make-test"])
def test_stopping_the_build_stops_everything_and_writes_nothing(fake_repo, command, stop):
    """Interrupted while `pip wheel` runs (and has half-written a wheel): every
    process the run started is gone by the time it returns, dist/ holds what it
    held before (a wheel of another build mode), and no partial file is left."""
    dist = fake_repo.root / "dist"
    dist.mkdir()
    (dist / OLD_WHEEL).write_text("old\n")
    (dist / (OLD_WHEEL + ".mode")).write_text("source arch=12.0\n")
    # As from a terminal: SIGINT at its default even where this test runs with
    # it ignored (a job started with `&` by a non-interactive shell).
    proc = subprocess.Popen(command, cwd=fake_repo.root, env=fake_repo.env(FAKE_PIP="hang"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while len(fake_repo.pids.read_text().split() if fake_repo.pids.exists() else []) < 2:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "pip wheel never started"
            time.sleep(0.05)
        STOPS[stop](proc)
        output = proc.communicate(timeout=30)[0]
        running = leftovers(fake_repo)
    finally:
        proc.kill()
        kill_leftovers(fake_repo)
    assert proc.returncode != 0
    assert running == [], f"still running after {command} returned:\n" + "\n".join(running)
    assert sorted(p.name for p in dist.iterdir()) == [OLD_WHEEL, OLD_WHEEL + ".mode"], output
    assert (dist / OLD_WHEEL).read_text() == "old\n"
    assert not (fake_repo.root / "build/wheel.tmp").exists()
    assert not list(fake_repo.root.rglob("*.part"))


def test_failed_build_leaves_dist_as_it_was(fake_repo):
    dist = fake_repo.root / "dist"
    dist.mkdir()
    (dist / OLD_WHEEL).write_text("old\n")
    (dist / (OLD_WHEEL + ".mode")).write_text("source arch=12.0\n")
    result = build(fake_repo, FAKE_PIP="fail")
    assert result.returncode == 1
    assert "error: wheel build failed (dist/ is unchanged)" in result.stderr
    assert sorted(p.name for p in dist.iterdir()) == [OLD_WHEEL, OLD_WHEEL + ".mode"]
    assert (dist / OLD_WHEEL).read_text() == "old\n"
    assert not (fake_repo.root / "build/wheel.tmp").exists()


def test_build_replaces_a_wheel_of_another_mode(fake_repo):
    dist = fake_repo.root / "dist"
    dist.mkdir()
    (dist / OLD_WHEEL).write_text("old\n")
    (dist / (OLD_WHEEL + ".mode")).write_text("source arch=12.0\n")
    result = build(fake_repo)
    assert result.returncode == 0, result.stderr
    assert (dist / OLD_WHEEL).read_text() == "wheel\n"
    assert (dist / (OLD_WHEEL + ".mode")).read_text() == "precompiled\n"
    assert not (fake_repo.root / "build/wheel.tmp").exists()


@pytest.mark.parametrize("gpus", ["0", "1"])
def test_test_gpu_without_a_gpu_fails_before_anything_runs(fake_repo, gpus):
    """Every GPU test would skip itself and the run would pass: `make test-gpu`
    stops instead, before the build, the models and pytest."""
    result = subprocess.run(["make", "test-gpu"], cwd=fake_repo.root, text=True,
                            env=fake_repo.env(FAKE_GPUS=gpus), capture_output=True, timeout=120)
    calls = "\n".join(fake_repo.pip_calls())
    if gpus == "0":
        assert result.returncode != 0
        assert "error: no CUDA GPU found" in result.stderr and "make test" in result.stderr
        assert "pip wheel" not in calls and "models.py" not in calls and "pytest" not in calls
    else:
        assert result.returncode == 0, result.stderr
        assert "tests/e2e/models.py build" in calls and "-m pytest tests -m gpu" in calls
        assert "-m ruff" not in calls  # the lint is make test's (CI's), not test-gpu's


def test_make_test_lints_after_the_install_before_pytest(fake_repo):
    """CI runs `make test`: ruff check, from the venv (tests/requirements.txt
    installs it), runs once the wheel and the requirements are in, before pytest."""
    result = subprocess.run(["make", "test"], cwd=fake_repo.root, text=True,
                            env=fake_repo.env(), capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr
    calls = fake_repo.pip_calls()
    requirements = calls.index("-m pip install -q -r tests/requirements.txt")
    lint = calls.index("-m ruff check .")
    pytest_run = next(i for i, c in enumerate(calls) if c.startswith("-m pytest tests"))
    assert requirements < lint < pytest_run


@pytest.mark.parametrize("skip", ["", "torch"])
def test_failed_wheelhouse_leaves_no_half_filled_folder(fake_repo, skip):
    """`make wheelhouse` whose `pip download` (with WHEELHOUSE_SKIP, pip's
    resolution) fails (no index reachable; the stand-in wheel is no wheel
    either) after the series' wheel was copied. The output appears only
    when complete; a complete one from before stays as it was; a folder
    that is no wheelhouse is not deleted."""
    dist = fake_repo.root / "dist"
    (fake_repo.root / "tests").mkdir()
    (fake_repo.root / "tests/requirements.txt").write_text("numpy\n")
    env = fake_repo.env(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1",  # no index reachable
                        WHEELHOUSE_SKIP=skip)

    def wheelhouse() -> subprocess.CompletedProcess:
        return subprocess.run(["make", "wheelhouse"], cwd=fake_repo.root, env=env, text=True,
                              capture_output=True, timeout=300)

    result = wheelhouse()
    assert result.returncode != 0 and "ERROR" in result.stderr, result.stderr
    assert sorted(p.name for p in dist.iterdir()) == [OLD_WHEEL, OLD_WHEEL + ".mode"]
    complete = dist / "wheelhouse"
    complete.mkdir()
    (complete / "old.whl").write_text("old\n")
    (complete / "MANIFEST.txt").write_text("MANIFEST.txt\nold.whl\n")
    assert wheelhouse().returncode != 0
    assert sorted(p.name for p in complete.iterdir()) == ["MANIFEST.txt", "old.whl"]
    assert not (dist / "wheelhouse.partial").exists()
    (complete / "MANIFEST.txt").unlink()
    result = wheelhouse()
    assert result.returncode == 2
    assert "exists and is no complete wheelhouse (no MANIFEST.txt)" in result.stderr
    assert (complete / "old.whl").read_text() == "old\n"
