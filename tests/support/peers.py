# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The peer kernels the series is compared with, as the pinned wheel ships
them: FlashMLA sparse prefill and DeepGEMM's MQA logits. Both run on
SM90/SM100 only. Each loader returns ``(peer, None)`` or ``(None, why)``,
so a test can skip and a benchmark go on with the reason."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

PEER_MAJORS = (9, 10)


def _why_not_here(what: str) -> str | None:
    if not torch.cuda.is_available():
        return f"{what} needs a CUDA GPU"
    major = torch.cuda.get_device_capability()[0]
    if major not in PEER_MAJORS:
        return f"{what} runs on SM90/SM100 only (this GPU: SM{major}x)"
    return None


def load_flashmla_sparse(so: str | None = None) -> tuple[Callable | None, str | None]:
    """FlashMLA's ``sparse_prefill_fwd``: ``op(q, kv, indices, sm_scale,
    d_v)`` returns its ``(out, max_logits, lse)``. The library is ``so``,
    else ``$FLASHMLA_SO`` (a machine without the wheel installed), else the
    installed wheel's ``vllm._flashmla_C``."""
    why = _why_not_here("FlashMLA sparse")
    if why:
        return None, why
    so = so or os.environ.get("FLASHMLA_SO")
    try:
        if so:
            torch.ops.load_library(so)
        else:
            import vllm._flashmla_C  # noqa: F401
        raw = torch.ops._flashmla_C.sparse_prefill_fwd
        n_args = len(raw.default._schema.arguments)
    except (ImportError, OSError, AttributeError, RuntimeError) as e:
        return None, f"FlashMLA sparse not loadable (so={so!r}; set FLASHMLA_SO): {e!r}"
    # (q, kv, indices, sm_scale, d_v[, attn_sink, topk_length[, out]])
    extra = n_args - 5

    def op(q, kv, indices, sm_scale, d_v):
        return raw(q, kv, indices, sm_scale, d_v, *([None] * extra))[:3]

    return op, None


def load_deep_gemm(folder: str | None = None) -> tuple[Any | None, str | None]:
    """DeepGEMM: the ``deep_gemm`` package in ``folder`` (e.g. the wheel's
    ``vllm/third_party``), else ``deep_gemm`` on the path, else
    ``vllm.third_party.deep_gemm``. Its JIT cache defaults to a temporary
    folder (``DG_JIT_CACHE_DIR``)."""
    why = _why_not_here("DeepGEMM MQA logits")
    if why:
        return None, why
    os.environ.setdefault(
        "DG_JIT_CACHE_DIR", os.path.join(tempfile.gettempdir(), "dg_jit_cache")
    )
    errs = []
    if folder:
        package = os.path.join(folder, "deep_gemm")
        if not os.path.isdir(package):
            return None, f"DeepGEMM: {folder} holds no deep_gemm package"
        try:
            return _import_package("deep_gemm", package), None
        except (ImportError, OSError, RuntimeError) as e:  # or its .so failing
            errs.append(f"deep_gemm from {folder}: {e!r}")
    # A folder's deep_gemm stands where deep_gemm on the path would.
    for name in ("deep_gemm", "vllm.third_party.deep_gemm")[bool(folder):]:
        try:
            return __import__(name, fromlist=["fp8_fp4_mqa_logits"]), None
        except (ImportError, OSError, RuntimeError) as e:  # or its .so failing
            errs.append(f"{name}: {e!r}")
    return None, "DeepGEMM not importable: " + "; ".join(errs)


def _import_package(name: str, folder: str):
    """The package in folder, imported as `name` (its modules import each
    other relatively), without putting folder's other packages on the path."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
