# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fp64 DSA indexer logits reference, used by the indexer tests and
its benchmark."""

from __future__ import annotations

import torch


def ref_logits(
    q8: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """[T, S] fp64: sum_h w * relu(q . k) * k_scale, no masking; q8
    ``[T, H, D]``, k8 ``[S, D]``, k_scale ``[S]``, w ``[T, H]``."""
    s = torch.einsum("thd,sd->ths", q8.double(), k8.double()).clamp_min(0)
    return (s * w.double()[:, :, None]).sum(1) * k_scale.double()[None, :]
