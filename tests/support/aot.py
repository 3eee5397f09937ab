# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Ahead-of-time compilation of the series' Triton kernels, without a GPU.

Tests (and the bench's compiler reports) compile the kernels for a target
such as sm_120 to read what the compiler fixes there: shared memory per
block, registers, SASS. Both kernel modules are described the same way: a
kernel's :class:`AotKernel` (function, signature, constexprs, launch
options) comes from :func:`sparse_mla_kernel` or :func:`dsa_indexer_kernels`,
and :func:`compile_for` compiles any of them for a compute capability.

Needs a process without ``TRITON_INTERPRET`` (the kernels must be
JITFunctions, and the interpreter patches ``triton.language``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import torch
import triton

_PTR = {torch.float16: "*fp16", torch.bfloat16: "*bf16"}

# Shared memory per block: SM120/SM121 (and the consumer SM86/SM89 parts),
# and SM90.
SM120_MAX_SHARED_BYTES = 101376
SM90_MAX_SHARED_BYTES = 232448


@dataclass(frozen=True)
class AotKernel:
    name: str  # a label for reports and test ids
    fn: Any  # the @triton.jit (or @gluon.jit) function
    signature: dict[str, str]  # argument -> Triton type, "constexpr" for those
    constexprs: dict[str, Any]
    options: dict[str, int]  # num_warps, num_stages
    # Arguments the JIT marks divisible by 16 when they are (pointers,
    # strides): without the same hints the AOT build is another kernel.
    aligned: tuple[str, ...] = ()
    gluon: bool = False


def run_aot_script(script: str, cache_dir, extra_paths: tuple[str, ...] = (),
                   timeout: int = 900) -> Any:
    """Run ``script``, which prints one JSON value on its last line, in a
    fresh Python with the interpreter off (a process that ran the
    interpreter has triton.language patched), tests/ and ``extra_paths`` on
    the path and a private Triton cache in ``cache_dir`` (a cold compile,
    no races with other processes); returns that value."""
    tests_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [tests_root, *extra_paths, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(cache_dir),
               PYTHONPATH=os.pathsep.join(path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compile_for(kernel: AotKernel, capability: tuple[int, int]):
    """The compiled kernel for ``capability`` (``.metadata.shared``,
    ``.asm["cubin"]`` ...)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if kernel.gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource

    # In the kernel's argument order: attributes are keyed by position.
    names = [n for n in kernel.fn.arg_names if n in kernel.signature]
    if set(names) != set(kernel.signature):
        unknown = sorted(set(kernel.signature) - set(names))
        raise ValueError(
            f"{kernel.name}: {unknown} are not arguments of {kernel.fn.__name__}"
        )
    signature = {n: kernel.signature[n] for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in kernel.aligned}
    src = ASTSource(
        fn=kernel.fn,
        signature=signature,
        constexprs=kernel.constexprs,
        attrs=attrs,
    )
    cc = capability[0] * 10 + capability[1]
    return triton.compile(
        src, target=GPUTarget("cuda", cc, 32), options=dict(kernel.options)
    )


# ---------------------------------------------------------------------------
# Sparse MLA (vllm/v1/attention/ops/triton_sparse_mla.py)
# ---------------------------------------------------------------------------

# Head counts that reach every bucket and padding case of the config tables.
_H_Q_PROBES = (1, 16, 17, 32, 33, 64, 128)


def sparse_mla_configs(capability: tuple[int, int]) -> list[tuple[str, Any, Any]]:
    """Every (path, dtype, config) sparse_mla_fwd can choose on
    ``capability``."""
    from vllm.v1.attention.ops.triton_sparse_mla import DTYPES, PATHS, get_config

    seen: list[tuple[str, Any, Any]] = []
    for path in PATHS:
        for dtype in DTYPES:
            for h_q in _H_Q_PROBES:
                entry = (path, dtype, get_config(capability, h_q, dtype, path))
                if entry not in seen:
                    seen.append(entry)
    return seen


def sparse_mla_kernel(
    dtype: torch.dtype, path: str, cfg: Any, h_q: int = 64, topk: int = 2048
) -> AotKernel:
    """The main kernel sparse_mla_fwd launches for ``cfg`` on ``path``
    ("decode": the split-over-topk form, fp32 partials), as the JIT
    specialises it for MLA's shapes (every stride and topk 2048 divisible by
    16). A config with ``gluon`` set is the SM90 Gluon kernel."""
    from vllm.v1.attention.ops import triton_sparse_mla as tsm

    ty = _PTR[dtype]
    split = path == "decode"
    gluon = bool(getattr(cfg, "gluon", False))
    block_h = cfg.block_h if gluon else min(cfg.block_h, tsm._h_bucket(h_q))
    sig = {
        "q_ptr": ty,
        "kv_ptr": ty,
        "idx_ptr": "*i32",
        "out_ptr": "*fp32" if split else ty,
        "lse_ptr": "*fp32",
        "maxl_ptr": "*fp32",
        "s_kv": "i32",
        "h_q": "i32",
        "topk": "i32",
        "split_len": "i32",
        **{
            f"stride_{n}": "i32"
            for n in ("q_s", "q_h", "kv_s", "idx_s", "o_s", "o_split", "o_h")
        },
        "stride_l_s": "i32",
        "stride_l_split": "i32",
        "qk_scale": "fp32",
    }
    iters = triton.cdiv(topk, cfg.block_n)
    consts: dict[str, Any] = {
        "D_V": tsm.D_V,
        "D_ROPE": tsm.D_QK - tsm.D_V,
        "BLOCK_H": block_h,
        "BLOCK_N": cfg.block_n,
        "SPLIT": split,
    }
    if gluon:
        from vllm.v1.attention.ops.triton_sparse_mla_sm90 import sm90_kernel

        fn = sm90_kernel(split)
    else:
        fn = tsm._sparse_mla_fwd_kernel
        consts.update(
            NUM_ITERS=iters,
            HOIST=bool(cfg.hoist),
            ITERS_P2=triton.next_power_of_2(iters),
        )
    sig.update({name: "constexpr" for name in consts})
    aligned = tuple(
        n for n, t in sig.items() if t.startswith("*") or n.startswith("stride")
    ) + ("topk",)
    return AotKernel(
        name=f"sparse_mla[{path},{str(dtype).split('.')[-1]},{tuple(cfg)}]",
        fn=fn,
        signature=sig,
        constexprs=consts,
        options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
        aligned=aligned,
        gluon=gluon,
    )


# ---------------------------------------------------------------------------
# DSA indexer (vllm/v1/attention/ops/triton_dsa_indexer.py)
# ---------------------------------------------------------------------------


def dsa_indexer_kernels(
    num_heads: int = 32,
    head_dim: int = 128,
    block_size: int = 64,
    arch_keys: tuple[str, ...] = ("default",),
) -> list[AotKernel]:
    """The prefill and paged-decode kernels of the tile configs of
    ``arch_keys`` ("default" is what SM8x/SM12x run), with native fp8
    operands and with the fp8->fp16 rebuild (``constexprs["UPCAST"]``)."""
    from vllm.v1.attention.ops import triton_dsa_indexer as tdi

    def fp8(upcast: bool) -> str:
        return "*u8" if upcast else "*fp8e4nv"

    common = {
        "H": num_heads,
        "D": head_dim,
        "BLOCK_H": triton.next_power_of_2(num_heads),
        "BLOCK_D": triton.next_power_of_2(head_dim),
    }
    kernels = []
    for key in arch_keys:
        cfg = tdi.PREFILL_CONFIGS[key]
        for upcast in (False, True):
            sig = {
                "q_ptr": fp8(upcast),
                "k_ptr": fp8(upcast),
                "k_scale_ptr": "*fp32",
                "w_ptr": "*fp32",
                "ks_ptr": "*i32",
                "ke_ptr": "*i32",
                "out_ptr": "*fp32",
                "T": "i32",
                "S": "i32",
                **{
                    f"stride_{n}": "i32"
                    for n in ("qt", "qh", "kn", "wt", "ot")
                },
            }
            consts = {
                **common,
                "BLOCK_T": cfg.BLOCK_T,
                "BLOCK_N": cfg.BLOCK_N,
                "TILES_PER_PROG": cfg.TILES_PER_PROG,
                "UPCAST": upcast,
                "CLEAN": False,
                "KV_MAJOR": cfg.KV_MAJOR,
            }
            sig.update({name: "constexpr" for name in consts})
            kernels.append(
                AotKernel(
                    name=f"prefill[{key},upcast={upcast}]",
                    fn=tdi._fp8_mqa_logits_kernel,
                    signature=sig,
                    constexprs=consts,
                    options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
                )
            )
    for key in arch_keys:
        dcfg = tdi.DECODE_CONFIGS[key]
        for next_n in (1, 2):
            for upcast in (False, True):
                sig = {
                    "q_ptr": fp8(upcast),
                    "kv_ptr": "*u8",
                    "w_ptr": "*fp32",
                    "ctx_ptr": "*i32",
                    "bt_ptr": "*i32",
                    "out_ptr": "*fp32",
                    "NUM_SPLITS": "i32",
                    "num_blocks": "i32",
                    "max_pages": "i32",
                    "out_width": "i32",
                    **{
                        f"stride_{n}": "i32"
                        for n in ("qb", "qn", "qh", "wt", "bt", "ot")
                    },
                    "block_stride": "i64",
                }
                consts = {
                    **common,
                    "NEXT_N": next_n,
                    "BLOCK_NEXT_N": triton.next_power_of_2(next_n),
                    "CTX_2D": next_n > 1,
                    "PAGE": block_size,
                    "UPCAST": upcast,
                    "KV_MAJOR": dcfg.KV_MAJOR,
                }
                sig.update({name: "constexpr" for name in consts})
                kernels.append(
                    AotKernel(
                        name=f"decode[{key},next_n={next_n},upcast={upcast}]",
                        fn=tdi._fp8_paged_mqa_logits_kernel,
                        signature=sig,
                        constexprs=consts,
                        options={
                            "num_warps": dcfg.num_warps,
                            "num_stages": dcfg.num_stages,
                        },
                    )
                )
    return kernels


# ---------------------------------------------------------------------------
# DSA indexer K-cache writer (vllm/v1/attention/ops/dsa_indexer_k_cache.py)
# ---------------------------------------------------------------------------


def dsa_indexer_k_cache_kernel(
    dtype: torch.dtype, head_dim: int = 128, quant_block: int = 128
) -> AotKernel:
    """The writer as the engine launches it (ue8m0 scales)."""
    from vllm.v1.attention.ops import dsa_indexer_k_cache as kc

    sig = {
        "k_ptr": {torch.float32: "*fp32", **_PTR}[dtype],
        "k_stride": "i32",
        "cache_ptr": "*u8",
        "cache_f32_ptr": "*fp32",
        "slot_ptr": "*i64",
        "block_stride": "i32",
        "cache_block_size": "i32",
        "num_slots": "i32",
    }
    consts = {"HEAD_DIM": head_dim, "QUANT_BLOCK": quant_block, "USE_UE8M0": True}
    sig.update({name: "constexpr" for name in consts})
    return AotKernel(
        name=f"k_cache[{str(dtype).removeprefix('torch.')}]",
        fn=kc._indexer_k_quant_and_cache_kernel,
        signature=sig,
        constexprs=consts,
        options={"num_warps": 1, "num_stages": 1},
        aligned=("k_ptr", "cache_ptr", "cache_f32_ptr", "slot_ptr"),
    )
