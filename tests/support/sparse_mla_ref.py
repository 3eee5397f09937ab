# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fp64 sparse MLA reference (written independently of the kernels),
used by the kernel tests, the end-to-end test and the benchmarks."""

from __future__ import annotations

import torch

D_V = 512


def ref_sparse_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = D_V,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp64 ``(out [s_q, h_q, d_v], max_logits [s_q, h_q], lse [s_q, h_q])``
    of sparse MLA: q ``[s_q, h_q, d_qk]``, kv ``[rows, 1, d_qk]`` (the first
    ``d_v`` values of a row are its value), indices ``[s_q, 1, topk]`` into
    kv's rows; entries < 0 or >= rows are skipped. A row without a valid
    index gives out 0, max_logits -inf, lse +inf (the kernels' convention).
    ``chunk`` tokens at a time bound the memory of the gathered rows."""
    if q.dim() != 3 or kv.dim() != 3 or indices.dim() != 3:
        raise ValueError(
            "ref_sparse_mla: expected q [s_q, h_q, d], kv [rows, 1, d], "
            f"indices [s_q, 1, topk]; found q {tuple(q.shape)}, kv "
            f"{tuple(kv.shape)}, indices {tuple(indices.shape)}"
        )
    s_q = q.shape[0]
    rows_all = kv[:, 0]
    s_kv = rows_all.shape[0]
    outs, maxes, lses = [], [], []
    for c0 in range(0, s_q, chunk):
        idx = indices[c0 : c0 + chunk, 0].long()
        valid = (idx >= 0) & (idx < s_kv)
        rows = rows_all[idx.clamp(0, s_kv - 1)].double()  # [c, topk, d_qk]
        logits = torch.einsum("chd,ctd->cht", q[c0 : c0 + chunk].double(), rows)
        logits = logits * sm_scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        has = valid.any(-1)[:, None].expand(logits.shape[:2])
        lse = torch.logsumexp(logits, -1)
        p = torch.exp(logits - torch.where(has, lse, 0.0)[..., None])
        outs.append(torch.einsum("cht,ctd->chd", p, rows[..., :d_v]))
        maxes.append(logits.amax(-1))
        lses.append(torch.where(has, lse, float("inf")))
    return torch.cat(outs), torch.cat(maxes), torch.cat(lses)
