# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A fused MoE for GGUF routed experts that reads the quantized blocks
itself (Q4_K, Q6_K, Q8_0): the candidate for prefill-size batches where
the series' float path first writes every expert in fp16
(bench/bench_gguf_gemm.py times the two side by side). A helper module of
the bench, not part of the series until it is measured faster.

The float path's floor is writing the fp16 experts (2.4 GB for one GLM-5
TP-8 layer, ~0.7 ms at the H200's bandwidth) before the GEMMs read them
again. Here each program of the grouped GEMM decodes the 32-value chunks
of its weight tile from the GGUF blocks in registers, as ggml's dequantizer
computes them (fp32, rounded once to the activation dtype), and multiplies
them on the tensor cores: the experts are read once, at 4.5–8.5 bits a
value, and never written.

Layout: the weights as vLLM's GGUF MoE keeps them, ``[E, N, K / QK * BYTES]``
uint8 (each row its blocks, as in the file; w13 is gate then up). Rows of
K a multiple of 256 (every type here then tiles into 32-value chunks
within one block).

One launch per GEMM, like vLLM's fused_moe: the (token, slot) rows sorted
by expert and padded to BLOCK_M per expert; a program computes BLOCK_M rows
of one expert by BLOCK_N outputs. SiLU(gate) * up and the sum over the
top-k run as torch ops between and after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T
from gguf_triton_dequant import _f16_at

# type -> (values per block, bytes per block)
LAYOUT = {T.Q8_0: (32, 34), T.Q4_K: (256, 144), T.Q6_K: (256, 210)}
# the rows' unit: 256 values (one K-quant block, eight Q8_0 blocks)
SUPER = 256

# allocations of the intermediate buffers (tests fill them with NaN)
_empty = torch.empty


@triton.jit
def _weights(rows, s, j, lane, ok, QTYPE: tl.constexpr, SUPER_BYTES: tl.constexpr):
    """Values 32 j .. 32 j + 31 of superblock s (256 values) of each weight
    row: [BLOCK_N, 32] fp32, as ggml's dequantizer computes them. ``rows``:
    [BLOCK_N, 1] pointers to each row's first block; ``lane``: [1, 32], a
    row's contiguous bytes."""
    blk = rows + s * SUPER_BYTES
    if QTYPE == 8:  # eight Q8_0 blocks: d (fp16), qs[32] (int8)
        d = _f16_at(blk, 34 * j, ok)
        q = tl.load(blk + 34 * j + 2 + lane, mask=ok, other=0)
        w = d * q.to(tl.int8, bitcast=True).to(tl.float32)
    elif QTYPE == 12:
        # Q4_K: d, dmin, scales[12] (6-bit scale and min of each sub-block),
        # qs[128]: sub-blocks 2c, 2c + 1 the low, high nibbles of qs[32c:][:32]
        d = _f16_at(blk, 0, ok)
        dmin = _f16_at(blk, 2, ok)
        qb = tl.load(blk + 16 + 32 * (j // 2) + lane, mask=ok, other=0)
        q = ((qb >> (4 * (j % 2))) & 0xF).to(tl.float32)
        # get_scale_min_k4: scales[j], scales[j + 4] and, from sub-block 4
        # on, the top bits of scales[j - 4]
        s_j = tl.load(blk + 4 + j, mask=ok, other=0)
        s_j4 = tl.load(blk + 8 + j, mask=ok, other=0)
        s_jm4 = tl.load(blk + j, mask=ok, other=0)
        sc = tl.where(j < 4, s_j & 63, (s_j4 & 0xF) | ((s_jm4 >> 6) << 4))
        m = tl.where(j < 4, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
        w = (d * sc.to(tl.float32)) * q - dmin * m.to(tl.float32)
    else:
        # Q6_K: ql[128], qh[64], scales[16] (int8, one per 16 values), d.
        # Half t (128 values) takes ql[64t:][:64] and qh[32t:][:32]; its
        # quarter u the low (u < 2) or high nibbles of ql[64t + 32 (u % 2):][:32]
        # and bits 2u, 2u + 1 of qh
        t = j // 4
        u = j % 4
        ql = tl.load(blk + 64 * t + 32 * (u % 2) + lane, mask=ok, other=0)
        qh = tl.load(blk + 128 + 32 * t + lane, mask=ok, other=0)
        q = ((ql >> (4 * (u // 2))) & 0xF) | (((qh >> (2 * u)) & 3) << 4)
        sc = tl.load(blk + 192 + 8 * t + 2 * u + lane // 16, mask=ok, other=0)
        d = _f16_at(blk, 208, ok)
        w = (d * sc.to(tl.int8, bitcast=True).to(tl.float32)) * (q.to(tl.float32) - 32.0)
    return w


@triton.jit
def _gguf_moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr,
    num_padded, num_rows, N, K,
    stride_am, stride_be, stride_bn, stride_cm,
    A_ROWS_PER_TOKEN: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    QTYPE: tl.constexpr, SUPER_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    """c[r] (= c[r] * weights[r] with MUL_WEIGHT) = a[r // A_ROWS_PER_TOKEN]
    @ W[e].T for the rows r of sorted_ids, e the expert of r's block; rows
    >= num_rows are padding."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_padded, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # groups of GROUP_M row blocks share their weight tiles in L2
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ids_ptr + offs_m)
    row_ok = rows < num_rows
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    a_rows = a_ptr + (rows // A_ROWS_PER_TOKEN).to(tl.int64)[:, None] * stride_am
    # [BLOCK_N, 1]: each weight row's bytes run along a chunk's 32 lanes
    b_rows = b_ptr + expert * stride_be + offs_n.to(tl.int64)[:, None] * stride_bn
    lane = tl.arange(0, 32)[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # one 32-value chunk an iteration: one sub-block of a K-quant block,
    # one Q8_0 block
    for kc in range(0, K // 32):
        a = tl.load(a_rows + 32 * kc + lane, mask=row_ok[:, None], other=0.0)
        w = _weights(b_rows, kc // 8, kc % 8, lane, n_ok[:, None], QTYPE, SUPER_BYTES)
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + rows, mask=row_ok, other=0.0)[:, None]
    c = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def supported(qtype: int) -> bool:
    return qtype in LAYOUT


def align(topk_ids: torch.Tensor, block_m: int, num_experts: int
          ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The (token, slot) rows of ``topk_ids`` ([tokens, top_k]) sorted by
    expert, each expert's padded to a multiple of ``block_m`` with the row
    count as the padding id: (sorted ids int32, the expert of each block
    int32, padded length)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    if n and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"topk_ids must lie in [0, {num_experts}), found "
                         f"{int(flat.min())}..{int(flat.max())}")
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = padded.cumsum(0) - padded
    total = int(padded.sum())
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first = counts.cumsum(0) - counts
    pos = starts[sorted_experts] + torch.arange(n, device=flat.device) - first[sorted_experts]
    sorted_ids = torch.full((total,), n, dtype=torch.int32, device=flat.device)
    sorted_ids[pos] = order.to(torch.int32)
    expert_ids = torch.repeat_interleave(
        torch.arange(num_experts, dtype=torch.int32, device=flat.device), padded // block_m)
    return sorted_ids, expert_ids, total


def _check(w: torch.Tensor, qtype: int, rows: int | None, cols: int, what: str) -> None:
    if qtype not in LAYOUT:
        raise ValueError(f"{what}: GGUF type {T(qtype).name} has no fused kernel here "
                         f"(supported: {', '.join(t.name for t in LAYOUT)})")
    qk, size = LAYOUT[T(qtype)]
    if cols % SUPER:
        raise ValueError(f"{what}: rows of {cols} values, a multiple of {SUPER} expected")
    want = cols // qk * size
    if w.dtype != torch.uint8 or w.dim() != 3 or w.shape[2] != want or (
            rows is not None and w.shape[1] != rows):
        raise ValueError(f"{what}: [experts, {rows or 'rows'}, {want}] uint8 blocks of "
                         f"{T(qtype).name} expected, found {tuple(w.shape)} {w.dtype}")


def _gemm(a, w, qtype, sorted_ids, expert_ids, num_padded, num_rows, out, weights,
          rows_per_token, block_m, block_n, group_m, num_warps, num_stages):
    n, k = out.shape[1], a.shape[1]
    qk, size = LAYOUT[T(qtype)]
    w = w.contiguous()
    grid = (triton.cdiv(num_padded, block_m) * triton.cdiv(n, block_n),)
    _gguf_moe_gemm_kernel[grid](
        a, w, out, weights if weights is not None else out, sorted_ids, expert_ids,
        num_padded, num_rows, n, k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROWS_PER_TOKEN=rows_per_token, MUL_WEIGHT=weights is not None,
        QTYPE=int(qtype), SUPER_BYTES=SUPER // qk * size,
        BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=group_m,
        num_warps=num_warps, num_stages=num_stages)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w13_type: int, w2: torch.Tensor,
              w2_type: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              block_m: int | None = None, block_n: int = 64, group_m: int = 8,
              num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """sum_j topk_weights[t, j] * W2[e] @ (SiLU(G[e] @ x[t]) * (U[e] @ x[t]))
    over e = topk_ids[t, j]; w13 ``[E, 2I, H/QK*BYTES]`` (gate rows, then
    up), w2 ``[E, H, I/QK*BYTES]``, GGUF blocks. Returns ``[tokens, H]`` in
    x's dtype."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    experts = w13.shape[0]
    _check(w13, w13_type, None, hidden, "w13")
    inter = w13.shape[1] // 2
    _check(w2, w2_type, hidden, inter, "w2")
    if w13.shape[1] % 2 or w2.shape[0] != experts:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not pair")
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids "
                         f"{tuple(topk_ids.shape)} for {tokens} tokens")
    if tokens == 0:
        return x.new_zeros((0, hidden))
    block_m = block_m or (16 if tokens * top_k <= 4 * experts else 64)
    sorted_ids, expert_ids, num_padded = align(topk_ids, block_m, experts)
    rows = tokens * top_k
    x = x.contiguous()
    common = dict(block_m=block_m, block_n=block_n, group_m=group_m,
                  num_warps=num_warps, num_stages=num_stages)
    h13 = _empty((rows, 2 * inter), dtype=x.dtype, device=x.device)
    _gemm(x, w13, w13_type, sorted_ids, expert_ids, num_padded, rows, h13, None, top_k,
          **common)
    # as vLLM's silu_and_mul: fp32, rounded once
    act = (F.silu(h13[:, :inter].float()) * h13[:, inter:].float()).to(x.dtype)
    y = _empty((rows, hidden), dtype=x.dtype, device=x.device)
    _gemm(act, w2, w2_type, sorted_ids, expert_ids, num_padded, rows, y,
          topk_weights.reshape(-1).float().contiguous(), 1, **common)
    return y.view(tokens, top_k, hidden).sum(dim=1)
