# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashMLA sparse prefill from the pinned wheel, as the GPU tests' peer."""

import os

import torch


def load_flashmla_sparse():
    """(op, None) or (None, why-not). ``op(q, kv, indices, sm_scale, d_v)``
    returns FlashMLA's (out, max_logits, lse). The library comes from
    ``FLASHMLA_SO`` (a machine without the wheel installed) or the wheel."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (
        9,
        10,
    ):
        return None, "FlashMLA sparse runs on SM90/SM100 only"
    so = os.environ.get("FLASHMLA_SO")
    try:
        if so:
            torch.ops.load_library(so)
        else:
            import vllm._flashmla_C  # noqa: F401
        raw = torch.ops._flashmla_C.sparse_prefill_fwd
    except (ImportError, OSError, AttributeError, RuntimeError) as e:
        return None, f"FlashMLA sparse not loadable (set FLASHMLA_SO): {e!r}"
    # (q, kv, indices, sm_scale, d_v[, attn_sink, topk_length[, out]])
    extra = len(raw.default._schema.arguments) - 5

    def op(q, kv, indices, sm_scale, d_v):
        return raw(q, kv, indices, sm_scale, d_v, *([None] * extra))[:3]

    return op, None
