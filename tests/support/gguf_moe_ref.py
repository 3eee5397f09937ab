# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GGUF routed experts for the tests: random quantized blocks with sane
scales, the fp64 reference of a layer (SiLU(gate) * up -> down, weighted by
the router and summed over the top-k), and CPU stand-ins for the CUDA ops
that vLLM's GGUF MoE paths call (tests only: the code under test stays
vLLM's own)."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType

# Byte offsets of each block's fp16 scale fields (d, dmin), per gguf-py's
# dequantize_blocks. Every value of these types is linear in them.
F16_FIELDS = {
    "Q4_0": (0,),
    "Q5_0": (0,),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ1_S": (0,),
    "IQ2_XXS": (0,),
    "IQ2_XS": (0,),
    "IQ2_S": (0,),
    "IQ3_XXS": (0,),
    "IQ3_S": (0,),
    "IQ4_XS": (0,),
    # IQ1_M: d's four nibbles are the top nibbles of its last 8 bytes'
    # uint16 (IQ1_M_D_BYTES)
    "IQ1_M": (None,),
}
# IQ1_M: the bytes whose high nibbles hold d's nibbles, lowest first
IQ1_M_D_BYTES = (49, 51, 53, 55)
# The types with an MMQ kernel (ggml_moe_a8): vLLM's MMQ_QUANT_TYPES.
MMQ_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# MOE_X of the CUDA build: the token block of ggml_moe_a8
MOE_BLOCK = 4


def dequantize(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """fp64 values of GGUF blocks ``[..., bytes]`` (gguf-py)."""
    values = gguf.quants.dequantize(raw.cpu().numpy(), QType[type_name])
    return torch.from_numpy(values).double()


def random_blocks(
    type_name: str, shape: tuple[int, ...], g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks of ``type_name`` for a weight of logical ``shape``
    (last dim: the values of a row), scaled to an rms of about
    1/sqrt(row): (raw uint8 ``[..., bytes]``, its fp64 values ``shape``),
    both on the CPU."""
    qtype = QType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    *lead, cols = shape
    blocks = (*lead, cols // block)
    raw = torch.randint(0, 256, (*blocks, size), dtype=torch.uint8, generator=g)
    fields = F16_FIELDS[type_name]
    scales = torch.rand((len(fields), *blocks), generator=g) + 0.5

    def set_scales() -> torch.Tensor:
        for off, scale in zip(fields, scales):
            if off is None:  # IQ1_M
                bits = scale.half().view(torch.int16).int()
                for i, at in enumerate(IQ1_M_D_BYTES):
                    nibble = ((bits >> (4 * i)) & 15).to(torch.uint8)
                    raw[..., at] = (raw[..., at] & 15) | (nibble << 4)
                continue
            raw[..., off : off + 2] = scale.half().view(torch.uint8).view(*blocks, 2)
        return dequantize(raw.reshape(*lead, -1), type_name)

    scales *= cols**-0.5 / set_scales().square().mean().sqrt().item()
    values = set_scales()
    assert values.shape == shape and torch.isfinite(values).all(), type_name
    return raw.reshape(*lead, -1), values


def large_group_sums(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """fp32 inputs [rows, cols] whose 32-value groups sum past 8,192 (12,800
    in columns 32-63, -64,000, near fp16's largest value, in 256-287), as a
    massive activation may: Q4_K's Marlin min-term columns hold such sums."""
    x = torch.randn(rows, cols, generator=g) * 0.5
    x[:, 32:64] += 400.0
    x[:, 256:288] -= 2000.0
    return x


def moe_reference(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    q8: tuple[bool, bool, bool] = (False, False, False),
) -> torch.Tensor:
    """fp64 ``[T, H]``: sum_j w[t, j] * down[e] @ (silu(gate[e] @ x[t]) *
    (up[e] @ x[t])) over token t's experts e = topk_ids[t, j]; gate and up
    ``[E, I, H]``, down ``[E, H, I]`` (fp64 values). ``q8``: which of gate,
    up and down read their input as q8 (q8_activations; the down
    projection's input rounded to x's dtype first), as gguf_moe_vec does."""
    xd = x.double()
    xg = q8_activations(x) if q8[0] else xd
    xu = q8_activations(x) if q8[1] else xd
    out = torch.zeros(xd.shape, dtype=torch.float64, device=xd.device)
    for e in topk_ids.unique().tolist():
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        h = F.silu(xg[tokens] @ gate[e].double().T) * (xu[tokens] @ up[e].double().T)
        if q8[2]:
            h = q8_activations(h.to(x.dtype))
        y = h @ down[e].double().T
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].double()[:, None])
    return out


def gguf_moe_layer(
    w13: torch.Tensor, w13_type: int, w2: torch.Tensor, w2_type: int, dtype: torch.dtype
) -> torch.nn.Module:
    """A module holding routed experts as GGUFMoEMethod leaves them after
    loading (what gguf_marlin_moe.repack_layer reads): GGUF blocks
    ``w13 [E, 2I, bytes]`` and ``w2 [E, H, bytes]`` with their logical
    shapes and types, a gated SiLU, ``dtype`` activations."""
    from vllm.model_executor.layers.fused_moe import MoEActivation

    num_experts, rows13, _ = w13.shape
    hidden = w2.shape[1]
    layer = torch.nn.Module()
    for name, raw, qtype, shape in (("w13", w13, w13_type, (num_experts, rows13, hidden)),
                                    ("w2", w2, w2_type, (num_experts, hidden, rows13 // 2))):
        p = torch.nn.Parameter(raw, requires_grad=False)
        p.tensor_shape = shape
        setattr(layer, f"{name}_qweight", p)
        t = torch.nn.Parameter(torch.tensor([int(qtype)], dtype=torch.uint8),
                               requires_grad=False)
        t.weight_type = int(qtype)
        setattr(layer, f"{name}_qweight_type", t)
    layer.moe_config = SimpleNamespace(is_act_and_mul=True)
    layer.params_dtype = dtype
    layer.activation = MoEActivation.SILU
    return layer


def _expert_gemm(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """fp64 row r: weights[experts[r]] @ x[r]."""
    out = torch.empty((x.shape[0], weights.shape[1]), dtype=torch.float64)
    for e in experts.unique().tolist():
        rows = (experts == e).nonzero().flatten()
        out[rows] = x[rows].double() @ weights[e].T
    return out


# the gguf_moe_vec types whose activations the kernel reads in their dtype,
# not as q8_activations
VEC_FLOAT_ACTIVATIONS = ("IQ4_XS",)


def q8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as gguf_moe_vec's kernel reads it for every type but IQ4_XS (and
    ggml's vector kernel, as q8_1): 32 values to a scale, their largest
    magnitude / 127, each rounded to a signed byte; fp64 of the values the
    bytes stand for. The rounding in fp32, as the kernel does it."""
    v = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = v.abs().amax(-1, keepdim=True)
    # a tensor over a tensor: torch computes a number over a tensor as the
    # tensor's reciprocal times the number, another rounding than the
    # kernel's IEEE division
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.floor(v * inv + 0.5)
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


def moe_vec_reference(
    x: torch.Tensor, values: torch.Tensor, topk_ids: torch.Tensor, top_k: int
) -> torch.Tensor:
    """ggml_moe_a8_vec's product in fp64: row r is values[ids[r]] @
    x[r // top_k] for ids = topk_ids.flatten(), zeros where ids[r] is no
    expert."""
    ids = topk_ids.flatten().long().cpu()
    out = torch.zeros(ids.numel(), values.shape[1], dtype=torch.float64)
    valid = (ids >= 0) & (ids < values.shape[0])
    rows = valid.nonzero().flatten()
    out[rows] = _expert_gemm(x.cpu()[rows // top_k], values, ids[rows])
    return out


class CpuGgufMoeOps:
    """CPU stand-ins for the CUDA ops of vLLM's GGUF MoE paths, exact in
    fp64 from gguf-py's dequantize and rounded to the activation dtype where
    the kernel writes its output. They check the calling convention the
    kernels rely on, leave the rows a kernel would not write NaN, and record
    each GEMM as (kernel, type name) in ``calls``, the series' Triton vector
    kernel (gguf_moe_vec, run as it is) as "vec_triton", its grouped kernel
    as "gemm_triton". ``known`` holds values
    already dequantized, by (data_ptr, type) of their blocks."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.known: dict[tuple[int, int], torch.Tensor] = {}

    def install(self, monkeypatch) -> CpuGgufMoeOps:
        from vllm import _custom_ops as ops

        for name in (
            "ggml_moe_a8",
            "ggml_moe_a8_vec",
            "ggml_moe_get_block_size",
            "moe_align_block_size",
            "moe_sum",
        ):
            monkeypatch.setattr(ops, name, getattr(self, name))
        # apply_moe_activation calls torch.ops._C.silu_and_mul
        monkeypatch.setattr(torch.ops, "_C", _ActivationOps(), raising=False)
        # the series' Triton vector kernel runs (in the interpreter), recorded
        from vllm.model_executor.layers.quantization import gguf_moe_vec

        kernel = gguf_moe_vec.moe_vec

        def moe_vec(x, w, topk_ids, top_k, qtype, rows, **kwargs):
            self.calls.append(("vec_triton", QType(qtype).name))
            # a wide tile: the interpreter runs one program at a time (the
            # kernel's own tile: tests/kernels/test_gguf_moe_vec.py)
            kwargs.setdefault("block_n", 256)
            return kernel(x, w, topk_ids, top_k, qtype, rows, **kwargs)

        monkeypatch.setattr(gguf_moe_vec, "moe_vec", moe_vec)
        gemm = gguf_moe_vec.moe_gemm

        def moe_gemm(x, w, qtype, rows, *args, **kwargs):
            self.calls.append(("gemm_triton", QType(qtype).name))
            # wide outputs: fewer programs for the interpreter (the kernel's
            # own tile: tests/kernels/test_gguf_moe_vec.py)
            kwargs.setdefault("tile", (gguf_moe_vec.GEMM_BLOCK_M, 128, 4, 8))
            return gemm(x, w, qtype, rows, *args, **kwargs)

        monkeypatch.setattr(gguf_moe_vec, "moe_gemm", moe_gemm)
        return self

    def _weights(self, w: torch.Tensor, qtype: int) -> torch.Tensor:
        assert w.dtype == torch.uint8 and w.dim() == 3 and w.is_contiguous()
        key = (w.data_ptr(), qtype)
        if key not in self.known:
            self.known[key] = dequantize(w, QType(qtype).name)
        return self.known[key]

    def ggml_moe_get_block_size(self, qtype: int) -> int:
        return MOE_BLOCK if QType(qtype).name in MMQ_TYPES else 0

    def moe_align_block_size(
        self, topk_ids, num_experts, block_size, sorted_ids, expert_ids, num_post, expert_map
    ) -> None:
        assert expert_map is None and block_size == MOE_BLOCK
        flat = topk_ids.flatten().long()
        sorted_ids.fill_(flat.numel())
        expert_ids.fill_(-1)
        pos = 0
        for e in range(num_experts):
            rows = (flat == e).nonzero().flatten()
            if not len(rows):
                continue
            sorted_ids[pos : pos + len(rows)] = rows.to(sorted_ids.dtype)
            blocks = -(-len(rows) // block_size)
            expert_ids[pos // block_size : pos // block_size + blocks] = e
            pos += blocks * block_size
        num_post.fill_(pos)

    def ggml_moe_a8(
        self, x, w, sorted_ids, expert_ids, num_post, qtype, rows, top_k, tokens
    ) -> torch.Tensor:
        name = QType(qtype).name
        assert name in MMQ_TYPES, f"ggml_moe_a8 has no {name} kernel"
        self.calls.append(("mmq", name))
        weights = self._weights(w, qtype)
        assert x.shape == (tokens, weights.shape[2]) and weights.shape[1] == rows
        out = torch.full((tokens * top_k, rows), float("nan"), dtype=x.dtype)
        n = int(num_post.item())
        ids = sorted_ids[:n].long()
        experts = expert_ids[: n // MOE_BLOCK].long().repeat_interleave(MOE_BLOCK)
        valid = ids < tokens * top_k
        ids, experts = ids[valid], experts[valid]
        assert (experts >= 0).all()
        out[ids] = _expert_gemm(x[ids // top_k], weights, experts).to(x.dtype)
        return out

    def ggml_moe_a8_vec(self, x, w, topk_ids, top_k, qtype, rows, tokens) -> torch.Tensor:
        self.calls.append(("vec", QType(qtype).name))
        weights = self._weights(w, qtype)
        assert x.shape == (tokens, weights.shape[2]) and weights.shape[1] == rows
        assert topk_ids.is_contiguous() and topk_ids.numel() == tokens * top_k
        token = torch.arange(tokens * top_k) // top_k
        return _expert_gemm(x[token], weights, topk_ids.flatten().long()).to(x.dtype)

    def moe_sum(self, x: torch.Tensor, out: torch.Tensor) -> None:
        assert x.dim() == 3 and out.shape == (x.shape[0], x.shape[2])
        out.copy_(x.double().sum(1))


class _ActivationOps:
    """torch.ops._C stand-in with silu_and_mul (out = silu(x1) * x2 of
    x = [x1 | x2]); any other op is not expected."""

    @staticmethod
    def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
        d = x.shape[-1] // 2
        assert out.shape == (*x.shape[:-1], d)
        out.copy_(F.silu(x[..., :d].double()) * x[..., d:].double())
