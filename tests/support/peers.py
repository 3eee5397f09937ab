# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The peer kernels the series is compared with: FlashMLA sparse prefill
and DeepGEMM's MQA logits as the pinned wheel ships them (SM90/SM100
only), upstream vLLM's own pure-Triton sparse MLA from a vLLM source tree
(``TRITON_MLA_SPARSE`` on vLLM's main branch, in no release yet), and the
Triton ports of FlashMLA's sparse ops of vLLM PR 54929 (open) with the
``fp8_ds_mla`` cache they read. Each loader returns ``(peer, None)`` or
``(None, why)``, so a test can skip and a benchmark go on with the reason."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

PEER_MAJORS = (9, 10)


def _why_not_here(what: str) -> str | None:
    if not torch.cuda.is_available():
        return f"{what} needs a CUDA GPU"
    major = torch.cuda.get_device_capability()[0]
    if major not in PEER_MAJORS:
        return f"{what} runs on SM90/SM100 only (this GPU: SM{major}x)"
    return None


def load_flashmla_sparse(so: str | None = None) -> tuple[Callable | None, str | None]:
    """FlashMLA's ``sparse_prefill_fwd``: ``op(q, kv, indices, sm_scale,
    d_v)`` returns its ``(out, max_logits, lse)``. The library is ``so``,
    else ``$FLASHMLA_SO`` (a machine without the wheel installed), else the
    installed wheel's ``vllm._flashmla_C``."""
    why = _why_not_here("FlashMLA sparse")
    if why:
        return None, why
    so = so or os.environ.get("FLASHMLA_SO")
    try:
        if so:
            torch.ops.load_library(so)
        else:
            import vllm._flashmla_C  # noqa: F401
        raw = torch.ops._flashmla_C.sparse_prefill_fwd
        n_args = len(raw.default._schema.arguments)
    except (ImportError, OSError, AttributeError, RuntimeError) as e:
        return None, f"FlashMLA sparse not loadable (so={so!r}; set FLASHMLA_SO): {e!r}"
    # (q, kv, indices, sm_scale, d_v[, attn_sink, topk_length[, out]])
    extra = n_args - 5

    def op(q, kv, indices, sm_scale, d_v):
        return raw(q, kv, indices, sm_scale, d_v, *([None] * extra))[:3]

    return op, None


def load_deep_gemm(folder: str | None = None) -> tuple[Any | None, str | None]:
    """DeepGEMM: the ``deep_gemm`` package in ``folder`` (e.g. the wheel's
    ``vllm/third_party``), else ``deep_gemm`` on the path, else
    ``vllm.third_party.deep_gemm``. Its JIT cache defaults to a temporary
    folder (``DG_JIT_CACHE_DIR``)."""
    why = _why_not_here("DeepGEMM MQA logits")
    if why:
        return None, why
    os.environ.setdefault(
        "DG_JIT_CACHE_DIR", os.path.join(tempfile.gettempdir(), "dg_jit_cache")
    )
    errs = []
    if folder:
        package = os.path.join(folder, "deep_gemm")
        if not os.path.isdir(package):
            return None, f"DeepGEMM: {folder} holds no deep_gemm package"
        try:
            return _import_package("deep_gemm", package), None
        except (ImportError, OSError, RuntimeError) as e:  # or its .so failing
            errs.append(f"deep_gemm from {folder}: {e!r}")
    # A folder's deep_gemm stands where deep_gemm on the path would.
    for name in ("deep_gemm", "vllm.third_party.deep_gemm")[bool(folder):]:
        try:
            return __import__(name, fromlist=["fp8_fp4_mqa_logits"]), None
        except (ImportError, OSError, RuntimeError) as e:  # or its .so failing
            errs.append(f"{name}: {e!r}")
    return None, "DeepGEMM not importable: " + "; ".join(errs)


def _import_package(name: str, folder: str):
    """The package in folder, imported as `name` (its modules import each
    other relatively), without putting folder's other packages on the path."""
    if name in sys.modules:
        return sys.modules[name]
    return _exec_module(name, importlib.util.spec_from_file_location(
        name, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]))


def _exec_module(name: str, spec):
    """The module of ``spec``, registered as ``name`` (and not, if it fails)."""
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


# Upstream vLLM's Triton kernels for SM8x/SM12x, in a vLLM source tree of
# its main branch (no release has them yet), and their imports from vLLM
# that the installed vLLM 0.23 lacks, with what stands in for each (the
# same values and meaning).
VLLM_TRITON_SPARSE_MLA = "vllm/v1/attention/ops/triton_sparse_mla_kernel.py"
VLLM_TRITON_MQA_LOGITS = "vllm/v1/attention/ops/mqa_logits_triton.py"
_TRITON_UTILS = {
    "from vllm.triton_utils import LOG2E, LOGE2, tl, triton": (
        "import math\nimport triton\nimport triton.language as tl\n"
        "LOG2E = math.log2(math.e)\nLOGE2 = math.log(2.0)"),
    "from vllm.triton_utils import tl, triton": "import triton\nimport triton.language as tl",
}
_NUM_COMPUTE_UNITS = {
    "from vllm.utils.platform_utils import num_compute_units": (
        "def num_compute_units(index=None):\n"
        "    index = torch.cuda.current_device() if index is None else index\n"
        "    return torch.cuda.get_device_properties(index).multi_processor_count"),
}
_SHIMS = {
    VLLM_TRITON_SPARSE_MLA: {
        "from vllm.triton_utils import LOG2E, LOGE2, tl, triton":
            _TRITON_UTILS["from vllm.triton_utils import LOG2E, LOGE2, tl, triton"],
        **_NUM_COMPUTE_UNITS},
    VLLM_TRITON_MQA_LOGITS: {
        "from vllm.triton_utils import tl, triton":
            _TRITON_UTILS["from vllm.triton_utils import tl, triton"]},
}


def import_with_shims(path: str, name: str, shims: dict[str, str]):
    """The module at ``path`` imported as ``name``, each import of ``shims``
    (whole lines, one or several) replaced by its stand-in (written next to
    a copy in a temporary folder: Triton reads a kernel's source from its
    file). A missing import is an error naming it: another version of the
    file."""
    with open(path) as f:
        text = f.read()
    missing = [lines for lines in shims if f"\n{lines}\n" not in f"\n{text}\n"]
    if missing:
        raise ImportError(f"{path}: expected import line(s) not found (another version?): "
                          + "; ".join(missing))
    for line, stand_in in shims.items():
        text = text.replace(line, stand_in)
    folder = tempfile.mkdtemp(prefix="peer-")
    copy = os.path.join(folder, os.path.basename(path))
    with open(copy, "w") as f:
        f.write(text)
    return _exec_module(name, importlib.util.spec_from_file_location(name, copy))


def _find_file(what: str, rel: str, src: str) -> tuple[str | None, str | None]:
    """(path, None) or (None, why): ``rel`` in ``src``, a vLLM source tree
    or a folder holding the file by its name, or ``src`` itself if it is
    that file."""
    if os.path.isdir(src):
        found = [p for p in (os.path.join(src, rel), os.path.join(src, os.path.basename(rel)))
                 if os.path.isfile(p)]
        if not found:
            return None, f"{what}: {os.path.join(src, rel)} not found"
        return found[0], None
    if os.path.isfile(src) and os.path.basename(src) == os.path.basename(rel):
        return src, None
    return None, f"{what}: {src} is neither a folder nor {os.path.basename(rel)}"


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _load_vllm_main(what: str, rel: str, src: str | None):
    """(module, sha256 of its file, None) or (None, None, why): ``rel`` from
    ``src`` (a vLLM checkout of main, a folder holding the file by its name,
    or the file), else from ``$VLLM_MAIN_SRC``."""
    if not torch.cuda.is_available():
        return None, None, f"{what} needs a CUDA GPU"
    src = src or os.environ.get("VLLM_MAIN_SRC")
    if not src:
        return None, None, (f"{what}: no source given (a vLLM checkout of main, or a folder "
                            f"holding its {rel}, in VLLM_MAIN_SRC)")
    path, why = _find_file(what, rel, src)
    if path is None:
        return None, None, why
    name = "vllm_main_" + os.path.basename(rel)[:-3]
    try:
        module = import_with_shims(path, name, _SHIMS[rel])
    except (ImportError, SyntaxError) as e:
        return None, None, f"{what} not loadable from {path}: {e}"
    return module, _sha256(path), None


def load_vllm_triton_sparse_mla(src: str | None = None) -> tuple[Callable | None, str | None]:
    """Upstream vLLM's Triton sparse MLA (split-KV decode, PR 47629's line):
    ``op(q, kv, indices, sm_scale)`` with q ``[T, H, 576]`` and kv
    ``[S, 1, 576]`` bf16, indices ``[T, 1, topk]`` int32, returns out
    ``[T, H, 512]`` bf16, splits chosen by its own heuristic; ``op.sha256``:
    the file's."""
    module, sha, why = _load_vllm_main("vLLM's Triton sparse MLA", VLLM_TRITON_SPARSE_MLA, src)
    if module is None:
        return None, why
    fn = getattr(module, "triton_sparse_mla_attention", None)
    if fn is None:
        return None, "vLLM's Triton sparse MLA: no triton_sparse_mla_attention in the file"
    sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count

    def op(q, kv, indices, sm_scale):
        return fn(q, kv, indices, sm_scale=sm_scale, sm_count=sm_count)

    op.sha256 = sha
    return op, None


def load_vllm_triton_mqa_logits(src: str | None = None) -> tuple[Any | None, str | None]:
    """Upstream vLLM's Triton MQA logits (DeepGEMM's fp8 API): ``.prefill(q,
    k8, k_scale, weights, ks, ke)`` -> ``[M, N]`` fp32 and ``.paged(q, cache,
    weights, context_lens, block_tables, max_len)`` (cache ``[blocks,
    block_size, D + 4]`` uint8, context lens ``[B]``) -> ``[B * next_n,
    max_len]`` fp32, -inf outside each window; ``.sha256``: the file's."""
    module, sha, why = _load_vllm_main("vLLM's Triton MQA logits", VLLM_TRITON_MQA_LOGITS, src)
    if module is None:
        return None, why
    try:
        prefill, paged = module.fp8_mqa_logits_triton, module.fp8_paged_mqa_logits_triton
    except AttributeError as e:
        return None, f"vLLM's Triton MQA logits: {e}"

    class Peer:
        sha256 = sha

        @staticmethod
        def prefill(q, k8, k_scale, weights, ks, ke):
            return prefill(q, (k8, k_scale), weights, ks, ke)

        @staticmethod
        def paged(q, cache, weights, context_lens, block_tables, max_len):
            return paged(q, cache.unsqueeze(2), weights, context_lens, block_tables, max_len)

    return Peer, None


# fp8_ds_mla, DeepSeek V3.2's KV cache entry as vLLM's concat_and_cache_mla
# writes it (kv_cache_dtype "fp8_ds_mla") and FlashMLA's sparse decode reads
# it, 656 bytes a token: [0, 512) the NoPE values in fp8 e4m3, each tile of
# 128 divided by its scale (round to nearest, saturated); [512, 528) the 4
# tile scales, fp32 max(amax / 448, FLT_MIN); [528, 656) the 64 RoPE values,
# bf16 as they are.
FP8_DS_MLA_BYTES = 656
_NOPE, _ROPE, _TILE, _FP8_MAX = 512, 64, 128, 448.0
_ROPE_AT = _NOPE + 4 * (_NOPE // _TILE)  # 528, after the fp32 scales


def pack_fp8_ds_mla(kv: torch.Tensor) -> torch.Tensor:
    """``[rows, 656]`` uint8 fp8_ds_mla entries of bf16 ``kv`` ``[rows, 1,
    576]`` (or ``[rows, 576]``)."""
    if kv.dtype != torch.bfloat16 or kv.shape[-1] != _NOPE + _ROPE:
        raise ValueError(f"pack_fp8_ds_mla: bf16 [rows, (1,) 576] expected, found "
                         f"{kv.dtype} {tuple(kv.shape)}")
    rows = kv.shape[0]
    x = kv.reshape(rows, _NOPE + _ROPE)
    nope = x[:, :_NOPE].float().view(rows, _NOPE // _TILE, _TILE)
    scale = (nope.abs().amax(-1) / _FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q8 = (nope / scale[..., None]).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat([q8.view(torch.uint8).view(rows, _NOPE), scale.view(torch.uint8),
                      x[:, _NOPE:].contiguous().view(torch.uint8)], dim=1)


def unpack_fp8_ds_mla(cache: torch.Tensor) -> torch.Tensor:
    """fp32 ``[rows, 1, 576]``: what fp8_ds_mla entries ``[rows, 656]`` hold
    (each fp8 value times its tile's scale, then the RoPE values)."""
    rows = cache.shape[0]
    nope = cache[:, :_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    scale = cache[:, _NOPE:_ROPE_AT].contiguous().view(torch.float32)
    rope = cache[:, _ROPE_AT:].contiguous().view(torch.bfloat16).float()
    nope = (nope.view(rows, -1, _TILE) * scale[..., None]).view(rows, _NOPE)
    return torch.cat([nope, rope], dim=1)[:, None]


# vLLM PR 54929 (open): Triton ports of FlashMLA's two sparse ops for SM12x,
# flash_mla_sparse_fwd (bf16 KV) and flash_mla_with_kvcache (fp8_ds_mla KV),
# in one file that takes two kernels from main's sparse_mla_kernels.py (the
# DeepSeek-V4 SM12x path, in no release yet). What 0.23 lacks: that file, and
# its knob module, stood in for by the same reading of the same variable.
PR54929_ATTN = "vllm/v1/attention/backends/mla/sm12x_sparse_mla_attn.py"
PR54929_KERNELS = "vllm/v1/attention/backends/mla/sparse_mla_kernels.py"
_PR54929_KERNELS_MODULE = "vllm_pr54929_sparse_mla_kernels"
_PR54929_SHIMS = {
    PR54929_ATTN: {
        "from vllm.v1.attention.backends.mla.sparse_mla_kernels import (":
            f"from {_PR54929_KERNELS_MODULE} import ("},
    PR54929_KERNELS: {
        ("from vllm.v1.attention.backends.mla.sparse_mla_env import (\n"
         "    triton_sparse_mla_head_block_size,\n"
         ")"): (
            "def triton_sparse_mla_head_block_size():\n"
            "    import os\n"
            "    value = os.environ.get('VLLM_TRITON_MLA_SPARSE_HEAD_BLOCK_SIZE')\n"
            "    return int(value) if value in ('1', '2', '4') else None"),
    },
}


def load_pr54929_sparse_mla(src: str | None = None) -> tuple[Any | None, str | None]:
    """PR 54929's Triton sparse MLA from ``src`` (a vLLM checkout of the PR,
    a folder holding its sm12x_sparse_mla_attn.py and main's
    sparse_mla_kernels.py, or the first file with the second beside it),
    else from ``$VLLM_PR54929_SRC``. q ``[T, H, 576]`` bf16 and indices
    ``[T, 1, topk]`` int32 into the KV rows; out ``[T, H, 512]`` bf16:

    - ``.fp8(q, cache, indices, sm_scale)``: its flash_mla_with_kvcache (the
      fp8 decode op, which vLLM also runs prefill tokens through when heads
      are few) over fp8_ds_mla ``cache`` ``[rows, 656]`` (pack_fp8_ds_mla),
      each token a request of one query, as vLLM's decode calls it;
    - ``.bf16(q, kv, indices, sm_scale)``: its flash_mla_sparse_fwd (the
      bf16 prefill op) over ``kv`` ``[rows, 1, 576]``;

    ``.module``: the PR's file loaded; ``.sha256``: {file name: sha256}."""
    what = "PR 54929's Triton sparse MLA"
    if not torch.cuda.is_available():
        return None, f"{what} needs a CUDA GPU"
    src = src or os.environ.get("VLLM_PR54929_SRC")
    if not src:
        return None, (f"{what}: no source given (a vLLM checkout of the PR, or a folder "
                      f"holding its {os.path.basename(PR54929_ATTN)} and main's "
                      f"{os.path.basename(PR54929_KERNELS)}, in VLLM_PR54929_SRC)")
    attn, why = _find_file(what, PR54929_ATTN, src)
    if attn is None:
        return None, why
    # main's kernels: from the same tree, or beside the PR's file
    tree = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(attn))
    kernels, why = _find_file(what, PR54929_KERNELS, tree)
    if kernels is None:
        return None, why
    # the kernels first: the PR's file imports them by the name given here
    for rel, path, name in ((PR54929_KERNELS, kernels, _PR54929_KERNELS_MODULE),
                            (PR54929_ATTN, attn, "vllm_pr54929_sm12x_sparse_mla_attn")):
        try:
            module = import_with_shims(path, name, _PR54929_SHIMS[rel])
        except (ImportError, SyntaxError) as e:
            return None, f"{what} not loadable from {path}: {e}"
    try:
        fwd, decode = module.flash_mla_sparse_fwd_triton, module.flash_mla_with_kvcache_triton
    except AttributeError as e:
        return None, f"{what}: {e}"

    class Peer:
        sha256 = {os.path.basename(p): _sha256(p) for p in (attn, kernels)}

        @staticmethod
        def fp8(q, cache, indices, sm_scale):
            # [b, s_q, h, d] q and [b, s_q, topk] slot ids with b = T, s_q = 1;
            # the cache as blocks of one token (the op flattens it to slots).
            out, _ = decode(q[:, None], cache[:, None, None], None, head_dim_v=_NOPE,
                            softmax_scale=sm_scale, is_fp8_kvcache=True, indices=indices)
            return out[:, 0]

        @staticmethod
        def bf16(q, kv, indices, sm_scale):
            return fwd(q, kv, indices, sm_scale, _NOPE)[0]

    Peer.module = module
    return Peer, None
