"""GGUF files loaded into the model vLLM builds for them, through the real
loader (GGUFModelLoader.load_model), without a GPU: the platform stands in
as CUDA SM 12.0 with tensors on the CPU. Layers look their kernels up when
they are built; loading runs none of them (the prefill kernel and the _C
ops are stand-ins that refuse to run). Shared by the CPU GGUF tests
(tests/gguf/test_gguf_engine_load.py) and the end-to-end test files'
checks (tests/e2e/test_low_bit_files.py).
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest.mock import patch

import torch

from support.cuda_without_gpu import CudaPlatform, get_class_without_gpu


class _CudaOnCpu(CudaPlatform):
    """CUDA as the layers see it; tensors stay on the CPU."""

    device_type = "cpu"

    @classmethod
    def get_device_capability(cls, device_id: int = 0):
        from vllm.platforms.interface import DeviceCapability

        return DeviceCapability(12, 0)

    @classmethod
    def num_compute_units(cls, device_id: int = 0) -> int:
        return 188  # RTX PRO 6000 Blackwell

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        # Tensor-parallel ranks (load_ranks) talk over gloo, not NCCL.
        return (
            "vllm.distributed.device_communicators.base_device_communicator."
            "DeviceCommunicatorBase"
        )


class _NoKernels:
    """torch.ops._C stand-in: layers look kernels up, loading runs none."""

    def __getattr__(self, name: str):
        def kernel(*args, **kwargs):
            raise RuntimeError(f"_C.{name} ran in a CPU loading test")

        return kernel


class _NoPrefill:
    def __init__(self, **kwargs) -> None:
        pass


@contextlib.contextmanager
def _cuda_on_cpu():
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    # Modules keep the platform object they imported (other tests may have
    # patched in their own while importing): switch the class of each.
    platforms = {
        id(obj): obj
        for name, module in list(sys.modules.items())
        if name.startswith("vllm")
        and isinstance(obj := getattr(module, "current_platform", None), Platform)
    }
    originals = {key: obj.__class__ for key, obj in platforms.items()}
    for obj in platforms.values():
        obj.__class__ = _CudaOnCpu
    try:
        with (
            patch.object(torch.ops, "_C", _NoKernels(), create=True),
            patch("vllm.triton_utils.HAS_TRITON", True),
            patch.object(AttentionBackendEnum, "get_class", get_class_without_gpu),
            patch(
                "vllm.model_executor.layers.attention.mla_attention."
                "get_mla_prefill_backend",
                lambda vllm_config: _NoPrefill,
            ),
        ):
            yield
    finally:
        for key, obj in platforms.items():
            obj.__class__ = originals[key]
        # Choices cached under the stand-in must not reach later tests.
        from vllm.v1.attention.ops import dsa_indexer_dispatch
        from vllm.v1.attention.selector import _cached_get_attn_backend

        _cached_get_attn_backend.cache_clear()
        dsa_indexer_dispatch.use_triton_dsa_indexer.cache_clear()


@contextlib.contextmanager
def _config_classes_kept():
    """vLLM's get_config sets `model_type` on the config class its registry
    maps a model type to, for the whole process: after a DeepSeek-V3.2
    config (deepseek_v32 -> transformers' DeepseekV3Config) every
    DeepSeek-V3 config read later says deepseek_v32. One model per process
    never notices; tests that load several put the classes back."""
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    classes = {_CONFIG_REGISTRY[key] for key in _CONFIG_REGISTRY}
    kept = {cls: cls.__dict__["model_type"] for cls in classes if "model_type" in cls.__dict__}
    try:
        yield
    finally:
        for cls, model_type in kept.items():
            cls.model_type = model_type


def load_model(
    path: Path,
    hf_dir: Path,
    mtp: bool = False,
    use_tqdm_on_load: bool = True,
    reload: bool = False,
    rank: tuple[int, int, str] = (0, 1, ""),
):
    """The model vLLM builds for the GGUF file `path` (a split set's first
    shard) and the checkpoint config in `hf_dir`, loaded. mtp: then load
    the MTP draft of the file, as the engine does: the target first, then
    the draft with the draft's model config and the same VllmConfig (its
    quant config and layer names included). use_tqdm_on_load: vLLM's
    --use-tqdm-on-load. reload: then read the weights again into the loaded
    model, as a weight reload does (GGUFModelLoader.load_weights). rank:
    (rank, tensor-parallel size, the ranks' shared file:// init method) of
    a process of load_ranks: the layers take their shard from the
    distributed groups; the VllmConfig keeps one rank, as ParallelConfig
    refuses more ranks than GPUs."""
    from vllm.config import (
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.config.speculative import SpeculativeConfig
    from vllm.distributed import parallel_state
    from vllm.model_executor.model_loader.gguf_loader import GGUFModelLoader

    with _cuda_on_cpu(), _config_classes_kept():
        model_config = ModelConfig(
            model=str(path),
            hf_config_path=str(hf_dir),
            tokenizer=str(hf_dir),
            skip_tokenizer_init=True,
            quantization="gguf",
            dtype=torch.float16,
            max_model_len=256,
            enforce_eager=True,
        )
        speculative_config = None
        if mtp:
            speculative_config = SpeculativeConfig(
                method="mtp",
                num_speculative_tokens=1,
                target_model_config=model_config,
                target_parallel_config=ParallelConfig(),
            )
        tp_rank, tp_size, init_method = rank
        vllm_config = VllmConfig(
            model_config=model_config,
            load_config=LoadConfig(load_format="gguf", use_tqdm_on_load=use_tqdm_on_load),
            device_config=DeviceConfig("cpu"),
            speculative_config=speculative_config,
        )
        with set_current_vllm_config(vllm_config):
            if not parallel_state.model_parallel_is_initialized():
                parallel_state.init_distributed_environment(
                    world_size=tp_size,
                    rank=tp_rank,
                    local_rank=tp_rank,
                    distributed_init_method=init_method or f"file://{tempfile.mktemp()}",
                    backend="gloo",
                )
                parallel_state.initialize_model_parallel(tp_size, 1)
            loader = GGUFModelLoader(vllm_config.load_config)
            model = loader.load_model(vllm_config, model_config)
            if mtp:
                draft_config = speculative_config.draft_model_config
                model = loader.load_model(vllm_config, draft_config)
            if reload:
                loader.load_weights(model, model_config)
            return model


@contextlib.contextmanager
def engine_loader(monkeypatch) -> Iterator[Callable]:
    """load_model, with the environment it needs set through `monkeypatch`
    (a pytest MonkeyPatch), and the distributed state it sets up torn down
    afterwards."""
    # Imported before the platform changes: these register ops per platform.
    import vllm.model_executor.layers.quantization.gguf_split_moe  # noqa: F401
    import vllm.model_executor.models.deepseek_v2  # noqa: F401
    from vllm.distributed import parallel_state

    monkeypatch.setenv("VLLM_DISABLE_SHARED_EXPERTS_STREAM", "1")
    # Triton's unquantized MoE keeps w13 as loaded, [gate; up] per expert
    # (FlashInfer's would reorder it after loading).
    monkeypatch.setenv("VLLM_USE_FLASHINFER_MOE_FP16", "0")
    try:
        yield load_model
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


def _load_rank(rank: int, tp_size: int, init_method: str, path: Path, hf_dir: Path,
               out: Path, mtp: bool) -> None:
    import os

    import vllm.model_executor.layers.quantization.gguf_split_moe  # noqa: F401
    import vllm.model_executor.models.deepseek_v2  # noqa: F401

    os.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] = "1"
    os.environ["VLLM_USE_FLASHINFER_MOE_FP16"] = "0"
    model = load_model(path, hf_dir, mtp=mtp, rank=(rank, tp_size, init_method))
    torch.save(model.state_dict(), out / f"rank{rank}.pt")


def load_ranks(path: Path, hf_dir: Path, tp_size: int, out: Path,
               mtp: bool = False) -> list[dict]:
    """The state dicts of load_model's model (mtp: its MTP draft) in each
    rank of tensor parallelism `tp_size`: one process a rank (gloo between
    them), as `vllm serve --tensor-parallel-size` starts its workers."""
    import torch.multiprocessing as mp

    init_method = f"file://{out / 'init'}"
    mp.spawn(_load_rank, args=(tp_size, init_method, path, hf_dir, out, mtp),
             nprocs=tp_size)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(tp_size)]
