# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's CUDA platform on a machine without a GPU, for the CPU tests that
select attention backends (tests/backend) and load GGUF files (tests/gguf)
as on CUDA."""

import importlib
import sys
import types

from vllm.v1.attention.backends.registry import AttentionBackendEnum


def _import_cuda_platform():
    """vllm.platforms.cuda imports the compiled extensions for their op
    registrations only; without a CUDA driver they cannot load, and selection
    needs none of their ops, so stand-ins are used there."""
    try:
        return importlib.import_module("vllm.platforms.cuda")
    except ImportError:
        pass
    stubs = []
    for name in ("vllm._C", "vllm._C_stable_libtorch"):
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)
            stubs.append(name)
    sys.modules.pop("vllm.platforms.cuda", None)
    try:
        return importlib.import_module("vllm.platforms.cuda")
    finally:
        # Other tests of the session must still see the extensions missing.
        for name in stubs:
            del sys.modules[name]


cuda_platform_mod = _import_cuda_platform()
CudaPlatform = cuda_platform_mod.CudaPlatform

_original_get_class = AttentionBackendEnum.get_class


def get_class_without_gpu(self):
    """AttentionBackendEnum.get_class where no GPU is: some backend modules
    allocate CUDA buffers at import time (e.g. flashinfer_mla), which raises
    RuntimeError; the selector then treats the backend as not importable, as
    it does for ImportError."""
    try:
        return _original_get_class(self)
    except RuntimeError as e:
        raise ImportError(str(e)) from e
