# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A Triton dequantizer for the GGUF types of Q4_K_M files (Q4_K, Q6_K,
Q8_0): the candidate for the floor of the series' float path, which
vLLM's compiled ggml_dequantize sets (bench_gguf_gemm.py times the two side
by side). A helper module of the bench, not part of the series until it is
measured faster.

One program writes BLOCKS whole GGUF blocks; each output value gathers its
quant bits and its block's scales from the raw bytes (the rows are
contiguous blocks, as GGUF stores them), so the writes are contiguous and
the reads are one pass over the blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

# type -> (values per block, bytes per block)
LAYOUT = {T.Q8_0: (32, 34), T.Q4_K: (256, 144), T.Q6_K: (256, 210)}


@triton.jit
def _f16_at(ptr, offs, mask):
    lo = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + offs + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_kernel(src, dst, n_blocks, QTYPE: tl.constexpr, QK: tl.constexpr,
                    BYTES: tl.constexpr, BLOCKS: tl.constexpr):
    pid = tl.program_id(0)
    blk = pid * BLOCKS + tl.arange(0, BLOCKS)[:, None]  # [BLOCKS, 1]
    v = tl.arange(0, QK)[None, :]  # [1, QK]
    ok = blk < n_blocks
    base = blk.to(tl.int64) * BYTES
    if QTYPE == 8:  # Q8_0: d, qs[32] (int8)
        d = _f16_at(src, base, ok)
        q = tl.load(src + base + 2 + v, mask=ok, other=0).to(tl.int8, bitcast=True)
        y = d * q.to(tl.float32)
    elif QTYPE == 12:  # Q4_K: d, dmin, scales[12] (6-bit scales and mins), qs[128]
        d = _f16_at(src, base, ok)
        dmin = _f16_at(src, base + 2, ok)
        j = v // 32  # sub-block of 32 values
        qb = tl.load(src + base + 16 + 32 * (j // 2) + v % 32, mask=ok, other=0)
        q = ((qb >> (4 * (j % 2))) & 0xF).to(tl.float32)
        # get_scale_min_k4: sub-blocks 0-3 take 6 bits of scales[j] (scale)
        # and scales[j + 4] (min); 4-7 the nibbles of scales[j + 4] with the
        # top two bits of scales[j - 4] (scale) and of scales[j] (min)
        a = tl.load(src + base + 4 + j, mask=ok, other=0)
        b = tl.load(src + base + 8 + j, mask=ok, other=0)
        c = tl.load(src + base + 4 + tl.where(j >= 4, j - 4, j), mask=ok, other=0)
        sc = tl.where(j < 4, a & 63, (b & 0xF) | ((c >> 6) << 4))
        m = tl.where(j < 4, b & 63, (b >> 4) | ((a >> 6) << 4))
        y = d * sc.to(tl.float32) * q - dmin * m.to(tl.float32)
    else:  # Q6_K: ql[128], qh[64], scales[16] (int8), d
        d = _f16_at(src, base + 208, ok)
        h = v // 128
        r = v % 128
        quarter = r // 32
        lane = r % 32
        ql = tl.load(src + base + 64 * h + lane + 32 * (quarter % 2), mask=ok, other=0)
        qh = tl.load(src + base + 128 + 32 * h + lane, mask=ok, other=0)
        q = ((ql >> (4 * (quarter // 2))) & 0xF) | (((qh >> (2 * quarter)) & 3) << 4)
        sc = tl.load(src + base + 192 + 8 * h + lane // 16 + 2 * quarter, mask=ok, other=0)
        y = d * sc.to(tl.int8, bitcast=True).to(tl.float32) * (q.to(tl.float32) - 32.0)
    tl.store(dst + blk.to(tl.int64) * QK + v, y.to(dst.dtype.element_ty), mask=ok)


def supported(qtype: int) -> bool:
    return qtype in LAYOUT


def dequantize(qweight: torch.Tensor, qtype: int, dtype: torch.dtype,
               blocks: int | None = None) -> torch.Tensor:
    """[..., rows, row bytes] GGUF blocks -> [..., rows, columns] in dtype;
    ``blocks``: GGUF blocks a program writes (default: 4,096 values)."""
    qtype = T(qtype)
    qk, size = LAYOUT[qtype]
    blocks = blocks or 4096 // qk
    if qweight.dtype != torch.uint8 or qweight.shape[-1] % size:
        raise ValueError(f"{qtype.name}: rows of whole {size}-byte blocks expected, "
                         f"found {tuple(qweight.shape)} {qweight.dtype}")
    src = qweight.contiguous()
    cols = qweight.shape[-1] // size * qk
    out = torch.empty(*qweight.shape[:-1], cols, dtype=dtype, device=qweight.device)
    n_blocks = src.numel() // size
    if n_blocks:
        _dequant_kernel[(triton.cdiv(n_blocks, blocks),)](
            src, out, n_blocks, QTYPE=int(qtype), QK=qk, BYTES=size, BLOCKS=blocks)
    return out
