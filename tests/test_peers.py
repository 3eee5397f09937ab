"""The peer loaders of tests/support/peers.py on CPU: upstream vLLM's
Triton sparse MLA and MQA logits, and PR 54929's Triton sparse MLA with the
kernels of main it imports, are read from a vLLM source tree (or a folder
holding the files, or the file) with their vLLM imports stood in for (same
values), and every way of not loading them says why. Stand-in files written
here play the kernel files. The fp8_ds_mla packer round-trips; PR 54929's
own kernels run against the fp64 reference where $VLLM_PR54929_SRC names
them (in Triton's interpreter without a GPU)."""

from __future__ import annotations

import hashlib
import math
import os
import struct
import types

import pytest
import torch
import triton
import triton.language as tl

from support import peers
from support.sparse_mla_ref import ref_sparse_mla

STAND_IN = '''
import inspect

import torch

from vllm.triton_utils import LOG2E, LOGE2, tl, triton
from vllm.utils.platform_utils import num_compute_units


@triton.jit
def _kernel(x_ptr, BLOCK: tl.constexpr):  # Triton reads its source from the file
    tl.store(x_ptr + tl.arange(0, BLOCK), 1.0)


def triton_sparse_mla_attention(q, kv, indices, sm_scale, num_kv_splits=None,
                                sm_count=None):
    # a JITFunction (.fn), or the function itself under vllm.triton_utils' placeholder
    assert "tl.store" in inspect.getsource(getattr(_kernel, "fn", _kernel))
    return {"scale": sm_scale * LOG2E, "loge2": LOGE2, "sm_count": sm_count,
            "units": num_compute_units(0), "tl": tl.__name__, "triton": triton.__name__}
'''


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(multi_processor_count=188))


MQA_STAND_IN = '''
import torch

from vllm.triton_utils import tl, triton


def fp8_mqa_logits_triton(q, kv, weights, ks, ke):
    return ("prefill", q, kv, weights, ks, ke, tl.__name__)


def fp8_paged_mqa_logits_triton(q, kv_cache, weights, context_lens, block_tables,
                                max_model_len):
    return ("paged", q, tuple(kv_cache.shape), weights, context_lens, block_tables,
            max_model_len)
'''


def write_tree(root, text=STAND_IN, rel=peers.VLLM_TRITON_SPARSE_MLA):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_vllm_triton_sparse_mla_loads_from_a_checkout_with_its_imports_stood_in(
        tmp_path, fake_gpu):
    write_tree(tmp_path)
    op, why = peers.load_vllm_triton_sparse_mla(str(tmp_path))
    assert why is None
    assert op.sha256 == hashlib.sha256(STAND_IN.encode()).hexdigest()
    got = op("q", "kv", "idx", 0.5)
    assert got == {"scale": 0.5 * math.log2(math.e), "loge2": math.log(2.0), "sm_count": 188,
                   "units": 188, "tl": "triton.language", "triton": "triton"}


def test_vllm_triton_sparse_mla_from_the_file_a_folder_or_the_environment(
        tmp_path, fake_gpu, monkeypatch):
    path = write_tree(tmp_path)
    assert peers.load_vllm_triton_sparse_mla(str(path))[1] is None
    assert peers.load_vllm_triton_sparse_mla(str(path.parent))[1] is None
    monkeypatch.setenv("VLLM_MAIN_SRC", str(tmp_path))
    assert peers.load_vllm_triton_sparse_mla()[1] is None
    # the other peer's file is not this one
    op, why = peers.load_vllm_triton_mqa_logits(str(path))
    assert op is None and "is neither a folder nor mqa_logits_triton.py" in why


def test_vllm_triton_mqa_logits_takes_deep_gemms_arguments(tmp_path, fake_gpu):
    write_tree(tmp_path, MQA_STAND_IN, peers.VLLM_TRITON_MQA_LOGITS)
    peer, why = peers.load_vllm_triton_mqa_logits(str(tmp_path))
    assert why is None
    assert peer.sha256 == hashlib.sha256(MQA_STAND_IN.encode()).hexdigest()
    assert peer.prefill("q", "k8", "sc", "w", "ks", "ke") == (
        "prefill", "q", ("k8", "sc"), "w", "ks", "ke", "triton.language")
    cache = torch.zeros(3, 64, 132, dtype=torch.uint8)
    assert peer.paged("q", cache, "w", "ctx", "bt", 4096) == (
        "paged", "q", (3, 64, 1, 132), "w", "ctx", "bt", 4096)


def test_vllm_triton_sparse_mla_says_why_not(tmp_path, fake_gpu, monkeypatch):
    monkeypatch.delenv("VLLM_MAIN_SRC", raising=False)
    assert "no source given" in peers.load_vllm_triton_sparse_mla()[1]
    op, why = peers.load_vllm_triton_sparse_mla(str(tmp_path))
    assert op is None and why.endswith(f"{tmp_path / peers.VLLM_TRITON_SPARSE_MLA} not found")
    # another version of the file: an import it no longer has is named
    write_tree(tmp_path, STAND_IN.replace("LOG2E, LOGE2, tl, triton", "tl, triton"))
    op, why = peers.load_vllm_triton_sparse_mla(str(tmp_path))
    assert op is None
    assert "from vllm.triton_utils import LOG2E, LOGE2, tl, triton" in why


def test_vllm_triton_sparse_mla_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peers.load_vllm_triton_sparse_mla("anywhere") == (
        None, "vLLM's Triton sparse MLA needs a CUDA GPU")


PR_STAND_IN = '''
import torch

from vllm.triton_utils import tl, triton
from vllm.v1.attention.backends.mla.sparse_mla_kernels import (
    accumulate_indexed_sparse_mla_attention_chunk,
    finish_sparse_mla_attention_with_sink,
)


def flash_mla_sparse_fwd_triton(q, kv, indices, sm_scale, d_v=512, attn_sink=None,
                                topk_length=None, out=None):
    return (("prefill", q, kv, indices, sm_scale, d_v,
             accumulate_indexed_sparse_mla_attention_chunk()), None, None)


def flash_mla_with_kvcache_triton(q, k_cache, block_table, cache_seqlens=None,
                                  head_dim_v=512, tile_scheduler_metadata=None,
                                  num_splits=None, softmax_scale=None, causal=False,
                                  is_fp8_kvcache=False, indices=None, **kwargs):
    assert is_fp8_kvcache and block_table is None and not kwargs
    CALLS.append((tuple(q.shape), tuple(k_cache.shape), tuple(indices.shape),
                  finish_sparse_mla_attention_with_sink()))
    return torch.full((*q.shape[:3], head_dim_v), softmax_scale), None


CALLS = []
'''

PR_KERNELS_STAND_IN = '''
import inspect

import torch

from vllm.triton_utils import tl, triton
from vllm.utils.math_utils import next_power_of_2
from vllm.v1.attention.backends.mla.sparse_mla_env import (
    triton_sparse_mla_head_block_size,
)


@triton.jit
def _kernel(x_ptr, BLOCK: tl.constexpr):  # Triton reads its source from the file
    tl.store(x_ptr + tl.arange(0, BLOCK), 1.0)


def accumulate_indexed_sparse_mla_attention_chunk():
    # a JITFunction (.fn), or the function itself under vllm.triton_utils' placeholder
    assert "tl.store" in inspect.getsource(getattr(_kernel, "fn", _kernel))
    return triton_sparse_mla_head_block_size(), next_power_of_2(5)


def finish_sparse_mla_attention_with_sink():
    return "finish"
'''


def write_pr(root, attn=PR_STAND_IN, kernels=PR_KERNELS_STAND_IN, tree=True):
    """The two files in a vLLM tree under ``root``, or side by side in it."""
    paths = []
    for rel, text in ((peers.PR54929_ATTN, attn), (peers.PR54929_KERNELS, kernels)):
        if text is None:
            continue
        path = root / (rel if tree else os.path.basename(rel))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        paths.append(path)
    return paths


def test_pr54929_loads_from_a_checkout_with_its_imports_stood_in(
        tmp_path, fake_gpu, monkeypatch):
    write_pr(tmp_path)
    monkeypatch.setenv("VLLM_TRITON_MLA_SPARSE_HEAD_BLOCK_SIZE", "4")
    peer, why = peers.load_pr54929_sparse_mla(str(tmp_path))
    assert why is None
    assert peer.sha256 == {
        "sm12x_sparse_mla_attn.py": hashlib.sha256(PR_STAND_IN.encode()).hexdigest(),
        "sparse_mla_kernels.py": hashlib.sha256(PR_KERNELS_STAND_IN.encode()).hexdigest()}
    q, kv = torch.zeros(3, 8, 576), torch.zeros(100, 1, 576)
    cache, idx = torch.zeros(100, 656, dtype=torch.uint8), torch.zeros(3, 1, 64)
    # each token a request of one query, the cache blocks of one token
    out = peer.fp8(q, cache, idx, 0.25)
    assert out.shape == (3, 8, 512) and (out == 0.25).all()
    assert peer.module.CALLS == [((3, 1, 8, 576), (100, 1, 1, 656), (3, 1, 64), "finish")]
    # the kernels' knob module stood in for: the same variable, read the same way
    assert peer.bf16(q, kv, idx, 0.5) == ("prefill", q, kv, idx, 0.5, 512, (4, 8))
    monkeypatch.setenv("VLLM_TRITON_MLA_SPARSE_HEAD_BLOCK_SIZE", "3")
    assert peer.bf16(q, kv, idx, 0.5)[-1] == (None, 8)


def test_pr54929_from_a_folder_the_file_or_the_environment(tmp_path, fake_gpu, monkeypatch):
    attn, _ = write_pr(tmp_path, tree=False)
    assert peers.load_pr54929_sparse_mla(str(tmp_path))[1] is None
    # the file: main's kernels beside it
    assert peers.load_pr54929_sparse_mla(str(attn))[1] is None
    monkeypatch.setenv("VLLM_PR54929_SRC", str(tmp_path))
    assert peers.load_pr54929_sparse_mla()[1] is None


def test_pr54929_says_why_not(tmp_path, fake_gpu, monkeypatch):
    monkeypatch.delenv("VLLM_PR54929_SRC", raising=False)
    assert "no source given" in peers.load_pr54929_sparse_mla()[1]
    peer, why = peers.load_pr54929_sparse_mla(str(tmp_path))
    assert peer is None and why.endswith(f"{tmp_path / peers.PR54929_ATTN} not found")
    # the PR's file without main's kernels beside it
    (attn,) = write_pr(tmp_path / "alone", kernels=None, tree=False)
    peer, why = peers.load_pr54929_sparse_mla(str(attn))
    assert peer is None and why.endswith(f"{tmp_path / 'alone' / peers.PR54929_KERNELS} not found")
    # another version of a file: the import it no longer has is named
    write_pr(tmp_path / "other", kernels=PR_KERNELS_STAND_IN.replace("sparse_mla_env", "knobs"))
    peer, why = peers.load_pr54929_sparse_mla(str(tmp_path / "other"))
    assert peer is None and "sparse_mla_kernels.py" in why
    assert "from vllm.v1.attention.backends.mla.sparse_mla_env import (" in why
    # an import of vLLM that 0.23 lacks and nothing stands in for
    write_pr(tmp_path / "newer", attn="from vllm.v1.attention.ops.not_in_023 import f\n"
             + PR_STAND_IN)
    peer, why = peers.load_pr54929_sparse_mla(str(tmp_path / "newer"))
    assert peer is None and "sm12x_sparse_mla_attn.py" in why and "not_in_023" in why


def test_pr54929_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peers.load_pr54929_sparse_mla("anywhere") == (
        None, "PR 54929's Triton sparse MLA needs a CUDA GPU")


def test_fp8_ds_mla_packs_what_vllms_cache_kernel_writes():
    gen = torch.Generator().manual_seed(0)
    kv = (torch.randn(37, 1, 576, generator=gen) * torch.logspace(-3, 3, 37)[:, None, None])
    kv[5, 0, 128:256] = 0  # an all-zero tile: the scale is FLT_MIN, not 0
    kv = kv.to(torch.bfloat16)
    cache = peers.pack_fp8_ds_mla(kv)
    assert cache.dtype == torch.uint8 and cache.shape == (37, peers.FP8_DS_MLA_BYTES)
    x = kv[:, 0].float()
    # the 4 fp32 scales, little-endian at byte 512: amax of each 128 over 448
    amax = x[:, :512].abs().view(37, 4, 128).amax(-1)
    scales = torch.tensor([struct.unpack("<4f", bytes(r[512:528].tolist())) for r in cache])
    want = (amax / 448).clamp_min(torch.finfo(torch.float32).tiny)
    assert torch.equal(scales, want)
    # the RoPE values bf16 as they were, at byte 528
    assert torch.equal(cache[:, 528:].contiguous().view(torch.bfloat16), kv[:, 0, 512:])
    # each NoPE byte the e4m3 value of x / its scale
    assert cache[7, 300].item() == (x[7, 300] / want[7, 2]).to(torch.float8_e4m3fn).view(
        torch.uint8).item()
    back = peers.unpack_fp8_ds_mla(cache)
    assert back.shape == (37, 1, 576) and torch.equal(back[:, 0, 512:], x[:, 512:])
    # within e4m3's rounding: half an ulp (3 mantissa bits), or of its
    # smallest subnormal (2^-9) near zero, times the scale
    err = (back[:, 0, :512] - x[:, :512]).abs().view(37, 4, 128)
    bound = torch.maximum(x[:, :512].abs().view(37, 4, 128) * 2**-4,
                          want[..., None] * 2**-10) * 1.0001
    assert (err <= bound).all()
    assert torch.equal(back[5, 0, 128:256], torch.zeros(128))
    with pytest.raises(ValueError, match="bf16"):
        peers.pack_fp8_ds_mla(kv.half())


@triton.jit
def _bf16_dot_probe(a_ptr, o_ptr):
    r = tl.arange(0, 16)
    a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
    tl.store(o_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, a))


def bf16_dots_right(device) -> bool:
    a = torch.eye(16, dtype=torch.bfloat16, device=device) * 2
    o = torch.empty(16, 16, device=device)
    _bf16_dot_probe[(1,)](a, o)
    return torch.equal(o.cpu(), torch.eye(16) * 4)


@pytest.fixture
def pr54929(monkeypatch):
    """(PR 54929's file loaded from $VLLM_PR54929_SRC, device): on the GPU,
    else in Triton's interpreter on CPU."""
    src = os.environ.get("VLLM_PR54929_SRC")
    if not src:
        pytest.skip("VLLM_PR54929_SRC names no PR 54929 source to run")
    if torch.cuda.is_available():
        device = "cuda"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        device = "cpu"
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    else:
        pytest.skip("no GPU, and Triton's interpreter is off")
    peer, why = peers.load_pr54929_sparse_mla(src)
    assert why is None, why
    return peer.module, device


# its scalar `if` on a loaded value: numpy's warning in the interpreter
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
@pytest.mark.parametrize("path", ["materialized", "fused"])
def test_pr54929_fp8_kernels_against_fp64(pr54929, path):
    """Its fp8_ds_mla decode kernels (the fused one the op runs, and the
    gather-then-attend one of VLLM_SPARSE_MLA_FUSED=0) over a cache packed
    here: against the fp64 reference of the dequantized cache (the kernel),
    and of the bf16 KV (the kernel and the fp8 quantization)."""
    module, device = pr54929
    if path == "fused" and not bf16_dots_right(device):
        pytest.skip("the fused kernel's dots are bf16, which this Triton's "
                    "interpreter gets wrong")
    gen = torch.Generator().manual_seed(1)
    t, h, k, rows, scale = 3, 16, 64, 200, 576**-0.5
    kv = torch.randn(rows, 1, 576, generator=gen).to(torch.bfloat16)
    q = torch.randn(t, h, 576, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(rows, generator=gen)[:k] for _ in range(t)])
    idx = idx.to(torch.int32)
    idx[0, 5], idx[1, 7], idx[2, 40:] = -1, rows + 3, -1  # skipped: < 0, >= rows
    cache = peers.pack_fp8_ds_mla(kv)
    q_d, cache_d, idx_d = q.to(device), cache.to(device), idx.to(device)
    max_score = torch.full((t, h), float("-inf"), device=device)
    denom = torch.zeros(t, h, device=device)
    acc = torch.zeros(t, h, 576, device=device)
    if path == "fused":
        lens = torch.full((t,), k, dtype=torch.int32, device=device)
        module._fused_gather_dequant_attend(q_d, cache_d, idx_d, lens, scale, max_score,
                                            denom, acc)
    else:
        gathered, valid = module._gather_dequant_fp8ds(cache_d, idx_d)
        module._materialized_indexed_accumulate(q_d, gathered, valid, scale, max_score,
                                                denom, acc)
    out = (acc[..., :512] / denom[..., None]).cpu().double()
    lse = (max_score + denom.log()).cpu().double()
    for kv_ref, tol in ((peers.unpack_fp8_ds_mla(cache), 1e-2), (kv, 6e-2)):
        r_out, _, r_lse = ref_sparse_mla(q, kv_ref, idx[:, None], scale)
        assert ((out - r_out).norm() / r_out.norm()).item() < tol
        assert (lse - r_lse).abs().max().item() < tol
