"""MAX_JOBS / NVCC_THREADS for BUILD_MODE=source (patchseries/jobs.py), checked
against the rule in the pinned vLLM release's own setup.py."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tarfile
from types import SimpleNamespace

import pytest
from packaging.version import Version

from patchseries import SeriesError, jobs
from patchseries.fetch import fetch_file
from patchseries.jobs import GIB_PER_THREAD, build_jobs, jobs_from_environment, setup_py_jobs
from patchseries.pin import load_pin


@pytest.fixture(scope="module")
def pinned_rule():
    """cmake_build_ext.compute_num_jobs of the pinned sdist's setup.py, run as
    setup.py runs it with a CUDA 13 nvcc: (MAX_JOBS, NVCC_THREADS) -> (jobs, threads)."""
    pin = load_pin()
    sdist = fetch_file("vllm", pin.sdist, pin.sdist_sha256)
    name = f"vllm-{pin.version}/setup.py"
    with tarfile.open(sdist) as tar:
        source = tar.extractfile(name).read().decode()
    methods = [node for cls in ast.parse(source).body
               if isinstance(cls, ast.ClassDef) and cls.name == "cmake_build_ext"
               for node in cls.body
               if isinstance(node, ast.FunctionDef) and node.name == "compute_num_jobs"]
    assert methods, (f"{pin.sdist}: {name} has no cmake_build_ext.compute_num_jobs; see how it "
                     "now derives the compile jobs from MAX_JOBS/NVCC_THREADS and update "
                     "patchseries/jobs.py (setup_py_jobs) and this test")
    code = compile(ast.Module(body=methods, type_ignores=[]), f"{sdist.name}:{name}", "exec")

    def run(max_jobs: int | None, nvcc_threads: int | None) -> tuple[int, int]:
        complaints: list[str] = []

        def complain(msg, *args):
            complaints.append(msg % args)

        namespace = {
            "envs": SimpleNamespace(
                MAX_JOBS=None if max_jobs is None else str(max_jobs),
                NVCC_THREADS=None if nvcc_threads is None else str(nvcc_threads)),
            "os": os, "Version": Version, "CUDA_HOME": "/usr/local/cuda",
            "_is_cuda": lambda: True, "get_nvcc_cuda_version": lambda: Version("13.0"),
            "logger": SimpleNamespace(info=lambda *a: None, warning=complain),
        }
        exec(code, namespace)
        result = namespace["compute_num_jobs"](None)
        assert not complaints, f"{name}'s compute_num_jobs failed: {complaints}"
        return result

    return run


@pytest.mark.parametrize("max_jobs", [1, 2, 3, 7, 8, 12, 13, 64, 128])
@pytest.mark.parametrize("nvcc_threads", [1, 2, 3, 4])
def test_rule_is_the_pinned_setup_py(pinned_rule, max_jobs, nvcc_threads):
    """setup_py_jobs must be what the pinned release does; after a rebase to a
    vLLM with another rule this fails instead of the build running at a
    silently different parallelism."""
    assert pinned_rule(max_jobs, nvcc_threads) == (setup_py_jobs(max_jobs, nvcc_threads),
                                                   nvcc_threads)


@pytest.mark.parametrize("cores, mem_gib, expected_jobs, expected_threads", [
    (2, 24, 2, 1),        # CI machine: cores bound
    (16, 32, 6, 1),       # workstation with little RAM: memory bound
    (32, 256, 16, 2),     # cores bound, two nvcc threads per job
    (128, 64, 6, 2),      # the machine: 13 threads -> 6 x 2, not 3 x 2
    (128, 256, 27, 2),    # 128 cores must not mean 128 jobs
    (128, 1024, 64, 2),
    (8, 3, 1, 1),         # never below one job
    (1, 0.5, 1, 1),
])
def test_pinned_setup_py_runs_the_intended_threads(pinned_rule, cores, mem_gib,
                                                  expected_jobs, expected_threads):
    max_jobs, nvcc_threads = build_jobs(cores, mem_gib)[:2]  # what build.sh exports
    assert pinned_rule(max_jobs, nvcc_threads) == (expected_jobs, expected_threads)


@pytest.mark.parametrize("cores", [1, 2, 8, 64, 128, 256])
@pytest.mark.parametrize("mem_gib", [8, 24, 64, 256, 1024])
def test_never_oversubscribes(pinned_rule, cores, mem_gib):
    max_jobs, nvcc_threads, planned = build_jobs(cores, mem_gib)
    running, threads = pinned_rule(max_jobs, nvcc_threads)
    assert running == planned >= 1 and threads >= 1
    assert running * threads <= max(1, cores)
    assert running * threads * GIB_PER_THREAD <= max(GIB_PER_THREAD, 0.85 * mem_gib)


@pytest.fixture
def machine(monkeypatch):
    """128 cores, 64 GiB free: a budget of 13 nvcc threads."""
    monkeypatch.setattr(jobs, "available_cores", lambda: 128)
    monkeypatch.setattr(jobs, "available_memory_gib", lambda: 64.0)
    monkeypatch.delenv("MAX_JOBS", raising=False)
    monkeypatch.delenv("NVCC_THREADS", raising=False)
    return monkeypatch


@pytest.mark.parametrize("env, expected", [
    ({}, (12, 2, 6)),
    ({"MAX_JOBS": "", "NVCC_THREADS": " "}, (12, 2, 6)),  # empty: the default
    ({"MAX_JOBS": "3", "NVCC_THREADS": "5"}, (3, 5, 1)),   # vLLM's meaning, passed as given
    ({"MAX_JOBS": "16"}, (16, 2, 8)),
    ({"MAX_JOBS": "4"}, (4, 1, 4)),
    ({"NVCC_THREADS": "4"}, (12, 4, 3)),
    ({"NVCC_THREADS": "1"}, (13, 1, 13)),
])
def test_environment_overrides(machine, env, expected):
    for key, value in env.items():
        machine.setenv(key, value)
    assert jobs_from_environment() == expected


@pytest.mark.parametrize("name", ["MAX_JOBS", "NVCC_THREADS"])
@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5", "4x"])
def test_bad_environment_is_a_message(machine, name, value):
    machine.setenv(name, value)
    with pytest.raises(SeriesError,
                       match=f"{name}='{value}': expected a whole number of at least 1"):
        jobs_from_environment()


def test_series_jobs_command_reports_not_traceback(repo):
    env = {**os.environ, "MAX_JOBS": "abc"}
    result = subprocess.run([sys.executable, str(repo / "scripts/series.py"), "jobs"],
                            capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "error: MAX_JOBS='abc': expected a whole number" in result.stderr
