# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""SM120's occupancy on a bigger GPU: one CTA of the Triton sparse MLA
kernel per SM.

SM120 has 100 KB of shared memory per SM and every SM12x config takes more
than half of it, so an SM120 SM holds one CTA. On an H200 (228 KB per SM)
two fit. Launching the kernel with 116 KB of dynamic shared memory (it uses
at most 99 KB) leaves room for one. This patches Triton 3.6's launch
metadata of the compiled kernels; bench scripts only.
"""

import contextlib
import ctypes

import torch
from vllm.v1.attention.ops import triton_sparse_mla as tsm

ONE_CTA_SHARED = 116 * 1024
SM120_SHARED_PER_SM = 102400  # what auto_config is told for these rows


def shared_per_sm(one_cta: bool) -> int:
    """Shared memory per SM that auto_config should be told: SM120's with
    one CTA per SM, this GPU's otherwise."""
    if one_cta:
        return SM120_SHARED_PER_SM
    return torch.cuda.get_device_properties(0).shared_memory_per_multiprocessor


def available() -> bool:
    """Whether this GPU and Triton can emulate it: one pinned CTA must fit
    a block, two must not fit an SM."""
    if not hasattr(tsm._sparse_mla_fwd_kernel, "device_caches"):
        return False
    p = torch.cuda.get_device_properties(0)
    per_cta = ONE_CTA_SHARED + 1024  # the driver reserves 1 KB per CTA
    return (
        p.shared_memory_per_block_optin >= ONE_CTA_SHARED
        and 2 * per_cta > p.shared_memory_per_multiprocessor
    )


def _allow_dynamic_shared(function: int, nbytes: int) -> None:
    """Triton raises a kernel's dynamic shared-memory limit only when it
    needs more than 48 KB; a smaller kernel launched with more must be
    allowed it (cuFuncSetAttribute, MAX_DYNAMIC_SHARED_SIZE_BYTES)."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    err = libcuda.cuFuncSetAttribute(ctypes.c_void_p(function), 8, ctypes.c_int(nbytes))
    if err != 0:
        raise RuntimeError(f"cuFuncSetAttribute failed: CUresult {err}")


@contextlib.contextmanager
def one_cta_per_sm():
    """Launch the Triton kernel's compiled variants with enough dynamic
    shared memory that an SM holds one CTA (a CUDA graph captured inside
    keeps it); restored on exit."""
    saved = []
    for cache in tsm._sparse_mla_fwd_kernel.device_caches.values():
        for kernel in cache[0].values():
            kernel._init_handles()
            warps, ctas, shared = kernel.packed_metadata
            saved.append((kernel, kernel.packed_metadata))
            if shared < ONE_CTA_SHARED:
                _allow_dynamic_shared(kernel.function, ONE_CTA_SHARED)
                kernel.packed_metadata = (warps, ctas, ONE_CTA_SHARED)
    try:
        yield
    finally:
        for kernel, meta in saved:
            kernel.packed_metadata = meta
