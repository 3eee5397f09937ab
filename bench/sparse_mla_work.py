# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The sparse MLA problem that bench_sparse_mla.py times and render.py
plots: its geometry and the work of one call (no torch, so the renderer
runs without it)."""

D_QK, D_V, TOPK = 576, 512, 2048


def work(s_q: int, h_q: int, elt: int) -> tuple[int, int]:
    """(FLOPs, bytes) of one call: q.k and p.v over the gathered rows; the
    gathered rows plus q read and the output written, ``elt`` bytes each."""
    flops = 2 * s_q * h_q * TOPK * (D_QK + D_V)
    nbytes = s_q * TOPK * D_QK * elt + s_q * h_q * (D_QK + D_V) * elt
    return flops, nbytes
