# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's Marlin ops on the CPU, from vLLM's Python reference of Marlin's
layout (marlin_utils_test, which vLLM's kernel tests hold the CUDA ops to):
gptq_marlin_repack as that reference packs, marlin_gemm as the product
of the weight and scales read back through the inverse of its
permutations (tests only: the code under test stays vLLM's own)."""

from __future__ import annotations

import types

import torch


def marlin_repack(packed: torch.Tensor, perm: torch.Tensor, size_k: int, size_n: int,
                  bits: int) -> torch.Tensor:
    """ops.gptq_marlin_repack: marlin_utils_test.marlin_weights of the
    GPTQ-packed operand."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import (
        get_weight_perm,
        marlin_weights,
    )

    assert perm.numel() == 0
    mask = (1 << bits) - 1
    q = torch.stack([(packed >> (bits * j)) & mask for j in range(32 // bits)], 1)
    return marlin_weights(q.reshape(size_k, size_n), size_k, size_n, bits,
                          get_weight_perm(bits))


def _sources(permute, shape: tuple[int, int]) -> torch.Tensor:
    """The index each position of a permuted [rows, cols] tensor comes from."""
    idx = torch.arange(shape[0] * shape[1], dtype=torch.int64).view(shape)
    return permute(idx).reshape(-1)


class MarlinGemm:
    """ops.marlin_gemm for Marlin weights of group size 32, no act order,
    zero points 0: (q - the type's bias) * the group's scale, in fp64, the
    output in a's dtype. Records each call's size_m."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, a, c, w, bias, s, a_scales, global_scale, zeros, g_idx, perm,
                 workspace, b_q_type, size_m, size_n, size_k, is_k_full=True,
                 use_atomic_add=False, use_fp32_reduce=False, is_zp_float=False):
        from vllm.model_executor.layers.quantization.utils.marlin_utils import (
            marlin_permute_scales,
        )
        from vllm.model_executor.layers.quantization.utils.marlin_utils_test import (
            get_weight_perm,
            marlin_permute_weights,
        )

        assert c is None and bias is None and g_idx is None and perm is None
        assert a_scales is None and global_scale is None
        assert a.shape == (size_m, size_k) and is_k_full and not is_zp_float
        # the dense kernel's thread configurations (k, n): (128, 128), (64, 128),
        # (128, 64), (64, 256); none other runs ("Invalid thread config")
        if not (size_n % 128 == 0 and size_k % 64 == 0
                or size_n % 64 == 0 and size_k % 128 == 0):
            raise RuntimeError(f"Invalid thread config for MKN = [{size_m}, {size_n}, {size_k}]")
        bits = b_q_type.size_bits
        self.calls.append(size_m)
        # the words' values in permuted order, low bits first
        vals = torch.stack([(w >> (bits * j)) & ((1 << bits) - 1)
                            for j in range(32 // bits)], -1).reshape(-1)
        q = torch.empty(size_k * size_n, dtype=torch.int64)
        q[_sources(lambda t: marlin_permute_weights(t, size_k, size_n, get_weight_perm(bits)),
                   (size_k, size_n))] = vals.long()
        groups = size_k // 32
        assert s.shape == (groups, size_n)
        scales = torch.empty(groups * size_n, dtype=torch.float64)
        scales[_sources(lambda t: marlin_permute_scales(t, size_k, size_n, 32),
                        (groups, size_n))] = s.reshape(-1).double()
        if zeros is not None:
            assert not zeros.any(), "zero points other than 0"
        weight = (q.view(size_k, size_n).double() - b_q_type.bias) * (
            scales.view(groups, size_n).repeat_interleave(32, 0))
        return (a.double() @ weight).to(a.dtype)


def install_for_linears(monkeypatch, mod) -> MarlinGemm:
    """gguf_marlin_linear (``mod``) on these ops, as on a CUDA GPU with its
    tensors on the CPU, VLLM_GGUF_MARLIN_LINEARS at its default (on);
    returns the GEMM."""
    from vllm.model_executor.layers.quantization.utils import marlin_utils

    gemm = MarlinGemm()
    monkeypatch.setattr(mod.ops, "gptq_marlin_repack", marlin_repack)
    monkeypatch.setattr(mod.ops, "marlin_gemm", gemm)
    monkeypatch.setattr(marlin_utils, "marlin_make_workspace_new",
                        lambda device, blocks=1: torch.zeros(4, dtype=torch.int32))
    monkeypatch.setattr(mod, "_on_gpu", lambda qweight: True)
    # the op's Python body: the registered op runs on the dispatch key of the
    # platform its module was first imported under (CUDA where a test stood in
    # for one), not on the CPU tensors here
    monkeypatch.setattr(mod, "mul_mat_gguf_marlin", mod._mul_mat_gguf_marlin)
    monkeypatch.setattr(mod, "_has_marlin", lambda: True)
    platform = types.SimpleNamespace(is_cuda=lambda: True,
                                     has_device_capability=lambda capability: True)
    monkeypatch.setattr(mod, "current_platform", platform)
    monkeypatch.delenv("VLLM_GGUF_MARLIN_LINEARS", raising=False)
    monkeypatch.delenv("VLLM_GGUF_KERNELS", raising=False)
    return gemm
