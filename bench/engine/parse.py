# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the engines report, as figures: `vllm bench serve` result files,
vLLM's start-up log (KV cache, memory), llama-server's log and
llama-bench's JSON. No torch, no GPU."""

from __future__ import annotations

import json
import re

GIB = 1 << 30


def _num(s: str) -> float:
    return float(s.replace(",", ""))


def bench_serve(result: dict, w) -> dict:
    """Figures of one `vllm bench serve` result (saved with --save-result,
    --metric-percentiles 50,90,99) for workload ``w``."""
    completed = result.get("completed") or 0
    f = {
        "completed": completed,
        "failed": result.get("failed", 0),
        "duration_s": result.get("duration"),
        "output_tok_s": result.get("output_throughput"),
        "total_tok_s": result.get("total_token_throughput"),
        "mean_input_tokens": (result["total_input_tokens"] / completed) if completed else None,
        "mean_output_tokens": (result["total_output_tokens"] / completed) if completed else None,
    }
    for m in ("ttft", "tpot", "itl", "e2el"):
        for p in ("50", "90", "99"):
            f[f"{m}_p{p}_ms"] = result.get(f"p{p}_{m}_ms")
        f[f"{m}_mean_ms"] = result.get(f"mean_{m}_ms")
    tpot = f["tpot_p50_ms"]
    f["decode_tok_s_per_stream"] = 1000.0 / tpot if tpot else None
    ttft = f["ttft_p50_ms"]
    if w.kind == "prefill" and ttft:
        f["prefill_tok_s"] = (f["mean_input_tokens"] or w.input_len) / (ttft / 1000.0)
    return f


# vLLM 0.23's start-up lines (vllm/v1/core/kv_cache_utils.py,
# v1/worker/gpu_worker.py, gpu_model_runner.py, v1/engine/core.py); in a
# multiprocess engine each is prefixed "(EngineCore_DP0 pid=N) INFO ... ".
_VLLM = {
    "kv_cache_tokens": re.compile(r"GPU KV cache size: ([\d,]+) tokens"),
    "max_concurrency": re.compile(
        r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x"),
    "available_kv_gib": re.compile(r"Available KV cache memory: ([\d.]+) GiB"),
    "model_load": re.compile(r"Model loading took ([\d.]+) GiB(?: memory)? and ([\d.]+) seconds"),
    "graphs": re.compile(r"Graph capturing finished in ([\d.]+) secs?, took ([\d.-]+) GiB"),
    "init": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
    "backend": re.compile(r"Using (?:AttentionBackendEnum\.)?([A-Z0-9_]+_SPARSE)\b"),
}


def vllm_log(text: str, seq_len: int = 32768) -> dict:
    """KV cache and memory figures from a vLLM server's log: tokens the KV
    cache holds, bytes per token (the KV memory over those tokens), how many
    ``seq_len``-token sequences fit, model and CUDA-graph memory, the
    attention backend and indexer it chose."""
    f: dict = {}
    if m := _VLLM["kv_cache_tokens"].search(text):
        f["kv_cache_tokens"] = int(_num(m[1]))
    if m := _VLLM["max_concurrency"].search(text):
        f["max_model_len"] = int(_num(m[1]))
        f["max_concurrency"] = float(m[2])
    if m := _VLLM["available_kv_gib"].search(text):
        f["kv_cache_gib"] = float(m[1])
    if m := _VLLM["model_load"].search(text):
        f["weights_gib"] = float(m[1])
        f["load_s"] = float(m[2])
    if m := _VLLM["graphs"].search(text):
        f["graph_capture_s"] = float(m[1])
        f["graph_gib"] = float(m[2])
    if m := _VLLM["init"].search(text):
        f["init_s"] = float(m[1])
    if m := _VLLM["backend"].search(text):
        f["attention_backend"] = m[1]
    f["indexer"] = "triton" if "DSA indexer: Triton kernels" in text else "deepgemm"
    if f.get("kv_cache_tokens") and f.get("kv_cache_gib"):
        f["kv_bytes_per_token"] = round(f["kv_cache_gib"] * GIB / f["kv_cache_tokens"], 1)
    if f.get("kv_cache_tokens"):
        f[f"seqs_{seq_len // 1024}k"] = round(f["kv_cache_tokens"] / seq_len, 2)
    return f


# llama.cpp's KV cache lines (src/llama-kv-cache.cpp)
_LLAMA_KV = re.compile(r"llama_kv_cache\w*: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers")
_LLAMA_KV_BUF = re.compile(r"llama_kv_cache\w*: +(\S+) KV buffer size = +([\d.]+) MiB")


def llama_server_log(text: str) -> dict:
    """KV cache of a llama-server log: MiB, cells (tokens), bytes per token
    (the DSA indexer's cache is a second cache of its own: its lines add)."""
    f: dict = {}
    caches = _LLAMA_KV.findall(text)
    if caches:
        mib = sum(float(c[0]) for c in caches)
        cells = max(int(c[1]) for c in caches)
        f.update(kv_cache_gib=round(mib / 1024, 3), kv_cache_tokens=cells,
                 kv_bytes_per_token=round(mib * (1 << 20) / cells, 1) if cells else None)
    bufs = _LLAMA_KV_BUF.findall(text)
    if bufs:
        f["kv_buffers_mib"] = {b: float(m) for b, m in bufs}
    return f


def llama_bench(text: str) -> list[dict]:
    """llama-bench ``-o json``: one row per test (prompt tokens, generated
    tokens, depth, micro-batch, tokens/s mean and stddev)."""
    start = text.find("[")
    if start < 0:
        raise ValueError("llama-bench printed no JSON array")
    rows = json.loads(text[start:text.rindex("]") + 1])
    return [{"n_prompt": r["n_prompt"], "n_gen": r["n_gen"], "n_depth": r.get("n_depth", 0),
             "n_ubatch": r.get("n_ubatch"), "tok_s": r["avg_ts"], "tok_s_stddev": r["stddev_ts"],
             "type": r.get("model_type"), "n_gpu_layers": r.get("n_gpu_layers")}
            for r in rows]


def llama_bench_test(row: dict) -> str:
    """llama-bench's own name of a test (pp16384, tg128 @ d4096), with the
    micro-batch of a prompt test (pp16384 ub2048)."""
    name = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
    if row["n_prompt"] and row.get("n_ubatch"):
        name += f" ub{row['n_ubatch']}"
    return name + (f" @ d{row['n_depth']}" if row["n_depth"] else "")


# vLLM's Prometheus counters of its prefix cache, in prompt tokens
# (v1/metrics/loggers.py), one sample per engine
_PREFIX_CACHE = re.compile(
    r"^vllm:prefix_cache_(queries|hits)_total(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


def prefix_cache(text: str) -> dict | None:
    """Prompt tokens looked up in and served from vLLM's prefix cache so
    far, summed over engines, from the server's /metrics text; None where
    the counters are absent (llama-server, prefix caching off)."""
    found = {"queries": 0.0, "hits": 0.0}
    seen = False
    for kind, value in _PREFIX_CACHE.findall(text):
        found[kind] += float(value)
        seen = True
    return found if seen else None


def nvidia_smi_mib(text: str) -> float | None:
    """Memory used (MiB) from `nvidia-smi --query-gpu=memory.used
    --format=csv,noheader,nounits` (first GPU)."""
    for line in text.splitlines():
        line = line.strip()
        if line:
            try:
                return float(line.split(",")[0])
            except ValueError:
                return None
    return None
