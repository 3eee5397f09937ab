# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Test support shared by the tests and the benchmarks: fp64 references
and the loaders of the peer kernels (FlashMLA, DeepGEMM).

Imported as ``support``: pytest puts ``tests/`` on ``sys.path`` (the
``pythonpath`` of pyproject.toml), bench scripts do so through
``bench/harness.py``.
"""
