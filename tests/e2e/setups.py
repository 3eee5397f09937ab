"""The engine setups of the end-to-end tests: how each engine is started
(vllm.LLM's arguments, its process's environment), what it must have chosen
(read from its log and config) and how many GPUs it needs. cases.py says
which setups run on which files; judging.py holds every setup to upstream's
peer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineSetup:
    name: str
    # vllm.LLM keyword arguments on top of the suite's own (test_engine.run_engine)
    llm_args: dict[str, Any]
    # environment variables of the engine's process
    env: dict[str, str] = field(default_factory=dict)
    # what the engine must have chosen: attention backend and indexer (its
    # log), dtype (its config)
    backend: str = "TRITON_MLA_SPARSE"
    dtype: str = "float16"
    indexer: str = "triton"
    # the setup whose run on the same file this one is held to (TP 1, or the
    # same greedy output without speculation)
    held_to: str | None = None

    @property
    def gpus(self) -> int:
        return self.llm_args.get("tensor_parallel_size", 1)

    @property
    def eager(self) -> bool:
        """Without CUDA graphs: its log must show none captured (and the
        others' must show them captured)."""
        return self.llm_args.get("enforce_eager", False)

    @property
    def speculative(self) -> bool:
        return "speculative_config" in self.llm_args


def _triton(name: str, dtype: str, held_to: str | None = None, **llm_args) -> EngineSetup:
    """The series' kernels, forced: TRITON_MLA_SPARSE and the Triton indexer."""
    return EngineSetup(name, {"dtype": dtype, "attention_backend": "TRITON_MLA_SPARSE",
                              **llm_args},
                       env={"VLLM_DSA_INDEXER_TRITON": "1"}, dtype=dtype, held_to=held_to)


# upstream's own sparse path on SM90: FlashMLA + DeepGEMM, bf16 only, and
# vLLM 0.23's GGUF kernels (ggml's at every batch size): a defect of the
# series' float paths is not also in the bar it is held to
PEER = EngineSetup("flashmla-bf16", {"dtype": "bfloat16", "attention_backend": "FLASHMLA_SPARSE"},
                   env={"VLLM_GGUF_KERNELS": "upstream"},
                   backend="FLASHMLA_SPARSE", dtype="bfloat16", indexer="deepgemm")
# what SM120 runs, forced on this GPU
TRITON_FP16 = _triton("triton-fp16", "float16")
TRITON_BF16 = _triton("triton-bf16", "bfloat16")
# nothing forced, the device reported as SM 12.0 (0006's selection, the
# Triton indexer, SM12x kernel tables); no --dtype (GGUF refuses bf16 on
# Blackwell: 0039 takes fp16 for --dtype auto) and no --tokenizer (0040 takes
# the --hf-config-path's). Float experts (F16/BF16 files)
# would go to FlashInfer's CUTLASS MoE, upstream's SM12x choice, which cannot
# run here as on SM120: FlashInfer compiles it for this GPU at start (over
# 10 min on 16 cores). vLLM's Triton MoE instead.
AUTO_SM120 = EngineSetup("auto-sm120", {"tokenizer": None},
                         env={"E2E_REPORT_SM": "12.0", "VLLM_USE_FLASHINFER_MOE_FP16": "0"})
# the same as triton-fp16 without CUDA graphs (--enforce-eager): tells a
# graph-capture defect from a kernel one where decode differs
TRITON_FP16_EAGER = _triton("triton-fp16-eager", "float16", enforce_eager=True)
# tensor parallel 2 on two GPUs of one host (the test models' 4 heads and
# their experts split evenly); held to TP 1 on the same file
TRITON_FP16_TP2 = _triton("triton-fp16-tp2", "float16", held_to=TRITON_FP16.name,
                          tensor_parallel_size=2)
# MTP speculative decoding from the GGUF's NextN block; its greedy output
# must be that of triton-fp16
_MTP = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1},
        "disable_log_stats": False}  # the acceptance counters
TRITON_FP16_MTP = _triton("triton-fp16-mtp", "float16", held_to=TRITON_FP16.name, **_MTP)
# upstream's path with MTP: the bar of triton-fp16-mtp's drafts
# (judging.mtp_draft_figures). Upstream's own: its figures are recorded, and
# only a floor is held (a broken draft model would loosen the bar)
PEER_MTP = EngineSetup("flashmla-bf16-mtp", {**PEER.llm_args, **_MTP},
                       env=PEER.env, backend=PEER.backend, dtype=PEER.dtype,
                       indexer=PEER.indexer, held_to=PEER.name)

# triton-fp16 without the dense Marlin copy of the linears of Q4_K, Q4_0 and
# Q8_0 (VLLM_GGUF_MARLIN_LINEARS=0, 0036): the test models' decode batches
# of 7 to 31 sequences on gguf.py's choice of kernels
TRITON_FP16_NO_MARLIN_LINEARS = EngineSetup(
    "triton-fp16-no-marlin-linears", TRITON_FP16.llm_args,
    env={**TRITON_FP16.env, "VLLM_GGUF_MARLIN_LINEARS": "0"})

SETUPS: dict[str, EngineSetup] = {s.name: s for s in (
    PEER, TRITON_FP16, TRITON_BF16, AUTO_SM120, TRITON_FP16_EAGER, TRITON_FP16_TP2,
    TRITON_FP16_MTP, PEER_MTP, TRITON_FP16_NO_MARLIN_LINEARS)}
