"""Parallelism for BUILD_MODE=source: how many nvcc threads the machine can hold.

One nvcc thread compiling vLLM's CUTLASS/FlashAttention units peaks at a few
GiB, so running one job per core runs a 128-core machine out of memory long
before it runs out of cores. The budget:

    threads      = min(cores, floor(0.85 * available_GiB / GIB_PER_THREAD)), at least 1
    NVCC_THREADS = 2 if threads >= 8 else 1

vLLM's setup.py (cmake_build_ext.compute_num_jobs) runs MAX_JOBS // NVCC_THREADS
compile jobs (at least 1) of NVCC_THREADS threads each: MAX_JOBS is the thread
budget, not the job count. So the build is given

    MAX_JOBS     = threads rounded down to a multiple of NVCC_THREADS

and runs MAX_JOBS // NVCC_THREADS jobs x NVCC_THREADS threads, which never
exceeds the cores nor 85 % of memory at GIB_PER_THREAD each. MAX_JOBS and
NVCC_THREADS in the environment override either value with vLLM's meaning.
tests/test_jobs.py runs the pinned release's compute_num_jobs to check that
its rule is still setup_py_jobs below.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

from . import SeriesError

GIB_PER_THREAD = 4.0
MEMORY_FRACTION = 0.85


class Parallelism(NamedTuple):
    max_jobs: int      # MAX_JOBS given to vLLM's setup.py
    nvcc_threads: int  # NVCC_THREADS
    jobs: int          # nvcc processes setup.py then runs at once


def setup_py_jobs(max_jobs: int, nvcc_threads: int) -> int:
    """Compile jobs that vLLM's setup.py runs for MAX_JOBS and NVCC_THREADS."""
    return max(1, max_jobs // nvcc_threads)


def _parallelism(max_jobs: int, nvcc_threads: int) -> Parallelism:
    return Parallelism(max_jobs, nvcc_threads, setup_py_jobs(max_jobs, nvcc_threads))


def thread_budget(cores: int, mem_gib: float) -> int:
    """nvcc threads that `cores` CPUs and `mem_gib` free memory hold at once."""
    return max(1, min(cores, int(MEMORY_FRACTION * mem_gib // GIB_PER_THREAD)))


def _split(threads: int, nvcc_threads: int | None = None) -> Parallelism:
    """A budget of `threads` as MAX_JOBS / NVCC_THREADS (2 per job from 8 threads up)."""
    nvcc_threads = nvcc_threads or (2 if threads >= 8 else 1)
    return _parallelism(max(nvcc_threads, threads // nvcc_threads * nvcc_threads), nvcc_threads)


def build_jobs(cores: int, mem_gib: float) -> Parallelism:
    """The parallelism for `cores` CPUs and `mem_gib` free memory."""
    return _split(thread_budget(cores, mem_gib))


def available_cores() -> int:
    cores = len(os.sched_getaffinity(0))
    try:  # cgroup v2 CPU quota, e.g. "200000 100000" = 2 CPUs
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cores


def available_memory_gib() -> float:
    mem = 0.0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            mem = int(line.split()[1]) / 2**20
    try:  # cgroup v2 memory limit
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            mem = min(mem, int(limit) / 2**30)
    except (OSError, ValueError):
        pass
    return mem


def _env_count(name: str, meaning: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
        raise SeriesError(f"{name}={os.environ[name]!r}: expected a whole number of at least 1 "
                          f"({meaning}); unset it to use the default for this machine")
    return int(value)


def jobs_from_environment() -> Parallelism:
    max_jobs = _env_count("MAX_JOBS", "the nvcc threads the build may run at once")
    nvcc_threads = _env_count("NVCC_THREADS", "the threads of each nvcc job")
    if max_jobs is not None:  # as given: vLLM's setup.py does the division
        return _parallelism(max_jobs, nvcc_threads or (2 if max_jobs >= 8 else 1))
    return _split(thread_budget(available_cores(), available_memory_gib()), nvcc_threads)
