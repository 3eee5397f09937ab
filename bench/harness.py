# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the bench scripts share: GPU timing, sparse MLA inputs and the
measured ceilings. A helper module (imported, never run).

The scripts that use the test support package (``support``: fp64
references, FlashMLA and DeepGEMM loaders) as the tests do run with
``tests/`` on PYTHONPATH (scripts/run-bench.sh sets it; by hand,
``PYTHONPATH=tests python bench/<script>.py``).

Times: the calls over several input sets (rotated so that one pass gathers
>= 200 MB) are captured in one CUDA graph and replayed under
triton.testing.do_bench (median; L2 flushed before each replay); time per
call = replay time / number of sets. Host launch overhead is thus excluded,
as in vLLM's CUDA-graph decode.
"""

import contextlib

import torch
import triton
import triton.testing

from sm120_occupancy import one_cta_per_sm
from sparse_mla_work import D_QK, TOPK

SCALE = D_QK**-0.5
POOL = 262144  # cache rows: 302 MB in bf16, ~6x the H200's L2

# Set by a script to only compile what it would time (fills Triton's cache
# for the timed run); timed() then returns 1.0.
WARM_ONLY = False


def unique_indices(s_q, s_kv, topk, gen):
    """[s_q, 1, topk] int32, unique per row (as the indexer's top-k): one
    random set, shifted per row."""
    perm = torch.randperm(s_kv, device="cuda", generator=gen)[:topk]
    shift = torch.randint(0, s_kv, (s_q, 1), device="cuda", generator=gen)
    return ((perm[None] + shift) % s_kv).to(torch.int32)[:, None, :].contiguous()


def input_sets(s_q, h_q, dtype, gen, n_sets):
    """``n_sets`` (q, indices) pairs into a POOL-row cache."""
    return [
        (
            torch.randn(s_q, h_q, D_QK, device="cuda", generator=gen).to(dtype),
            unique_indices(s_q, POOL, TOPK, gen),
        )
        for _ in range(n_sets)
    ]


def n_rotate(s_q):
    """Enough sets that one replay gathers >= ~200 MB (4x the H200's L2)."""
    return max(2, min(64, -(-200_000_000 // (s_q * TOPK * D_QK * 2))))


def timed(fn, sets, one_cta=False):
    """Median ms of one call ``fn(*set)``. The calls over all input sets are
    captured in one CUDA graph (as vLLM runs decode), so host launch
    overhead is out of the number; do_bench flushes L2 before each replay.
    ``one_cta``: one CTA of the Triton kernel per SM, as on SM120
    (sm120_occupancy)."""
    if WARM_ONLY:
        fn(*sets[0])
        return 1.0
    for a in sets:
        fn(*a)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    pinned = one_cta_per_sm() if one_cta else contextlib.nullcontext()
    with pinned, torch.cuda.graph(g):
        for a in sets:
            fn(*a)
    ms = triton.testing.do_bench(g.replay, warmup=5, rep=40, return_mode="median")
    return ms / len(sets)


def _copy_bandwidth():
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    t = triton.testing.do_bench(
        lambda: y.copy_(x), warmup=20, rep=100, return_mode="median"
    )
    return 2 * x.numel() * 2 / (t * 1e-3)  # bytes read + written


def ceilings():
    """(copy bandwidth in B/s, read + write; bf16 matmul rate in FLOP/s),
    measured now."""
    copy_bw = _copy_bandwidth()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = triton.testing.do_bench(lambda: a @ b, warmup=20, rep=100, return_mode="median")
    return copy_bw, 2 * 8192**3 / (t * 1e-3)
