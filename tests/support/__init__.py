# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Test support shared by the tests and the benchmarks: fp64 references,
the loaders of the peer kernels (FlashMLA, DeepGEMM), vLLM's CUDA platform
without a GPU, the tiny checkpoints' writer and llama.cpp's converter run.

Imported as ``support``: pytest puts ``tests/`` on ``sys.path`` (the
``pythonpath`` of pyproject.toml); scripts that use it (the benchmarks,
tests/e2e/models.py) run with ``tests/`` on PYTHONPATH (scripts/run-bench.sh,
the Makefile).
"""
