# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TRITON_MLA_SPARSE backend: class properties, and forward_mqa through the
real metadata builder on a paged cache, checked against an fp64 reference.

On a CPU machine the Triton kernels run in the interpreter (tests/backend's
conftest sets TRITON_INTERPRET=1) at small sizes, fp16 only (the interpreter
mis-computes bf16 dots). The `gpu` tests use GLM-5 sizes, fp16 and bf16.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.mla.triton_mla_sparse import (
    TritonMLASparseBackend,
    TritonMLASparseImpl,
    TritonMLASparseMetadata,
    TritonMLASparseMetadataBuilder,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import MLAAttentionSpec

KV_LORA_RANK = 512
ROPE_DIM = 64
HEAD_SIZE = KV_LORA_RANK + ROPE_DIM
QK_NOPE = 192  # GLM-5; never reaches the kernel
BLOCK_SIZE = 64
HAS_GPU = torch.cuda.is_available()


# ---------------------------------------------------------------- properties


def test_registered_in_enum():
    cls = AttentionBackendEnum["TRITON_MLA_SPARSE"].get_class()
    assert cls is TritonMLASparseBackend
    assert cls.get_name() == "TRITON_MLA_SPARSE"


def test_backend_properties():
    b = TritonMLASparseBackend
    assert b.is_mla() and b.is_sparse()
    assert b.supported_dtypes == [torch.float16, torch.bfloat16]
    assert not b.supports_dtype(torch.float32)
    for kv in ("auto", "float16", "bfloat16"):
        assert b.supports_kv_cache_dtype(kv)
    for kv in ("fp8", "fp8_e4m3", "fp8_ds_mla"):
        assert not b.supports_kv_cache_dtype(kv)
    assert b.get_supported_kernel_block_sizes() == [64]
    assert b.supports_block_size(64) and not b.supports_block_size(16)
    assert b.get_supported_head_sizes() == [576]
    assert b.get_builder_cls() is TritonMLASparseMetadataBuilder
    assert b.get_impl_cls() is TritonMLASparseImpl
    assert b.get_kv_cache_shape(10, 64, 1, 576) == (10, 64, 576)
    cg = TritonMLASparseMetadataBuilder.get_cudagraph_support(None, None)
    assert cg == AttentionCGSupport.UNIFORM_BATCH


@pytest.mark.parametrize(
    "cap,ok",
    [((7, 5), False), ((8, 0), True), ((8, 6), True), ((8, 9), True),
     ((9, 0), True), ((10, 0), True), ((11, 0), True), ((12, 0), True),
     ((12, 1), True)],
)  # fmt: skip
def test_compute_capability(cap, ok):
    assert (
        TritonMLASparseBackend.supports_compute_capability(DeviceCapability(*cap)) is ok
    )


def _validate(**overrides):
    args = dict(
        head_size=576,
        dtype=torch.float16,
        kv_cache_dtype="auto",
        block_size=64,
        use_mla=True,
        has_sink=False,
        use_sparse=True,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=DeviceCapability(12, 0),
        attn_type="decoder",
    )
    args.update(overrides)
    return TritonMLASparseBackend.validate_configuration(**args)


def test_validate_configuration():
    assert _validate() == []
    assert _validate(dtype=torch.bfloat16, kv_cache_dtype="bfloat16") == []
    assert _validate(kv_cache_dtype="float16") == []
    assert _validate(block_size=None) == []
    assert "sparse not supported" not in _validate()
    assert _validate(use_sparse=False) == ["non-sparse not supported"]
    assert _validate(head_size=128) == ["head_size not supported"]
    assert _validate(kv_cache_dtype="fp8") == ["kv_cache_dtype not supported"]
    assert _validate(kv_cache_dtype="bfloat16") == [
        "kv_cache_dtype must match the model dtype"
    ]
    assert _validate(device_capability=DeviceCapability(7, 5)) == [
        "compute capability not supported"
    ]


def test_impl_rejects_fp8_cache():
    with pytest.raises(NotImplementedError):
        _make_impl(4, 2, kv_cache_dtype="fp8")


# ------------------------------------------------------------------- forward


def _make_impl(num_heads, topk_buffer, kv_cache_dtype="auto"):
    return TritonMLASparseImpl(
        num_heads=num_heads,
        head_size=HEAD_SIZE,
        scale=1.0 / math.sqrt(QK_NOPE + ROPE_DIM),
        num_kv_heads=1,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype=kv_cache_dtype,
        logits_soft_cap=None,
        attn_type="decoder",
        kv_sharing_target_layer_name=None,
        q_lora_rank=None,
        kv_lora_rank=KV_LORA_RANK,
        qk_nope_head_dim=QK_NOPE,
        qk_rope_head_dim=ROPE_DIM,
        qk_head_dim=QK_NOPE + ROPE_DIM,
        v_head_dim=256,
        kv_b_proj=None,
        indexer=SimpleNamespace(topk_indices_buffer=topk_buffer),
    )


def _make_builder(topk, max_tokens, device, dtype):
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(index_topk=topk)),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_tokens),
        speculative_config=None,
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )
    spec = MLAAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=HEAD_SIZE, dtype=dtype
    )
    return TritonMLASparseMetadataBuilder(spec, ["layer.0"], vllm_config, device)


def _make_inputs(
    seq_lens, query_lens, num_heads, topk, dtype, device, seed, q_mult=1.0
):
    """A shuffled paged cache, per-request top-k positions (with empty slots,
    a duplicate, a position past the block table and one row with no valid
    index) and q; plus the fp64 reference output."""
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(seq_lens)
    blocks_per_req = [math.ceil(s / BLOCK_SIZE) for s in seq_lens]
    max_blocks = max(blocks_per_req) + 1  # one spare column, left unused
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    block_table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    nxt = 0
    for r, nb in enumerate(blocks_per_req):
        block_table[r, :nb] = perm[nxt : nxt + nb]
        nxt += nb

    cache = torch.randn(num_blocks, BLOCK_SIZE, HEAD_SIZE, generator=g)
    num_tokens = sum(query_lens)
    max_tokens = num_tokens + 5  # the indexer's buffer is larger than the batch
    topk_buf = torch.full((max_tokens, topk), -7, dtype=torch.int32)
    req_of_tok = []
    for r, (s, ql) in enumerate(zip(seq_lens, query_lens)):
        for i in range(ql):
            pos = s - ql + i  # causal: positions 0..pos are visible
            row = torch.randint(0, pos + 1, (topk,), generator=g, dtype=torch.int32)
            row[torch.rand(topk, generator=g) < 0.25] = -1  # empty slots
            row[1] = row[0]  # a duplicate
            row[2] = max_blocks * BLOCK_SIZE + 5  # past the block table
            topk_buf[len(req_of_tok)] = row
            req_of_tok.append(r)
    # A row with no valid index at all (kept out of single-token batches,
    # whose reference would then be all zeros).
    empty_rows = [num_tokens - 1] if num_tokens > 1 else []
    for t in empty_rows:
        topk_buf[t] = -1

    q = torch.randn(num_tokens, num_heads, HEAD_SIZE, generator=g) * q_mult

    # fp64 reference on the logical (unpaged) rows of each request.
    cache_d = cache.to(dtype).double().to(device)
    q_d = q.to(dtype).double().to(device)
    ref = torch.zeros(
        num_tokens, num_heads, KV_LORA_RANK, dtype=torch.float64, device=device
    )
    scale = 1.0 / math.sqrt(QK_NOPE + ROPE_DIM)
    for t in range(num_tokens):
        r = req_of_tok[t]
        pos = topk_buf[t].long()
        pos = pos[(pos >= 0) & (pos < max_blocks * BLOCK_SIZE)]
        if pos.numel() == 0:
            continue
        phys = block_table[r].long()[pos // BLOCK_SIZE]
        rows = cache_d[phys.to(device), (pos % BLOCK_SIZE).to(device)]  # [n, 576]
        s = (q_d[t] @ rows.T) * scale
        ref[t] = torch.softmax(s, dim=-1) @ rows[:, :KV_LORA_RANK]

    return SimpleNamespace(
        seq_lens=seq_lens,
        query_lens=query_lens,
        num_tokens=num_tokens,
        max_tokens=max_tokens,
        topk=topk,
        req_of_tok=req_of_tok,
        block_table=block_table.to(device),
        cache=cache.to(dtype=dtype, device=device),
        topk_buf=topk_buf.to(device),
        q=q.to(dtype=dtype, device=device),
        ref=ref,
        empty_rows=empty_rows,
    )


def _build_metadata(x, dtype, device):
    qsl = torch.tensor([0] + list(x.query_lens)).cumsum(0).to(torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(x.seq_lens, dtype=torch.int32, device=device),
        num_reqs=len(x.seq_lens),
        num_actual_tokens=x.num_tokens,
        max_query_len=max(x.query_lens),
        max_seq_len=max(x.seq_lens),
        block_table_tensor=x.block_table,
        slot_mapping=torch.zeros(x.num_tokens, dtype=torch.int64, device=device),
    )
    builder = _make_builder(x.topk, x.max_tokens, device, dtype)
    md = builder.build(common_prefix_len=0, common_attn_metadata=cm)
    assert isinstance(md, TritonMLASparseMetadata)
    assert md.req_id_per_token.tolist() == x.req_of_tok
    return md


def _forward(impl, x, md):
    # The MLA layer hands q over as (ql_nope, q_pe), ql_nope being a
    # transposed bmm output.
    ql_nope = x.q[..., :KV_LORA_RANK].transpose(0, 1).contiguous().transpose(0, 1)
    q_pe = x.q[..., KV_LORA_RANK:]
    out, lse = impl.forward_mqa((ql_nope, q_pe), x.cache, md, layer=None)
    assert lse is None
    return out


def _run_case(seq_lens, query_lens, num_heads, topk, dtype, device, seed, q_mult=1.0):
    """forward_mqa with metadata from the builder; returns (out, ref, rows
    with no valid index)."""
    x = _make_inputs(seq_lens, query_lens, num_heads, topk, dtype, device, seed, q_mult)
    md = _build_metadata(x, dtype, device)
    impl = _make_impl(num_heads, x.topk_buf)
    return _forward(impl, x, md), x.ref, x.empty_rows


def _check(out, ref, empty_rows, tol):
    assert out.shape == ref.shape
    out = out.double()
    assert torch.isfinite(out).all()
    for t in empty_rows:
        assert torch.equal(out[t], torch.zeros_like(out[t]))
    assert ref.norm() > 0
    err = (out - ref).norm() / ref.norm()
    print(f"relative error {err:.3e} (tolerance {tol})")
    assert err < tol, f"relative error {err:.3e} >= {tol}"


# (seq_lens, query_lens, heads, topk): a decode, a chunked prefill, and a
# short request in one batch; topk 100 is not a multiple of any block.
CPU_CASES = [
    ([70, 100, 20], [1, 3, 2], 3, 100),
    ([130, 9], [1, 2], 8, 128),
]


@pytest.mark.skipif(HAS_GPU, reason="interpreter (CPU) variant")
@pytest.mark.parametrize("case", CPU_CASES, ids=["h3-topk100", "h8-topk128"])
def test_forward_mqa_cpu(case):
    seq_lens, query_lens, heads, topk = case
    out, ref, empty = _run_case(
        seq_lens, query_lens, heads, topk, torch.float16, torch.device("cpu"), 0
    )
    assert out.dtype == torch.float16
    _check(out, ref, empty, 2e-3)


@pytest.mark.skipif(HAS_GPU, reason="interpreter (CPU) variant")
def test_forward_mqa_cpu_large_logits():
    out, ref, empty = _run_case(
        [90, 40], [1, 1], 4, 64, torch.float16, torch.device("cpu"), 1, q_mult=30.0
    )
    _check(out, ref, empty, 2e-3)


GPU_CASES = [
    # decode batch (split path), mixed batch, prefill-heavy batch
    ([3000, 4100, 2500, 700], [1, 1, 1, 1], 64, 2048),
    ([5000, 2200, 300], [1, 64, 17], 16, 2048),
    ([4096, 9000], [512, 300], 128, 2048),
    ([1000, 64], [8, 8], 8, 2048),
    ([3000, 2000], [1, 40], 32, 2000),  # torch slot conversion
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"h{c[2]}-topk{c[3]}")
def test_forward_mqa_gpu(case, dtype):
    seq_lens, query_lens, heads, topk = case
    out, ref, empty = _run_case(
        seq_lens, query_lens, heads, topk, dtype, torch.device("cuda"), 2
    )
    assert out.dtype == dtype
    _check(out, ref, empty, 2e-3 if dtype == torch.float16 else 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_decodes,heads", [(1, 64), (8, 16), (32, 8)])
def test_forward_mqa_cuda_graph_decode(num_decodes, heads, dtype):
    """A uniform decode batch captured once and replayed on new data (new q,
    cache, block table and top-k) gives the new reference."""
    device = torch.device("cuda")
    seq_lens = [700 + 311 * i for i in range(num_decodes)]
    query_lens = [1] * num_decodes
    a = _make_inputs(seq_lens, query_lens, heads, 2048, dtype, device, 10)
    b = _make_inputs(seq_lens, query_lens, heads, 2048, dtype, device, 11)
    md = _build_metadata(a, dtype, device)
    impl = _make_impl(heads, a.topk_buf)

    _forward(impl, a, md)  # warm-up: compiles, caches the SM count
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _forward(impl, a, md)
    # New data in the captured buffers, then replay.
    for name in ("q", "cache", "topk_buf", "block_table"):
        getattr(a, name).copy_(getattr(b, name))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, b.ref, b.empty_rows, 2e-3 if dtype == torch.float16 else 1e-2)
