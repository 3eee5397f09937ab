"""The peer loaders of tests/support/peers.py on CPU: upstream vLLM's
Triton sparse MLA and MQA logits are read from a vLLM source tree (or a
folder holding the files, or the file) with their vLLM imports stood in
for (same values), and every way of not loading them says why. Stand-in
files written here play the kernel files."""

from __future__ import annotations

import hashlib
import math
import types

import pytest
import torch

from support import peers

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
    assert "tl.store" in inspect.getsource(_kernel.fn)
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
