"""Parallelism for BUILD_MODE=source: how many nvcc jobs the machine can hold.

One nvcc thread compiling vLLM's CUTLASS/FlashAttention units peaks at a few
GiB, so running one job per core runs a 128-core machine out of memory long
before it runs out of cores. The formula:

    threads      = min(cores, floor(0.85 * available_GiB / GIB_PER_THREAD)), at least 1
    NVCC_THREADS = 2 if threads >= 8 else 1
    MAX_JOBS     = max(1, threads // NVCC_THREADS)

so MAX_JOBS * NVCC_THREADS never exceeds the cores nor 85 % of memory at
GIB_PER_THREAD each. MAX_JOBS / NVCC_THREADS in the environment override it.
"""

from __future__ import annotations

import os
from pathlib import Path

GIB_PER_THREAD = 4.0
MEMORY_FRACTION = 0.85


def build_jobs(cores: int, mem_gib: float) -> tuple[int, int]:
    """Return (MAX_JOBS, NVCC_THREADS) for `cores` CPUs and `mem_gib` free memory."""
    threads = max(1, min(cores, int(MEMORY_FRACTION * mem_gib // GIB_PER_THREAD)))
    nvcc_threads = 2 if threads >= 8 else 1
    return max(1, threads // nvcc_threads), nvcc_threads


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


def jobs_from_environment() -> tuple[int, int]:
    max_jobs, nvcc_threads = build_jobs(available_cores(), available_memory_gib())
    return (int(os.environ.get("MAX_JOBS") or max_jobs),
            int(os.environ.get("NVCC_THREADS") or nvcc_threads))
