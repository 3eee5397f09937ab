# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine benchmark (`make bench-engine`): `vllm serve` as users run it,
driven by `vllm bench serve`, on GGUF files of the real models' width, with
upstream's sparse path and llama.cpp on the same files as peers in the same
run.

Its command line is bench/bench_engine.py. Modules (imported with ``bench/``
on ``sys.path``, as ``engine.<module>``):

- ``spec``: the benchmark checkpoints (one GPU's share of GLM-5, GLM-5.2,
  DeepSeek-V3.2 under tensor parallelism, and a full-width GLM-5 slice), their
  tensors, configs and GGUF types (mixtures included). No torch.
- ``vocab``: a byte-level BPE vocabulary that HF tokenizers and llama.cpp
  tokenize alike (the same prompt, the same token count on every server).
- ``weights``: seeded random tensors (chunked, multithreaded) and the
  routing-spread check. Needs torch.
- ``convert``: llama.cpp's own converter on those tensors, streamed (a
  script, run with the converter's bundled gguf-py).
- ``build``: checkpoint -> converter -> quantizer (llama_model_quantize,
  per-tensor overrides, an importance matrix where IQ types need one).
- ``workloads``: the workload matrix and every command line (vLLM paths,
  `vllm bench serve`, llama-server, llama-bench). No torch.
- ``parse``: `vllm bench serve` results, vLLM's start-up log, llama-bench.
- ``record``: the JSONL record (bench/benchdata.py) and engine.md.
- ``llamacpp``: llama.cpp with CUDA, built once per machine.
- ``run``: the GPU driver.
"""
