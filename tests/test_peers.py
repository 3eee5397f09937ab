"""The peer loaders of tests/support/peers.py on CPU: upstream vLLM's
Triton sparse MLA is read from a vLLM source tree with its two vLLM
imports stood in for (same values), and every way of not loading it says
why. A stand-in file written here plays the kernel file."""

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


def write_tree(root, text=STAND_IN):
    path = root / peers.VLLM_TRITON_SPARSE_MLA
    path.parent.mkdir(parents=True)
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


def test_vllm_triton_sparse_mla_from_the_file_or_the_environment(tmp_path, fake_gpu,
                                                                  monkeypatch):
    path = write_tree(tmp_path)
    assert peers.load_vllm_triton_sparse_mla(str(path))[1] is None
    monkeypatch.setenv("VLLM_TRITON_SPARSE_MLA", str(tmp_path))
    assert peers.load_vllm_triton_sparse_mla()[1] is None


def test_vllm_triton_sparse_mla_says_why_not(tmp_path, fake_gpu, monkeypatch):
    monkeypatch.delenv("VLLM_TRITON_SPARSE_MLA", raising=False)
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
