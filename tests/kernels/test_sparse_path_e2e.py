# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The whole DSA sparse path without DeepGEMM, on one GLM-5 layer's shapes.

indexer logits (Triton, fp8) -> top-k -> token positions to cache slots ->
sparse MLA (Triton, bf16 and fp16), as vLLM chains them
(``layers/sparse_attn_indexer.py`` then the sparse MLA backend), for

- prefill: ragged causal windows ``[ks, ke)`` over the gathered indexer keys
  of three packed requests (one fresh, two with cached prefixes), so early
  rows have fewer than ``topk`` keys and are padded with -1;
- decode: the paged fp8 indexer cache and the paged MLA cache sharing one
  shuffled block table, next_n 1.

Checked against an fp64 torch reference (logits, top-k sets up to ties,
attention over the chosen indices) and, where they run (SM90/SM100), against
DeepGEMM logits -> the same top-k -> FlashMLA sparse, the path vLLM takes
there. Both top-k calls use the module's torch fallback of
``top_k_per_row_prefill/decode`` (same semantics as vLLM's ops).

FlashMLA is found through FLASHMLA_SO (path of ``_flashmla_C.abi3.so``) or
``vllm._flashmla_C``; DeepGEMM as ``deep_gemm`` or
``vllm.third_party.deep_gemm`` (tests/support/peers.py). Set SPARSE_E2E_JSON to a file to get the
measured errors, agreement counts and timings appended as JSON lines.

``test_chain_small`` runs the same chain at small sizes (Triton interpreter
on CPU); the GLM-5-sized tests are ``gpu``-marked.
"""

import json
import os
from dataclasses import dataclass, field

import pytest
import torch
import triton
from vllm.v1.attention.ops import triton_dsa_indexer as tdi
from vllm.v1.attention.ops.triton_sparse_mla import req_topk_to_slots, sparse_mla_fwd

from support.peers import load_deep_gemm, load_flashmla_sparse
from support.sparse_mla_ref import ref_sparse_mla

FP8 = torch.float8_e4m3fn
IDX_HEADS, IDX_DIM = 32, 128  # GLM-5 index_n_heads, index_head_dim
D_QK, D_V = 576, 512
SM_SCALE = (192 + 64) ** -0.5  # GLM-5: 1/sqrt(qk_nope + qk_rope)
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
# Hopper's fp8 MMA (and DeepGEMM) lands ~1.2e-4 from fp64; allow headroom.
LOGITS_TOL = 2e-3


@dataclass(frozen=True)
class Shapes:
    topk: int
    block: int  # cache block size (indexer and MLA caches share tables)
    max_heads: int  # attention heads of the q built (TP1)
    prefill_reqs: tuple[tuple[int, int], ...]  # (new tokens, context) each
    spare_blocks: int  # pool blocks no request owns (never to be read)
    decode_batch: int
    decode_max_ctx: int
    decode_fixed_ctx: tuple[int, ...]  # first requests' contexts


# GLM-5 layer: topk 2048, block 64. Prefill T = 2048 new tokens over
# S = 8192 keys: a fresh 256-token request (windows 1..256), one whose
# windows cross topk (1537..2816) and one above it (4609..5120).
GLM5 = Shapes(
    topk=2048,
    block=64,
    max_heads=64,
    prefill_reqs=((256, 256), (1280, 2816), (512, 5120)),
    spare_blocks=32,
    decode_batch=32,
    decode_max_ctx=32768,
    decode_fixed_ctx=(32768, 1, 100, 2047, 2048, 2049),
)
SMALL = Shapes(
    topk=24,
    block=16,
    max_heads=3,
    prefill_reqs=((6, 6), (10, 40), (4, 64)),
    spare_blocks=3,
    decode_batch=4,
    decode_max_ctx=128,
    decode_fixed_ctx=(128, 1, 24, 25),
)


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


def _gen(device: str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def rand_fp8(shape, gen, device, amp=3.0):
    x = torch.randn(shape, generator=gen, device=device) * amp
    return x.clamp(-448, 448).to(FP8)


def quant_per_token(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Power-of-two (ue8m0) per-token scales, as indexer_k_quant_and_cache.
    scale = k.abs().amax(-1).clamp_min(1e-4) / 448.0
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return (k / scale[:, None]).to(FP8), scale


@dataclass
class Case:
    kind: str  # "prefill" | "decode"
    sh: Shapes
    device: str
    q_idx: torch.Tensor  # [T, 32, 128] fp8 (decode: viewed [B, 1, 32, 128])
    w: torch.Tensor  # [T, 32] fp32
    starts: torch.Tensor  # [T] first logits column of each row's window
    ends: torch.Tensor  # [T] one past its last
    ncols: int  # logits row length
    req_id: torch.Tensor  # [T]
    block_table: torch.Tensor  # [reqs, max_blocks] int32, shuffled blocks
    q_attn: torch.Tensor  # [T, max_heads, 576] fp32 master
    kv_attn: torch.Tensor  # [pool rows, 1, 576] fp32 master (paged MLA cache)
    # prefill: gathered indexer keys; decode: paged indexer cache
    k8: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    icache: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None  # [B, 1] int32 (vLLM passes 2-D)
    memo: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.q_idx.shape[0]

    def lens(self) -> torch.Tensor:
        return (self.ends - self.starts).long()

    def valid(self) -> torch.Tensor:
        col = torch.arange(self.ncols, device=self.device)
        return (col[None] >= self.starts[:, None]) & (col[None] < self.ends[:, None])


def _block_table(ctxs, block, spare, gen, device):
    nblk = [triton.cdiv(c, block) for c in ctxs]
    pool = sum(nblk) + spare
    perm = torch.randperm(pool, generator=gen, device=device).to(torch.int32)
    bt = torch.zeros(len(ctxs), max(nblk), dtype=torch.int32, device=device)
    o = 0
    for r, n in enumerate(nblk):
        bt[r, :n] = perm[o : o + n]
        o += n
    return bt, pool


def build_prefill(sh: Shapes, device: str, seed: int = 0) -> Case:
    g = _gen(device, seed)
    t = sum(n for n, _ in sh.prefill_reqs)
    s = sum(c for _, c in sh.prefill_reqs)
    starts, ends, req = [], [], []
    off = 0
    for r, (n, c) in enumerate(sh.prefill_reqs):
        for i in range(n):  # the request's last n tokens are new
            starts.append(off)
            ends.append(off + c - n + i + 1)
            req.append(r)
        off += c
    k8, k_scale = quant_per_token(torch.randn(s, IDX_DIM, generator=g, device=device))
    bt, pool = _block_table(
        [c for _, c in sh.prefill_reqs], sh.block, sh.spare_blocks, g, device
    )

    def i32(x):
        return torch.tensor(x, dtype=torch.int32, device=device)

    return Case(
        kind="prefill",
        sh=sh,
        device=device,
        q_idx=rand_fp8((t, IDX_HEADS, IDX_DIM), g, device),
        w=torch.randn(t, IDX_HEADS, generator=g, device=device),
        starts=i32(starts),
        ends=i32(ends),
        ncols=s,
        req_id=i32(req),
        block_table=bt,
        q_attn=torch.randn(t, sh.max_heads, D_QK, generator=g, device=device),
        kv_attn=torch.randn(pool * sh.block, 1, D_QK, generator=g, device=device),
        k8=k8,
        k_scale=k_scale,
    )


def build_decode(sh: Shapes, device: str, seed: int = 1) -> Case:
    g = _gen(device, seed)
    b = sh.decode_batch
    ctx = torch.randint(1, sh.decode_max_ctx + 1, (b,), generator=g, device=device)
    fixed = torch.tensor(sh.decode_fixed_ctx, device=device)
    ctx[: fixed.numel()] = fixed
    bt, pool = _block_table(ctx.tolist(), sh.block, sh.spare_blocks, g, device)
    # Indexer cache blocks: block*128 fp8 values, then block fp32 scales.
    k8, k_scale = quant_per_token(
        torch.randn(pool * sh.block, IDX_DIM, generator=g, device=device)
    )
    icache = torch.empty(
        pool, sh.block * (IDX_DIM + 4), dtype=torch.uint8, device=device
    )
    icache[:, : sh.block * IDX_DIM] = k8.view(torch.uint8).view(pool, -1)
    icache[:, sh.block * IDX_DIM :] = k_scale.view(pool, sh.block).view(torch.uint8)
    zeros = torch.zeros(b, dtype=torch.int32, device=device)
    return Case(
        kind="decode",
        sh=sh,
        device=device,
        q_idx=rand_fp8((b, IDX_HEADS, IDX_DIM), g, device),
        w=torch.randn(b, IDX_HEADS, generator=g, device=device),
        starts=zeros,
        ends=ctx.to(torch.int32),
        ncols=sh.decode_max_ctx,
        req_id=torch.arange(b, dtype=torch.int32, device=device),
        block_table=bt,
        q_attn=torch.randn(b, sh.max_heads, D_QK, generator=g, device=device),
        kv_attn=torch.randn(pool * sh.block, 1, D_QK, generator=g, device=device),
        k8=k8,  # flat [pool * block, 128] copy, for the reference
        k_scale=k_scale,
        icache=icache.view(pool, sh.block, 1, IDX_DIM + 4),
        seq_lens=ctx.to(torch.int32)[:, None].contiguous(),
    )


# ---------------------------------------------------------------------------
# The two paths' stages
# ---------------------------------------------------------------------------


def triton_logits(c: Case) -> torch.Tensor:
    if c.kind == "prefill":
        return tdi.fp8_mqa_logits(
            c.q_idx, (c.k8, c.k_scale), c.w, c.starts, c.ends, clean_logits=False
        )
    return tdi.fp8_paged_mqa_logits(
        c.q_idx[:, None],
        c.icache,
        c.w,
        c.seq_lens,
        c.block_table,
        None,
        c.ncols,
        clean_logits=False,
    )


def deepgemm_logits(c: Case, dg) -> torch.Tensor:
    if c.kind == "prefill":
        out = dg.fp8_fp4_mqa_logits(
            (c.q_idx, None),
            (c.k8, c.k_scale),
            c.w,
            c.starts,
            c.ends,
            clean_logits=False,
        )
        return out[:, : c.ncols]
    sched = c.memo.get("dg_sched")
    if sched is None:  # built once per step in vLLM: kept out of timings
        sms = torch.cuda.get_device_properties(c.device).multi_processor_count
        sched = dg.get_paged_mqa_logits_metadata(c.seq_lens, c.sh.block, sms)
        c.memo["dg_sched"] = sched
    out = dg.fp8_fp4_paged_mqa_logits(
        (c.q_idx[:, None], None),
        c.icache,
        c.w,
        c.seq_lens,
        c.block_table,
        sched,
        c.ncols,
        clean_logits=False,
    )
    return out[:, : c.ncols]


def top_k(c: Case, logits: torch.Tensor) -> torch.Tensor:
    """Positions inside each row's window (vLLM's top_k_per_row_* output)."""
    idx = torch.full((c.rows, c.sh.topk), -7, dtype=torch.int32, device=c.device)
    if c.kind == "prefill":
        tdi.top_k_per_row_prefill(
            logits,
            c.starts,
            c.ends,
            idx,
            c.rows,
            logits.stride(0),
            logits.stride(1),
            c.sh.topk,
        )
    else:
        tdi.top_k_per_row_decode(
            logits,
            1,
            c.seq_lens,
            idx,
            c.rows,
            logits.stride(0),
            logits.stride(1),
            c.sh.topk,
        )
    return idx


def to_slots(c: Case, positions: torch.Tensor) -> torch.Tensor:
    return req_topk_to_slots(positions, c.req_id, c.block_table, c.sh.block)


def triton_attention(q, kv, slots):
    out = torch.full(
        (q.shape[0], q.shape[1], D_V), float("nan"), dtype=q.dtype, device=q.device
    )
    return sparse_mla_fwd(q, kv, slots[:, None], SM_SCALE, out=out)


def flashmla_op():
    """FlashMLA on cache slots, heads padded to a multiple of 64 on SM90."""
    raw, why = load_flashmla_sparse()
    if raw is None:
        return None, why

    def run(q, kv, slots):
        # FlashMLA wants h_q a multiple of 64 on SM90: pad as vLLM does.
        h = q.shape[1]
        qp = (
            q
            if h % 64 == 0
            else torch.cat([q, q.new_zeros(q.shape[0], 64 - h % 64, q.shape[2])], 1)
        )
        out, max_logits, lse = raw(qp, kv, slots[:, None], SM_SCALE, D_V)
        return out[:, :h], max_logits[:, :h], lse[:, :h]

    return run, None


# ---------------------------------------------------------------------------
# References and comparisons
# ---------------------------------------------------------------------------


def ref_logits(c: Case) -> torch.Tensor:
    """fp64 logits, -inf outside each row's window."""
    out = torch.full(
        (c.rows, c.ncols), float("-inf"), dtype=torch.float64, device=c.device
    )
    q, w = c.q_idx.double(), c.w.double()
    if c.kind == "prefill":
        k, ks = c.k8.double(), c.k_scale.double()
        for r0 in range(0, c.rows, 128):
            s = torch.einsum("thd,sd->ths", q[r0 : r0 + 128], k).clamp_min(0)
            out[r0 : r0 + 128] = (s * w[r0 : r0 + 128, :, None]).sum(1) * ks
    else:
        k_all = c.k8.view(-1, c.sh.block, IDX_DIM)
        s_all = c.k_scale.view(-1, c.sh.block)
        for b in range(c.rows):
            n = int(c.ends[b])
            pages = c.block_table[b, : triton.cdiv(n, c.sh.block)].long()
            k = k_all[pages].reshape(-1, IDX_DIM)[:n].double()
            ks = s_all[pages].reshape(-1)[:n].double()
            s = (q[b] @ k.T).clamp_min(0)
            out[b, :n] = (s * w[b, :, None]).sum(0) * ks
    return out.masked_fill(~c.valid(), float("-inf"))


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def selected(c: Case, positions: torch.Tensor) -> torch.Tensor:
    """[rows, ncols] mask of the chosen columns; checks the index format:
    every row lists min(len, topk) distinct positions inside its window and
    pads the rest with -1."""
    pos = positions.long()
    lens = c.lens()
    ok = pos >= 0
    assert torch.all(ok | (pos == -1)), "entries other than -1 below 0"
    assert torch.all(~ok | (pos < lens[:, None])), "position past the window"
    n_ok = ok.sum(1)
    assert torch.equal(n_ok, lens.clamp(max=c.sh.topk)), "wrong number of picks"
    col = torch.where(ok, pos + c.starts[:, None].long(), c.ncols)
    sel = torch.zeros(c.rows, c.ncols + 1, dtype=torch.bool, device=c.device)
    sel.scatter_(1, col, True)
    sel = sel[:, : c.ncols]
    assert torch.equal(sel.sum(1), n_ok), "duplicate positions"
    return sel


def topk_disagreement(c, sel_a, sel_b, ref, logit_sets) -> tuple[int, int]:
    """(rows whose sets differ, rows differing beyond ties). A differing
    position is a tie when its fp64 logit is within twice the row's largest
    logits error (of any path compared) of the row's k-th largest fp64 logit.
    Rows with at most topk keys must select the whole window, ties or not."""
    valid = c.valid()
    k = min(c.sh.topk, c.ncols)
    err = torch.zeros(c.rows, 1, dtype=torch.float64, device=c.device)
    for lg in logit_sets:
        d = torch.where(valid, (lg.double() - ref).abs(), 0.0)
        err = torch.maximum(err, d.amax(1, keepdim=True))
    scale = torch.where(valid, ref.abs(), 0.0).amax(1, keepdim=True)
    kth = torch.topk(ref, k, dim=1).values[:, -1:]
    near = (ref - kth).abs() <= 2 * err + 1e-9 * scale
    short = (c.lens() <= c.sh.topk)[:, None]
    diff = sel_a ^ sel_b
    bad = (diff & (short | ~near)).any(1)
    return int(diff.any(1).sum()), int(bad.sum())


def ref_attention(q, kv, slots):
    """fp64 (out, lse) over the given slots; -1 slots are skipped."""
    chunk = max(1, (1 << 27) // (slots.shape[1] * D_QK))
    out, _, lse = ref_sparse_mla(q, kv, slots[:, None], SM_SCALE, D_V, chunk)
    return out, lse


def record(**info) -> None:
    path = os.environ.get("SPARSE_E2E_JSON")
    print("E2E", json.dumps(info))
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(info) + "\n")


def cuda_ms(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


# ---------------------------------------------------------------------------
# Checks shared by the small and the GLM-5 runs
# ---------------------------------------------------------------------------


def indexer_stage(c: Case) -> dict:
    """Triton logits + top-k, checked against fp64; cached on the case."""
    if "triton_pos" in c.memo:
        return c.memo
    valid = c.valid()
    logits = triton_logits(c)
    ref = ref_logits(c)
    assert not logits[valid].isnan().any(), "NaN logits inside the windows"
    e = rel_err(logits[valid], ref[valid])
    assert e <= LOGITS_TOL, f"Triton logits vs fp64: {e:.3g}"
    pos = top_k(c, logits)
    sel = selected(c, pos)
    ref_sel = (
        torch.zeros_like(sel).scatter_(
            1, torch.topk(ref, min(c.sh.topk, c.ncols), dim=1).indices, True
        )
        & valid
    )
    n_diff, n_bad = topk_disagreement(c, sel, ref_sel, ref, [logits])
    # Rows shorter than topk: whole window, then -1 padding.
    short = c.lens() < c.sh.topk
    assert short.any() and (~short).any(), "case must cover both row kinds"
    assert torch.equal(sel[short], valid[short])
    assert torch.all(pos[short][:, -1] == -1)
    c.memo.update(
        triton_logits=logits,
        ref_logits=ref,
        triton_pos=pos,
        triton_sel=sel,
        logits_err=e,
        ref_diff_rows=n_diff,
        ref_bad_rows=n_bad,
    )
    assert n_bad == 0, f"{n_bad} rows' top-k differ from fp64 beyond ties"
    return c.memo


def attention_inputs(c: Case, dtype, h_q):
    key = ("inputs", dtype)
    if key not in c.memo:
        c.memo[key] = (c.q_attn.to(dtype), c.kv_attn.to(dtype))
    q_all, kv = c.memo[key]
    return q_all[:, :h_q].contiguous(), kv


def attention_ref(c: Case, dtype, slots_key: str, slots):
    """fp64 reference for all heads (a head-slice of q is a head-slice of
    the reference)."""
    key = ("ref", dtype, slots_key)
    if key not in c.memo:
        q_all, kv = c.memo[("inputs", dtype)]
        c.memo[key] = ref_attention(q_all, kv, slots)
    return c.memo[key]


def check_attention(c: Case, dtype, h_q) -> dict:
    memo = indexer_stage(c)
    slots = to_slots(c, memo["triton_pos"])
    assert torch.equal(slots >= 0, memo["triton_pos"] >= 0)
    q, kv = attention_inputs(c, dtype, h_q)
    out, _, lse = triton_attention(q, kv, slots)
    r_out, r_lse = attention_ref(c, dtype, "triton", slots)
    assert not out.isnan().any() and not lse.isnan().any(), "NaN in attention"
    e = rel_err(out, r_out[:, :h_q])
    lse_err = (lse.double() - r_lse[:, :h_q]).abs().max().item()
    info = {
        "case": c.kind,
        "dtype": str(dtype).split(".")[-1],
        "h_q": h_q,
        "rel_err_vs_fp64": e,
        "lse_abs_err": lse_err,
    }
    assert e <= TOL[dtype], f"Triton sparse MLA vs fp64: {e:.3g} > {TOL[dtype]}"
    assert lse_err <= 1e-3 * (1 + r_lse.abs().max().item())
    return info


# ---------------------------------------------------------------------------
# Small: the chain at interpreter sizes (CPU), also runs on a GPU
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_chain_small(kind):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    build = build_prefill if kind == "prefill" else build_decode
    c = build(SMALL, device, seed=11)
    check_attention(c, torch.float16, SMALL.max_heads)


# ---------------------------------------------------------------------------
# GLM-5 layer on a GPU
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["prefill", "decode"])
def glm5(request):
    """One GLM-5 case at a time (pytest groups the tests by it): the decode
    MLA pool alone is over a GB."""
    build = build_prefill if request.param == "prefill" else build_decode
    c = build(GLM5, "cuda")
    yield c
    c.memo.clear()
    del c
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_glm5_indexer_topk_vs_fp64(glm5):
    c = glm5
    memo = indexer_stage(c)
    short = c.lens() < c.sh.topk
    record(
        case=c.kind,
        stage="indexer",
        rows=c.rows,
        cols=c.ncols,
        rows_shorter_than_topk=int(short.sum()),
        logits_rel_err_vs_fp64=memo["logits_err"],
        topk_rows_differing_from_fp64=memo["ref_diff_rows"],
        topk_rows_differing_beyond_ties=memo["ref_bad_rows"],
    )


@pytest.mark.gpu
def test_glm5_indexer_topk_vs_deepgemm(glm5):
    dg, why = load_deep_gemm()
    if dg is None:
        pytest.skip(why)
    c = glm5
    memo = indexer_stage(c)
    valid = c.valid()
    lg = deepgemm_logits(c, dg)
    e = rel_err(memo["triton_logits"][valid], lg[valid])
    pos = top_k(c, lg)
    sel = selected(c, pos)
    n_diff, n_bad = topk_disagreement(
        c, memo["triton_sel"], sel, memo["ref_logits"], [memo["triton_logits"], lg]
    )
    record(
        case=c.kind,
        stage="indexer_vs_deepgemm",
        logits_rel_err=e,
        topk_rows_differing=n_diff,
        topk_rows_differing_beyond_ties=n_bad,
    )
    assert not lg[valid].isnan().any()
    assert e <= 1e-5, f"Triton vs DeepGEMM logits: {e:.3g}"
    assert n_bad == 0


@pytest.mark.gpu
@pytest.mark.parametrize("h_q", [64, 8], ids=["tp1", "tp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_glm5_sparse_path_vs_fp64(glm5, dtype, h_q):
    c = glm5
    info = check_attention(c, dtype, h_q)
    # Timings of the whole Triton path (logits, top-k, slots, attention).
    q, kv = attention_inputs(c, dtype, h_q)
    pos = c.memo["triton_pos"]
    slots = to_slots(c, pos)
    logits = c.memo["triton_logits"]
    info.update(
        ms_logits=cuda_ms(lambda: triton_logits(c)),
        ms_topk=cuda_ms(lambda: top_k(c, logits)),
        ms_slots=cuda_ms(lambda: to_slots(c, pos)),
        ms_attention=cuda_ms(lambda: sparse_mla_fwd(q, kv, slots[:, None], SM_SCALE)),
    )
    record(stage="triton_path", **info)


@pytest.mark.gpu
@pytest.mark.parametrize("h_q", [64, 8], ids=["tp1", "tp8"])
def test_glm5_sparse_path_vs_deepgemm_flashmla(glm5, h_q):
    dg, why = load_deep_gemm()
    if dg is None:
        pytest.skip(why)
    flash, why = flashmla_op()
    if flash is None:
        pytest.skip(why)
    dtype = torch.bfloat16
    c = glm5
    memo = indexer_stage(c)
    q, kv = attention_inputs(c, dtype, h_q)
    t_slots = to_slots(c, memo["triton_pos"])
    t_out, _, t_lse = triton_attention(q, kv, t_slots)
    # Same indices through FlashMLA: the attention kernels alone.
    f_out, _, f_lse = flash(q, kv, t_slots)
    same_idx_err = rel_err(t_out, f_out)
    fin = torch.isfinite(f_lse)
    assert torch.equal(fin, torch.isfinite(t_lse))
    lse_diff = (t_lse[fin] - f_lse[fin]).abs().max().item()
    # DeepGEMM's path end to end.
    lg = deepgemm_logits(c, dg)
    d_pos = top_k(c, lg)
    selected(c, d_pos)
    d_slots = to_slots(c, d_pos)
    d_out, _, _ = flash(q, kv, d_slots)
    r_out, _ = attention_ref(c, dtype, "deepgemm", d_slots)
    dg_ref_err = rel_err(d_out, r_out[:, :h_q])
    e2e_err = rel_err(t_out, d_out)
    info = {
        "case": c.kind,
        "stage": "vs_deepgemm_flashmla",
        "dtype": "bfloat16",
        "h_q": h_q,
        "flashmla_same_indices_rel_err": same_idx_err,
        "lse_max_abs_diff": lse_diff,
        "deepgemm_path_rel_err_vs_fp64": dg_ref_err,
        "triton_path_vs_deepgemm_path_rel_err": e2e_err,
    }
    info.update(
        dg_ms_logits=cuda_ms(lambda: deepgemm_logits(c, dg)),
        dg_ms_attention=cuda_ms(lambda: flash(q, kv, t_slots)),
    )
    record(**info)
    assert not d_out.isnan().any() and not f_out.isnan().any()
    assert same_idx_err <= TOL[dtype], same_idx_err
    assert lse_diff <= 1e-2, lse_diff
    assert dg_ref_err <= TOL[dtype], dg_ref_err
    assert e2e_err <= TOL[dtype], e2e_err
