"""cases.py, the matrix of the end-to-end tests, on CPU."""

from __future__ import annotations

import os
import subprocess
import sys

from cases import HERE


def test_e2e_groups_naming_no_group_is_an_error():
    """E2E_GROUPS with a group cases.GROUPS lacks fails at import, naming it:
    left out without a word, it would read as a group that passed."""
    code = "import cases; print(len(cases.CASES))"
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**env, "E2E_GROUPS": "dsv32:q4_k_m,glm5:q4_k_s"})
    assert r.returncode != 0 and "glm5:q4_k_s" in r.stderr and "dsv32" not in r.stderr
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**env, "E2E_GROUPS": "dsv32:q4_k_m"})
    assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr


def test_prompts_take_the_float_paths_in_prefill():
    """The prompts, prefilled in one step, reach the batch size from which
    the installed series dequantizes every type's routed experts (a step
    outside the CUDA graphs: test_engine's max_num_seqs 4 captures batches
    of up to 8 tokens). Otherwise the engine tests would run ggml's kernels
    alone in prefill."""
    from vllm.model_executor.layers.quantization import gguf_dispatch

    from cases import prompts

    step = sum(len(p) for p in prompts())
    assert step >= gguf_dispatch.MOE_DEQUANT_MIN_TOKENS
    assert step >= gguf_dispatch.MOE_DEQUANT_MIN_TOKENS_VEC
    assert step >= gguf_dispatch.DENSE_DEQUANT_MIN_TOKENS


def test_the_peer_runs_vllm_0_23s_gguf_kernels():
    """The peer is upstream's path whole: its GGUF layers take vLLM 0.23's
    choice of ggml kernels, so a defect of the series' float paths does not
    also move the bar the series is held to."""
    from setups import PEER

    assert PEER.env.get("VLLM_GGUF_KERNELS") == "upstream"
