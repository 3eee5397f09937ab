# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Triton sparse MLA kernel (patch 0004) against an fp64 reference.

CPU: the kernels run under TRITON_INTERPRET=1 at small sizes (d_qk/d_v stay
576/512, the real geometry) in fp16 -- Triton 3.6's interpreter gets bf16
dots wrong, so bf16 is checked on a GPU. Bad arguments must raise
ValueError/TypeError naming the argument, also under ``python -O``. Every
config the kernel can choose on 12.0/12.1 is AOT-compiled
(tests/support/aot.py) for sm_120/sm_121 and must fit 101,376 B of shared
memory; 8.0, 8.9, 9.0 (the two Hopper Gluon kernels, within 232,448 B) and
10.0 must compile.
GPU (``-m gpu``): GLM-5 shapes, fp16 and bf16, the SM120 configs forced on
whatever GPU runs them, and FlashMLA sparse side by side where it loads.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from vllm.v1.attention.ops.triton_sparse_mla import (
    SparseMLAConfig,
    auto_config,
    get_config,
    req_topk_to_slots,
    sparse_mla_fwd,
)

from support.aot import SM90_MAX_SHARED_BYTES, SM120_MAX_SHARED_BYTES
from support.aot import sparse_mla_configs as all_configs
from support.peers import load_flashmla_sparse
from support.sparse_mla_ref import ref_sparse_mla

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
D_QK, D_V = 576, 512
SCALE = D_QK**-0.5
# tests/: where the AOT subprocesses find support.aot.
SUPPORT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ||out - ref|| / ||ref|| bounds.
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(res, ref, dtype, empty_rows=()):
    out, max_logits, lse = res
    r_out, r_max, r_lse = ref
    assert not torch.isnan(out).any(), "NaN in out"
    assert not torch.isnan(max_logits).any() and not torch.isnan(lse).any()
    err = rel_err(out, r_out)
    assert err <= TOL[dtype], f"out rel err {err:.3g} > {TOL[dtype]:.3g}"
    # Same infinities; finite values to fp32-accumulation accuracy.
    assert torch.equal(torch.isposinf(lse.cpu()), torch.isposinf(r_lse.cpu()))
    assert torch.equal(torch.isneginf(max_logits.cpu()), torch.isneginf(r_max.cpu()))
    fin = torch.isfinite(r_lse)
    tol = 1e-4 * (1.0 + r_lse[fin].abs().max().item() if fin.any() else 1.0)
    assert (lse[fin].double() - r_lse[fin]).abs().max().item() <= tol
    assert (max_logits[fin].double() - r_max[fin]).abs().max().item() <= tol
    for r in empty_rows:
        assert torch.all(out[r] == 0)
        assert torch.all(torch.isposinf(lse[r])) and torch.all(
            torch.isneginf(max_logits[r])
        )
    return err


def make_inputs(s_q, h_q, s_kv, topk, dtype, q_scale=1.0, gen=None, device=DEV):
    q = (torch.randn(s_q, h_q, D_QK, generator=gen) * q_scale).to(dtype).to(device)
    kv = torch.randn(s_kv, 1, D_QK, generator=gen).to(dtype).to(device)
    # Out-of-range on both sides, and (with topk > s_kv) duplicates.
    idx = torch.randint(-3, s_kv + 3, (s_q, 1, topk), generator=gen, dtype=torch.int32)
    return q, kv, idx.to(device)


def nan_out(s_q, h_q, dtype, device=DEV):
    return torch.full((s_q, h_q, D_V), float("nan"), dtype=dtype, device=device)


def cpu_dtypes():
    # bf16 dots are wrong in the interpreter: fp16 only on CPU.
    return [torch.float16]


# ---------------------------------------------------------------------------
# CPU (interpreter) numerics
# ---------------------------------------------------------------------------


# Both loop variants of the kernel are tested, whatever the tables pick.
VARIANTS = {
    "plain": {"hoist": False},
    "hoist": {"hoist": True},
}


def with_variant(q, path, variant):
    """The config this device would pick, with the loop variant forced."""
    cap = torch.cuda.get_device_capability() if CUDA else (12, 0)
    return get_config(cap, q.shape[1], q.dtype, path)._replace(**VARIANTS[variant])


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", cpu_dtypes())
@pytest.mark.parametrize("h_q", [1, 3, 8, 64])
def test_prefill_masks_duplicates_empty_row(dtype, h_q, variant):
    gen = torch.Generator().manual_seed(100 + h_q)
    s_q, s_kv, topk = 4, 40, 37  # topk is not a multiple of any BLOCK_N
    q, kv, idx = make_inputs(s_q, h_q, s_kv, topk, dtype, gen=gen)
    idx[0, 0, :12] = 7  # a row with many duplicates
    idx[2, 0] = torch.where(torch.arange(topk) % 2 == 0, -1, s_kv + 5).to(
        DEV
    )  # all invalid
    out = nan_out(s_q, h_q, dtype)
    cfg = with_variant(q, "prefill", variant)
    res = sparse_mla_fwd(q, kv, idx, SCALE, D_V, out=out, num_splits=1, config=cfg)
    assert res[0].data_ptr() == out.data_ptr()
    check(res, ref_sparse_mla(q, kv, idx, SCALE), dtype, empty_rows=[2])


@pytest.mark.parametrize("dtype", cpu_dtypes())
def test_large_magnitude_logits(dtype):
    gen = torch.Generator().manual_seed(7)
    q, kv, idx = make_inputs(3, 8, 64, 50, dtype, q_scale=30.0, gen=gen)
    ref = ref_sparse_mla(q, kv, idx, SCALE)
    assert ref[1][torch.isfinite(ref[1])].abs().max() > 50  # really large
    check(sparse_mla_fwd(q, kv, idx, SCALE, num_splits=1), ref, dtype)
    check(sparse_mla_fwd(q, kv, idx, SCALE, num_splits=3), ref, dtype)


def test_strided_kv_rows_and_out_view():
    dtype = torch.float16
    gen = torch.Generator().manual_seed(3)
    s_q, h_q, s_kv, topk = 3, 5, 48, 29
    q, _, idx = make_inputs(s_q, h_q, s_kv, topk, dtype, gen=gen)
    # A paged cache [blocks, block_size, 656] whose rows are viewed as
    # [s_kv, 1, 576] with row stride 656 (> 576).
    cache = torch.randn(s_kv // 16, 16, 656, generator=gen).to(dtype).to(DEV)
    kv = cache.view(s_kv, 656)[:, :D_QK].unsqueeze(1)
    assert kv.stride(0) == 656
    big = torch.full((s_q, h_q, 2 * D_V), float("nan"), dtype=dtype, device=DEV)
    out = big[:, :, D_V:]  # a non-contiguous view
    res = sparse_mla_fwd(q, kv, idx, SCALE, D_V, out=out)
    check(res, ref_sparse_mla(q, kv, idx, SCALE), dtype)
    assert torch.isnan(big[:, :, :D_V]).all(), "wrote outside the out view"
    assert not torch.isnan(big[:, :, D_V:]).any()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", cpu_dtypes())
@pytest.mark.parametrize(
    "h_q,num_splits", [(3, 2), (16, 3), (8, 7), (64, 4), (5, None)]
)
def test_decode_split_path(dtype, h_q, num_splits, variant):
    gen = torch.Generator().manual_seed(11 * h_q + (num_splits or 0))
    s_q, s_kv, topk = 3, 80, 100
    q, kv, idx = make_inputs(s_q, h_q, s_kv, topk, dtype, gen=gen)
    idx[0, 0, :70] = -1  # leading splits of this row are empty
    idx[1, 0] = -1  # a row with nothing valid
    idx[2, 0, 10:30] = idx[2, 0, 40]  # duplicates across splits
    out = nan_out(s_q, h_q, dtype)
    cfg = with_variant(q, "decode", variant) if num_splits else None
    res = sparse_mla_fwd(
        q, kv, idx, SCALE, D_V, out=out, num_splits=num_splits, config=cfg
    )
    check(res, ref_sparse_mla(q, kv, idx, SCALE), dtype, empty_rows=[1])


def test_split_choice_bounds():
    """One token: split; many tokens: one pass; never more splits than row
    blocks; nothing to gather: no split."""
    dt = torch.bfloat16
    for cap in [(9, 0), (10, 0), (12, 0)]:
        assert auto_config(cap, 1, 64, 2048, dt, 132)[1] > 8
        assert auto_config(cap, 4, 8, 2048, dt, 132)[1] > 1
        assert auto_config(cap, 1024, 64, 2048, dt, 132)[1] == 1
    forced = SparseMLAConfig(64, 16, 4, 2)
    assert auto_config((12, 0), 1, 64, 40, dt, 132, forced) == (forced, 3)
    assert auto_config((12, 0), 1, 64, 16, dt, 132, forced) == (forced, 1)
    assert auto_config((12, 0), 1, 64, 0, dt, 132)[1] == 1


def test_split_choice_counts_resident_ctas():
    """Cases timed on H200 (bench/results/nvidia-h200/sparse_mla_paths.md, path sweep):
    the choice fills whole waves of the CTAs an SM holds at once."""
    cap, dt = (12, 0), torch.bfloat16
    decode = get_config(cap, 64, dt, "decode")
    two_per_sm, one_per_sm = 233472, 102400  # H200; SM120 (100 KB per SM)
    # 4 tokens x 8 heads: 64 splits are one wave of 2 x 132 slots; with one
    # CTA per SM, 32 splits (one wave of 128 CTAs: 12.5 us, 64 splits 15.2).
    assert auto_config(cap, 4, 8, 2048, dt, 132, None, two_per_sm)[1] == 64
    assert auto_config(cap, 4, 8, 2048, dt, 132, None, one_per_sm)[1] == 32
    # 64 tokens x 64 heads, two CTAs per SM: the decode config's 256 16-head
    # CTAs in one pass fill one wave; the prefill config's 128 32-head CTAs
    # left half the slots idle (139 vs 191 us).
    assert auto_config(cap, 64, 64, 2048, dt, 132, None, two_per_sm) == (decode, 1)


@pytest.mark.parametrize("cap", [(9, 0), (10, 0), (12, 0)])
def test_auto_config_follows_token_count(cap):
    """Few tokens: the decode table, split; many: the prefill table, one
    pass. A forced config serves both paths (the bench relies on this)."""
    dt = torch.bfloat16
    cfg, ns = auto_config(cap, 1, 64, 2048, dt, 132)
    assert ns > 1 and cfg == get_config(cap, 64, dt, "decode")
    cfg, ns = auto_config(cap, 4096, 64, 2048, dt, 132)
    assert ns == 1 and cfg == get_config(cap, 64, dt, "prefill")
    forced = SparseMLAConfig(16, 32, 4, 2)
    assert auto_config(cap, 1, 8, 2048, dt, 132, forced)[0] == forced
    assert auto_config(cap, 4096, 8, 2048, dt, 132, forced) == (forced, 1)


def _slots_ref(pos, req, table, bs):
    out = torch.full_like(pos, -1)
    for t in range(pos.shape[0]):
        for j in range(pos.shape[1]):
            p = int(pos[t, j])
            if 0 <= p < table.shape[1] * bs:
                out[t, j] = int(table[req[t], p // bs]) * bs + p % bs
    return out


def test_req_topk_to_slots_shuffled_block_table():
    gen = torch.Generator().manual_seed(5)
    bs, n_req, max_blocks = 4, 3, 5
    table = torch.randperm(n_req * max_blocks, generator=gen).view(n_req, max_blocks)
    table = table.to(torch.int32)
    req = torch.tensor([0, 0, 1, 2, 2, 2], dtype=torch.int32)
    pos = torch.randint(
        -1, max_blocks * bs + 2, (6, 9), generator=gen, dtype=torch.int32
    )
    slots = req_topk_to_slots(pos.to(DEV), req.to(DEV), table.to(DEV), bs)
    assert slots.dtype == torch.int32
    assert torch.equal(slots.cpu(), _slots_ref(pos, req, table, bs))
    # [T, 1, topk] keeps its shape.
    assert req_topk_to_slots(
        pos[:, None].to(DEV), req.to(DEV), table.to(DEV), bs
    ).shape == (6, 1, 9)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_end_to_end(num_splits):
    """Requests' tokens live in shuffled cache blocks; attention over slots
    from req_topk_to_slots equals attention over each request's contiguous
    sequence."""
    dtype = torch.float16
    gen = torch.Generator().manual_seed(9 + num_splits)
    bs, n_req, max_blocks, h_q, topk = 8, 2, 4, 4, 21
    seq = torch.randn(n_req, max_blocks * bs, D_QK, generator=gen).to(dtype)
    table = torch.randperm(n_req * max_blocks + 3, generator=gen)[: n_req * max_blocks]
    table = table.view(n_req, max_blocks).to(torch.int32)
    cache = torch.randn(n_req * max_blocks + 3, bs, D_QK, generator=gen).to(dtype)
    for r in range(n_req):
        for b in range(max_blocks):
            cache[table[r, b]] = seq[r, b * bs : (b + 1) * bs]
    req = torch.tensor([0, 1, 1], dtype=torch.int32)
    pos = torch.randint(0, max_blocks * bs, (3, topk), generator=gen, dtype=torch.int32)
    pos[1, 15:] = -1
    q = torch.randn(3, h_q, D_QK, generator=gen).to(dtype)
    slots = req_topk_to_slots(pos.to(DEV), req.to(DEV), table.to(DEV), bs)
    kv = cache.to(DEV).view(-1, 1, D_QK)
    res = sparse_mla_fwd(q.to(DEV), kv, slots[:, None], SCALE, num_splits=num_splits)
    refs = []
    for t in range(3):
        r = int(req[t])
        refs.append(
            ref_sparse_mla(q[t : t + 1], seq[r][:, None], pos[t : t + 1, None], SCALE)
        )
    ref = tuple(torch.cat([x[i] for x in refs]).to(DEV) for i in range(3))
    check(res, ref, dtype)


# ---------------------------------------------------------------------------
# Argument checks: a message naming the argument, also under python -O
# ---------------------------------------------------------------------------


def _bad_args(case):
    """(q, kv, indices, kwargs) with one defect, named by ``case``."""
    dt = torch.float16
    q, kv, idx = make_inputs(3, 4, 32, 20, dt, gen=torch.Generator().manual_seed(1))
    kw = {}
    if case == "q_2d":
        q = q[:, 0]
    elif case == "q_d_qk":
        q = q[..., :512]
    elif case == "q_dtype":
        q, kv = q.float(), kv.float()
    elif case == "kv_shape":
        kv = kv.expand(32, 2, D_QK)
    elif case == "kv_dtype":
        kv = kv.to(torch.bfloat16)
    elif case == "kv_last_dim_strided":
        kv = torch.empty(32, 1, 2 * D_QK, dtype=dt, device=DEV)[..., ::2]
    elif case == "indices_short":
        idx = idx[:2]
    elif case == "indices_2d":
        idx = idx[:, 0]
    elif case == "indices_dtype":
        idx = idx.long()
    elif case == "d_v":
        kw["d_v"] = 256
    elif case == "out_shape":
        kw["out"] = nan_out(3, 5, dt)
    elif case == "out_dtype":
        kw["out"] = nan_out(3, 4, torch.bfloat16)
    elif case == "num_splits":
        kw["num_splits"] = 0
    return q, kv, idx, kw


BAD_ARGS = {
    # case: (exception, words the message must contain)
    "q_2d": (ValueError, ["q", "[s_q, h_q, 576]", "(3, 576)"]),
    "q_d_qk": (ValueError, ["q", "[s_q, h_q, 576]", "(3, 4, 512)"]),
    "q_dtype": (TypeError, ["q", "float16 or bfloat16", "torch.float32"]),
    "kv_shape": (ValueError, ["kv", "[s_kv, 1, 576]", "(32, 2, 576)"]),
    "kv_dtype": (TypeError, ["kv", "torch.float16", "torch.bfloat16"]),
    "kv_last_dim_strided": (ValueError, ["kv", "stride 1", "2"]),
    "indices_short": (ValueError, ["indices", "[3, 1, topk]", "(2, 1, 20)"]),
    "indices_2d": (ValueError, ["indices", "[3, 1, topk]", "(3, 20)"]),
    "indices_dtype": (TypeError, ["indices", "torch.int32", "torch.int64"]),
    "d_v": (ValueError, ["d_v", "512", "256"]),
    "out_shape": (ValueError, ["out", "(3, 4, 512)", "(3, 5, 512)"]),
    "out_dtype": (TypeError, ["out", "torch.float16", "torch.bfloat16"]),
    "num_splits": (ValueError, ["num_splits", ">= 1", "0"]),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_rejects_bad_arguments_by_name(case):
    exc, words = BAD_ARGS[case]
    q, kv, idx, kw = _bad_args(case)
    with pytest.raises(exc) as info:
        sparse_mla_fwd(q, kv, idx, SCALE, **kw)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_topk_zero(num_splits):
    """No index at all: every row is empty, whatever split count is asked."""
    q, kv, _ = make_inputs(2, 3, 16, 1, torch.float16)
    idx = torch.empty((2, 1, 0), dtype=torch.int32, device=DEV)
    out, max_logits, lse = sparse_mla_fwd(
        q, kv, idx, SCALE, out=nan_out(2, 3, torch.float16), num_splits=num_splits
    )
    assert torch.all(out == 0)
    assert torch.all(torch.isposinf(lse)) and torch.all(torch.isneginf(max_logits))


_SHORT_INDICES_SCRIPT = r"""
import sys, torch
from vllm.v1.attention.ops.triton_sparse_mla import sparse_mla_fwd
assert not __debug__, "run with python -O"
q = torch.randn(4, 2, 576).half()
kv = torch.randn(8, 1, 576).half()
idx = torch.zeros((1, 1, 16), dtype=torch.int32)  # rows for 1 of 4 tokens
try:
    sparse_mla_fwd(q, kv, idx, 0.1)
except ValueError as e:
    print("ValueError:", e)
    sys.exit(0)
print("no error")
sys.exit(1)
"""


def test_too_short_indices_rejected_under_python_O():
    """Asserts vanish under -O; the kernel would then read past indices."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-O", "-c", _SHORT_INDICES_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "indices" in proc.stdout


# ---------------------------------------------------------------------------
# Configs and AOT compilation (no GPU needed)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [(12, 0), (12, 1)])
def test_sm12x_config_table(cap):
    for h_q in (1, 3, 8, 16, 17, 32, 64, 65, 128):
        for path in ("prefill", "decode"):
            cfg = get_config(cap, h_q, torch.float16, path)
            assert cfg.block_h in (16, 32, 64) and cfg.block_n >= 16
    assert len(all_configs(cap)) >= 6


_AOT_SCRIPT = r"""
import json, sys, torch
from triton.backends.nvidia.compiler import CUDABackend
from support.aot import compile_for, sparse_mla_kernel
from vllm.v1.attention.ops.triton_sparse_mla import SparseMLAConfig

full_stages = CUDABackend.add_stages


def fake_ptx(src, metadata):
    metadata["name"] = "_sparse_mla_fwd_kernel"
    return ""


def to_llir(self, stages, options, *a, **k):
    # Shared memory is Triton's own allocation, fixed in LLVM IR; PTX
    # generation and ptxas (two thirds of the compile time) cannot change it.
    full_stages(self, stages, options, *a, **k)
    stages["ptx"] = fake_ptx
    stages["cubin"] = lambda src, metadata: b""


for job, full in json.loads(sys.argv[1]):
    cap, path, dtype, cfg = job
    CUDABackend.add_stages = full_stages if full else to_llir
    cfg = SparseMLAConfig(*cfg)
    kernel = sparse_mla_kernel(getattr(torch, dtype), path, cfg, h_q=cfg.block_h)
    k = compile_for(kernel, tuple(cap))
    assert (len(k.asm["cubin"]) > 0) == full
    print(json.dumps([job, k.metadata.shared]), flush=True)
"""


def _aot_jobs():
    """[(job, full)]: every 12.x config to LLVM IR (the shared-memory size
    is fixed there); down to a cubin (ptxas) for every fp16 12.0 config and
    one config of each other architecture."""
    jobs = []
    for cap in [(12, 0), (12, 1)]:
        for path, dtype, cfg in all_configs(cap):
            full = cap == (12, 0) and dtype == torch.float16
            jobs.append(([list(cap), path, str(dtype).split(".")[1], list(cfg)], full))
    for cap in [(8, 0), (8, 9), (9, 0), (10, 0)]:
        # 9.0: both Hopper Gluon kernels (one-pass and split).
        for path in ("prefill", "decode") if cap == (9, 0) else ("prefill",):
            cfg = get_config(cap, 64, torch.bfloat16, path)
            jobs.append(([list(cap), path, "bfloat16", list(cfg)], True))
    return jobs


@pytest.fixture(scope="module")
def aot_shared(tmp_path_factory):
    """{(cap, path, dtype, cfg): shared bytes}. Compiled in two processes
    without TRITON_INTERPRET (AOT needs the real compiler; two keep both CI
    cores busy: ptxas dominates)."""
    jobs = _aot_jobs()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [SUPPORT_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    # Triton's cache key does not see the patched stages: a cubin cached by
    # a full compile elsewhere would be returned for an LLVM-IR-only job.
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-aot-cache"))
    halves = [jobs[0::2], jobs[1::2]]  # alternating: similar cost each

    def run(part):
        return subprocess.run(
            [sys.executable, "-c", _AOT_SCRIPT, json.dumps(part)],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )

    with ThreadPoolExecutor(2) as ex:
        procs = list(ex.map(run, halves))
    result = {}
    for p in procs:
        assert p.returncode == 0, p.stderr[-4000:]
        for line in p.stdout.splitlines():
            job, shared = json.loads(line)
            result[json.dumps(job)] = shared
    assert len(result) == len(jobs)
    return result


@pytest.mark.parametrize("cap", [(12, 0), (12, 1)])
def test_aot_sm12x_every_config_fits_shared_memory(aot_shared, cap):
    mine = {k: v for k, v in aot_shared.items() if json.loads(k)[0] == list(cap)}
    assert len(mine) == len(all_configs(cap))
    over = {k: v for k, v in mine.items() if v > SM120_MAX_SHARED_BYTES}
    assert not over, f"over {SM120_MAX_SHARED_BYTES} B: {over}"
    assert all(v > 0 for v in mine.values())


@pytest.mark.parametrize("cap", [(8, 0), (8, 9), (9, 0), (10, 0)])
def test_aot_other_archs_compile(aot_shared, cap):
    mine = {k: v for k, v in aot_shared.items() if json.loads(k)[0] == list(cap)}
    assert len(mine) == (2 if cap == (9, 0) else 1)
    assert all(v > 0 for v in mine.values())
    if cap[0] == 8:  # consumer Ampere/Ada share the 99 KB limit
        assert all(v <= SM120_MAX_SHARED_BYTES for v in mine.values())
    if cap[0] == 9:  # the Gluon kernels' q and two 64-row buffers must fit
        assert all(v <= SM90_MAX_SHARED_BYTES for v in mine.values())
        assert all(SparseMLAConfig(*json.loads(k)[3]).gluon for k in mine), (
            "9.0 runs the Gluon kernels"
        )


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------


def _gpu_inputs(s_q, h_q, dtype, topk=2048, s_kv=65536, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(s_q, h_q, D_QK, device="cuda", generator=gen).to(dtype)
    kv = torch.randn(s_kv, 1, D_QK, device="cuda", generator=gen).to(dtype)
    # Unique rows per token, like the indexer's top-k; short contexts pad
    # with -1: every 3rd token keeps only its first 1500 entries.
    perm = torch.randperm(s_kv, device="cuda", generator=gen)[:topk]
    shift = torch.randint(0, s_kv, (s_q, 1), device="cuda", generator=gen)
    idx = ((perm[None, :] + shift) % s_kv).to(torch.int32)
    idx[::3, 1500:] = -1
    return q, kv, idx[:, None, :].contiguous()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("h_q", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("s_q", [1, 2, 4, 16, 64, 1024, 4096])
def test_gpu_glm5_shapes(dtype, h_q, s_q):
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    q, kv, idx = _gpu_inputs(s_q, h_q, dtype, seed=s_q * 1000 + h_q)
    ref = ref_sparse_mla(q, kv, idx, SCALE)
    modes = [None, 1] if s_q <= 16 else [None]
    for ns in modes:
        out = nan_out(s_q, h_q, dtype, "cuda")
        res = sparse_mla_fwd(q, kv, idx, SCALE, out=out, num_splits=ns)
        torch.cuda.synchronize()
        err = check(res, ref, dtype)
        assert err <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("h_q", [20, 33, 100])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_gpu_partial_head_block_edges(dtype, h_q, num_splits):
    """Head counts that leave a 64-head block partly empty (on SM90 the
    Gluon kernels pad 17-64 heads to 64), topk not a multiple of 64,
    duplicates, out-of-range indices and a row with nothing valid."""
    gen = torch.Generator().manual_seed(h_q * 10 + num_splits)
    s_q, s_kv, topk = 6, 4096, 2000
    q, kv, idx = make_inputs(s_q, h_q, s_kv, topk, dtype, gen=gen, device="cuda")
    idx[0, 0, :300] = 11  # duplicates
    idx[3, 0] = torch.where(torch.arange(topk) % 2 == 0, -1, s_kv).to("cuda")
    idx[4, 0, 64:] = -1  # only the first row block is valid
    out = nan_out(s_q, h_q, dtype, "cuda")
    res = sparse_mla_fwd(q, kv, idx, SCALE, out=out, num_splits=num_splits)
    check(res, ref_sparse_mla(q, kv, idx, SCALE), dtype, empty_rows=[3])


@pytest.mark.gpu
@pytest.mark.parametrize("cap", [(12, 0), (12, 1)])
@pytest.mark.parametrize("h_q", [8, 64, 128])
def test_gpu_sm12x_configs(cap, h_q):
    """The configs 12.x would choose, forced on this GPU."""
    for path, dtype, cfg in all_configs(cap):
        q, kv, idx = _gpu_inputs(4 if path == "decode" else 256, h_q, dtype, seed=h_q)
        ref = ref_sparse_mla(q, kv, idx, SCALE)
        out = nan_out(q.shape[0], h_q, dtype, "cuda")
        ns = 8 if path == "decode" else 1
        check(
            sparse_mla_fwd(q, kv, idx, SCALE, out=out, num_splits=ns, config=cfg),
            ref,
            dtype,
        )


@pytest.mark.gpu
@pytest.mark.parametrize("h_q", [64, 128])
def test_gpu_matches_flashmla_bf16(h_q):
    op, why = load_flashmla_sparse()
    if op is None:
        pytest.skip(why)
    q, kv, idx = _gpu_inputs(512, h_q, torch.bfloat16, seed=h_q + 1)
    idx[5, 0] = -1  # all-invalid row: both kernels must agree on it too
    f_out, f_max, f_lse = op(q, kv, idx, SCALE, D_V)
    out, max_logits, lse = sparse_mla_fwd(q, kv, idx, SCALE)
    assert rel_err(out, f_out.double()) <= 1e-2
    fin = torch.isfinite(f_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin] - f_lse[fin]).abs().max().item() <= 1e-2
    assert (max_logits[fin] - f_max[fin]).abs().max().item() <= 1e-2
    assert torch.all(out[5] == 0) and torch.all(f_out[5] == 0)


def test_config_type():
    cfg = get_config((12, 0), 64, torch.float16)
    assert isinstance(cfg, SparseMLAConfig)


@pytest.mark.gpu
def test_gpu_more_tokens_than_grid_dim():
    """> 65535 tokens: the one-pass path launches in token chunks."""
    gen = torch.Generator().manual_seed(17)
    q, kv, idx = make_inputs(70000, 3, 1000, 40, torch.float16, gen=gen, device="cuda")
    out = nan_out(70000, 3, torch.float16, "cuda")
    res = sparse_mla_fwd(q, kv, idx, SCALE, out=out)
    check(res, ref_sparse_mla(q, kv, idx, SCALE, chunk=8192), torch.float16)
