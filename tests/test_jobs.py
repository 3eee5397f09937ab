"""MAX_JOBS / NVCC_THREADS for BUILD_MODE=source (formula in patchseries/jobs.py)."""

import pytest

from patchseries.jobs import GIB_PER_THREAD, build_jobs


@pytest.mark.parametrize("cores, mem_gib, expected", [
    (2, 24, (2, 1)),        # CI machine: cores bound
    (16, 32, (6, 1)),       # workstation with little RAM: memory bound
    (32, 256, (16, 2)),     # cores bound, two nvcc threads per job
    (128, 256, (27, 2)),    # 128 cores must not mean 128 jobs
    (128, 1024, (64, 2)),
    (8, 3, (1, 1)),         # never below one job
    (1, 0.5, (1, 1)),
])
def test_formula(cores, mem_gib, expected):
    assert build_jobs(cores, mem_gib) == expected


@pytest.mark.parametrize("cores", [1, 2, 8, 64, 128, 256])
@pytest.mark.parametrize("mem_gib", [8, 24, 64, 256, 1024])
def test_never_oversubscribes(cores, mem_gib):
    jobs, threads = build_jobs(cores, mem_gib)
    assert jobs >= 1 and threads >= 1
    assert jobs * threads <= max(1, cores)
    assert jobs * threads * GIB_PER_THREAD <= max(GIB_PER_THREAD, 0.85 * mem_gib)


def test_environment_overrides(monkeypatch):
    from patchseries.jobs import jobs_from_environment

    monkeypatch.setenv("MAX_JOBS", "3")
    monkeypatch.setenv("NVCC_THREADS", "5")
    assert jobs_from_environment() == (3, 5)
