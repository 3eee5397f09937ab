# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Backend selection for sparse MLA (DSA) models on CUDA, capabilities mocked.

Runs on a machine without a GPU: the CUDA platform is used through vLLM's own
selector entry point (`get_attn_backend`) with `get_device_capability`
patched, as vLLM's tests/kernels/attention/test_attention_selector.py does.
"""

from unittest.mock import patch

import pytest
import torch
from vllm.config import (
    AttentionConfig,
    CacheConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import _cached_get_attn_backend, get_attn_backend

from support.cuda_without_gpu import CudaPlatform, cuda_platform_mod, get_class_without_gpu

MLA_HEAD_SIZE = 576  # kv_lora_rank 512 + rope 64


@pytest.fixture(autouse=True)
def _clear_selector_cache():
    _cached_get_attn_backend.cache_clear()
    yield
    _cached_get_attn_backend.cache_clear()


@pytest.fixture(autouse=True)
def _backends_importable_without_gpu(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setattr(AttentionBackendEnum, "get_class", get_class_without_gpu)


def _select(
    capability: tuple[int, int],
    dtype: torch.dtype,
    use_sparse: bool,
    kv_cache_dtype: str | None = "auto",
    backend: str | None = None,
    num_heads: int | None = 64,
    block_size: int | None = None,
) -> str:
    attention_config = AttentionConfig(
        backend=AttentionBackendEnum[backend] if backend else None
    )
    cache_config = (
        CacheConfig(block_size=block_size) if block_size is not None else CacheConfig()
    )
    cap = DeviceCapability(*capability)
    with (
        patch("vllm.platforms.current_platform", CudaPlatform()),
        patch.object(CudaPlatform, "get_device_capability", return_value=cap),
    ):
        vllm_config = VllmConfig(
            attention_config=attention_config, cache_config=cache_config
        )
        with set_current_vllm_config(vllm_config):
            return get_attn_backend(
                MLA_HEAD_SIZE,
                dtype,
                kv_cache_dtype,
                use_mla=True,
                use_sparse=use_sparse,
                num_heads=num_heads,
            ).get_name()


def _is_importable(enum_name: str) -> bool:
    try:
        AttentionBackendEnum[enum_name].get_class()
    except ImportError:
        return False
    return True


# (capability, dtype) -> backend chosen for a sparse (DSA) model, KV cache auto.
# SM10x fp16 goes to FLASHINFER_MLA_SPARSE when FlashInfer is installed (it
# accepts fp16); every other non-bf16-SM9x/SM10x case falls to the Triton one.
SPARSE_EXPECTED = {
    ((12, 0), torch.float16): "TRITON_MLA_SPARSE",
    ((12, 0), torch.bfloat16): "TRITON_MLA_SPARSE",
    ((12, 1), torch.float16): "TRITON_MLA_SPARSE",
    ((12, 1), torch.bfloat16): "TRITON_MLA_SPARSE",
    ((10, 0), torch.bfloat16): "FLASHMLA_SPARSE",
    ((10, 0), torch.float16): "FLASHINFER_MLA_SPARSE",
    ((9, 0), torch.bfloat16): "FLASHMLA_SPARSE",
    ((9, 0), torch.float16): "TRITON_MLA_SPARSE",
    ((8, 0), torch.float16): "TRITON_MLA_SPARSE",
    ((8, 0), torch.bfloat16): "TRITON_MLA_SPARSE",
    ((8, 9), torch.float16): "TRITON_MLA_SPARSE",
}


@pytest.mark.parametrize(
    "capability,dtype",
    list(SPARSE_EXPECTED),
    ids=[f"sm{c[0]}{c[1]}-{str(d).split('.')[-1]}" for c, d in SPARSE_EXPECTED],
)
def test_sparse_autoselect(capability, dtype):
    expected = SPARSE_EXPECTED[(capability, dtype)]
    if expected == "FLASHINFER_MLA_SPARSE" and not _is_importable(expected):
        expected = "TRITON_MLA_SPARSE"
    assert _select(capability, dtype, use_sparse=True) == expected


@pytest.mark.parametrize("capability", [(12, 0), (12, 1), (10, 0), (9, 0), (8, 0)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dense_mla_never_picks_sparse(capability, dtype):
    name = _select(capability, dtype, use_sparse=False)
    assert name != "TRITON_MLA_SPARSE"
    assert not AttentionBackendEnum[name].get_class().is_sparse()


@pytest.mark.parametrize("capability", [(12, 0), (12, 1), (9, 0), (8, 0), (10, 0)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_explicit_backend(capability, dtype):
    """`--attention-backend TRITON_MLA_SPARSE` works on every supported GPU."""
    name = _select(capability, dtype, use_sparse=True, backend="TRITON_MLA_SPARSE")
    assert name == "TRITON_MLA_SPARSE"


@pytest.mark.parametrize("capability", [(12, 0), (8, 0)])
def test_explicit_backend_with_block_size_64(capability):
    name = _select(
        capability,
        torch.float16,
        use_sparse=True,
        backend="TRITON_MLA_SPARSE",
        block_size=64,
    )
    assert name == "TRITON_MLA_SPARSE"


def test_explicit_backend_rejects_sm75():
    with pytest.raises(ValueError, match="compute capability not supported"):
        _select((7, 5), torch.float16, use_sparse=True, backend="TRITON_MLA_SPARSE")


def test_no_valid_backend_lists_triton_reason_sm75():
    with pytest.raises(ValueError) as exc:
        _select((7, 5), torch.float16, use_sparse=True)
    msg = str(exc.value)
    assert "No valid attention backend" in msg
    assert "TRITON_MLA_SPARSE: [compute capability not supported]" in msg


def test_no_valid_backend_lists_triton_reason_fp8_kv_sm120():
    with pytest.raises(ValueError) as exc:
        _select((12, 0), torch.float16, use_sparse=True, kv_cache_dtype="fp8")
    assert "TRITON_MLA_SPARSE: [kv_cache_dtype not supported]" in str(exc.value)


def test_no_valid_backend_lists_triton_reason_fp32_sm120():
    with pytest.raises(ValueError) as exc:
        _select((12, 0), torch.float32, use_sparse=True)
    assert "TRITON_MLA_SPARSE: [dtype not supported]" in str(exc.value)


def test_mismatched_cache_dtype_rejected():
    with pytest.raises(ValueError) as exc:
        _select((12, 0), torch.float16, use_sparse=True, kv_cache_dtype="bfloat16")
    assert "kv_cache_dtype must match the model dtype" in str(exc.value)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_fp16_cache_dtypes_accepted_sm120(kv_cache_dtype):
    name = _select((12, 0), torch.float16, True, kv_cache_dtype=kv_cache_dtype)
    assert name == "TRITON_MLA_SPARSE"


def test_sm120_priority_list_contains_triton_sparse():
    prio = cuda_platform_mod._get_backend_priorities(
        True, DeviceCapability(12, 0), 64, "auto"
    )
    assert AttentionBackendEnum.TRITON_MLA_SPARSE in prio
