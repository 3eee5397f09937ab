# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the engine benchmark runs: the workload matrix, the engines' paths
and every command line. Plain data, no torch, no GPU: the CPU tests check
the exact arguments; run.py only starts what is built here.

One variable at a time: within a run every vLLM path starts with the same
arguments but the ones that define the path (backend, dtype, the indexer's
switch, the reported SM), on the same GGUF file, with the same max model
length; every workload is the same `vllm bench serve` invocation against
each server (random dataset, greedy, EOS ignored). Warm-up: before each
workload one short invocation whose figures are dropped. Every workload and
every warm-up has its own seed (``prompt_seed``): the random dataset starts
prompt i at token ``offset_i + i`` with the offsets drawn from the seed, so
under one seed prompt i of a shorter workload is a prefix of prompt i of a
longer one, and the server's prefix cache would serve a later workload's
prompts from an earlier one's.
CUDA graphs and vLLM's defaults otherwise (prefix caching, chunked prefill,
KV cache 0.9 of the GPU) are left as users get them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

SERVED_NAME = "bench"
SEED = 0


@dataclass(frozen=True)
class Workload:
    name: str
    # "single" (one stream, decode at a context), "concurrent", "prefill";
    # "consistency" (consistency.py, not `vllm bench serve`)
    kind: str
    input_len: int
    output_len: int
    concurrency: int
    num_prompts: int
    warmup_prompts: int = 1

    @property
    def context(self) -> int:
        return self.input_len + self.output_len


def _single(ctx: int, prompts: int) -> Workload:
    return Workload(f"single-{ctx // 1024}k", "single", ctx, 256, 1, prompts)


def _concurrent(n: int, waves: int = 2) -> Workload:
    return Workload(f"concurrent-{n}", "concurrent", 2048, 512, n, waves * n,
                    warmup_prompts=n)


def _prefill(n: int, prompts: int) -> Workload:
    return Workload(f"prefill-{n // 1024}k", "prefill", n, 1, 1, prompts)


WORKLOADS = {
    w.name: w
    for w in [
        _single(4096, 3), _single(32768, 2), _single(131072, 2),
        _concurrent(8), _concurrent(32), _concurrent(64),
        _prefill(4096, 4), _prefill(16384, 3), _prefill(65536, 2),
        # last: the others' prompt seeds (prompt_seed) stay as recorded
        _concurrent(128),
        # decode batches of 256 tokens, inside vLLM's captured sizes (to 512);
        # one wave, so that its prompts share no start with the others'
        _concurrent(256, waves=1),
    ]
}
QUICK_WORKLOADS = ["single-4k", "concurrent-32", "prefill-16k"]
# After a vLLM server's workloads: its decode against its prefill
# (consistency.py), this many prompts at once (decode batches of as many
# sequences: 256 is past the grouped and vector kernels' crossover, inside
# the captured sizes), 64 tokens each, 24 decoded.
CONSISTENCY_PROMPTS = 256


def consistency(n: int) -> Workload:
    return Workload(f"consistency-{n}", "consistency", 64, 24, n, n, warmup_prompts=0)


def prompt_seed(w: Workload, warmup: bool = False) -> int:
    """The random dataset's seed of ``w``'s measured prompts, or of its
    warm-up's: a different one for each (see the module's docstring)."""
    return 1000 + 2 * list(WORKLOADS).index(w.name) + int(warmup)


@dataclass(frozen=True)
class VllmPath:
    name: str
    about: str
    args: tuple[str, ...]
    env: dict = field(default_factory=dict)
    report_sm: str | None = None  # run with tests/e2e/report_sm on PYTHONPATH


PATHS = {
    p.name: p
    for p in [
        VllmPath("triton-fp16", "the series: TRITON_MLA_SPARSE + Triton indexer, fp16",
                 ("--attention-backend", "TRITON_MLA_SPARSE", "--dtype", "float16"),
                 {"VLLM_DSA_INDEXER_TRITON": "1"}),
        VllmPath("auto-sm120", "the series' automatic choice, device reported as SM 12.0, fp16",
                 ("--dtype", "float16"),
                 {"E2E_REPORT_SM": "12.0", "VLLM_USE_FLASHINFER_MOE_FP16": "0"}, "12.0"),
        # what SM120 runs without 0036's Marlin copy: ggml's MMQ for the
        # linears' batches below 32 tokens (the float path's thresholds hold
        # on SM90 only)
        VllmPath("auto-sm120-no-marlin-linears", "the series' automatic choice, device "
                 "reported as SM 12.0, fp16, without the dense Marlin copy of Q4_K/Q4_0/Q8_0 "
                 "linear layers (VLLM_GGUF_MARLIN_LINEARS=0: ggml's MMQ below 32 tokens)",
                 ("--dtype", "float16"),
                 {"E2E_REPORT_SM": "12.0", "VLLM_USE_FLASHINFER_MOE_FP16": "0",
                  "VLLM_GGUF_MARLIN_LINEARS": "0"}, "12.0"),
        VllmPath("triton-fp16-ggml", "the series' path with vLLM 0.23's choice of GGUF kernels "
                 "(VLLM_GGUF_KERNELS=upstream: ggml's kernels at every batch size)",
                 ("--attention-backend", "TRITON_MLA_SPARSE", "--dtype", "float16"),
                 {"VLLM_DSA_INDEXER_TRITON": "1", "VLLM_GGUF_KERNELS": "upstream"}),
        VllmPath("triton-fp16-nomarlin", "the series' path without the Marlin repack of "
                 "Q4_K/Q4_0/Q8_0 routed experts and with ggml's vector kernel for every "
                 "imatrix type's down projection (VLLM_GGUF_KERNELS=ggml)",
                 ("--attention-backend", "TRITON_MLA_SPARSE", "--dtype", "float16"),
                 {"VLLM_DSA_INDEXER_TRITON": "1", "VLLM_GGUF_KERNELS": "ggml"}),
        VllmPath("triton-fp16-fused", "the series' path with the fused GGUF MoE for "
                 "prefill-size batches (VLLM_GGUF_KERNELS=fused, experimental)",
                 ("--attention-backend", "TRITON_MLA_SPARSE", "--dtype", "float16"),
                 {"VLLM_DSA_INDEXER_TRITON": "1", "VLLM_GGUF_KERNELS": "fused"}),
        VllmPath("triton-fp16-no-marlin-linears", "the series' path without the dense "
                 "Marlin copy of Q4_K/Q4_0/Q8_0 linear layers (VLLM_GGUF_MARLIN_LINEARS=0: "
                 "gguf.py's choice of kernels at every batch size)",
                 ("--attention-backend", "TRITON_MLA_SPARSE", "--dtype", "float16"),
                 {"VLLM_DSA_INDEXER_TRITON": "1", "VLLM_GGUF_MARLIN_LINEARS": "0"}),
        VllmPath("triton-fp16-lm-head-gguf", "the series' path with a quantized lm_head "
                 "on its GGUF blocks only (VLLM_GGUF_LM_HEAD_FLOAT=0: no float weight kept)",
                 ("--attention-backend", "TRITON_MLA_SPARSE", "--dtype", "float16"),
                 {"VLLM_DSA_INDEXER_TRITON": "1", "VLLM_GGUF_LM_HEAD_FLOAT": "0"}),
        # upstream as vLLM 0.23 runs it: its attention, indexer and GGUF kernels
        VllmPath("flashmla-bf16", "upstream: FLASHMLA_SPARSE + DeepGEMM indexer, bf16, "
                 "vLLM 0.23's GGUF kernels",
                 ("--attention-backend", "FLASHMLA_SPARSE", "--dtype", "bfloat16"),
                 {"VLLM_GGUF_KERNELS": "upstream"}),
    ]
}
LLAMA_CPP = "llama.cpp"
QUICK_PATHS = ["triton-fp16", "flashmla-bf16", LLAMA_CPP]
FULL_PATHS = ["triton-fp16", "triton-fp16-nomarlin", "triton-fp16-ggml", "triton-fp16-fused",
              "auto-sm120", "flashmla-bf16", LLAMA_CPP]

# (checkpoint, GGUF type) pairs of a full run, and of --quick
FULL_FILES = [
    ("glm5-tp8", "q4_k_m"), ("glm5-tp8", "q8_0"), ("glm5-tp8", "f16"),
    ("glm5-tp8", "mix-iq2_xxs"), ("glm5-tp4", "q4_k_m"), ("glm52-tp8", "q4_k_m"),
    ("dsv32-tp8", "q4_k_m"), ("glm5-full", "q4_k_m"),
]
QUICK_FILES = [("glm5-tp8", "q4_k_m")]


def max_model_len(workloads: list[Workload], block: int = 1024) -> int:
    """One length for every server of a run: the longest workload's
    context, rounded up to ``block``."""
    need = max(w.context for w in workloads)
    return -(-need // block) * block


def vllm_serve(path: VllmPath, gguf: Path, hf: Path, port: int, max_len: int,
               python: str = "python3", kv_cache_gib: float | None = None) -> list[str]:
    """`vllm serve` for one path (the module entry point of the installed
    wheel: the same code as the `vllm` script). kv_cache_gib: a KV cache of
    that size instead of vLLM's share of the GPU's memory (servers started
    together: vLLM's memory profiling would count the others' memory), with
    5 % of the GPU's memory free at start, vLLM's check."""
    together = [] if kv_cache_gib is None else [
        "--kv-cache-memory-bytes", str(int(kv_cache_gib * (1 << 30))),
        "--gpu-memory-utilization", "0.05"]
    return [
        python, "-m", "vllm.entrypoints.cli.main", "serve", str(gguf),
        "--hf-config-path", str(hf), "--tokenizer", str(hf),
        "--served-model-name", SERVED_NAME,
        *path.args,
        "--max-model-len", str(max_len),
        *together,
        "--host", "127.0.0.1", "--port", str(port),
        "--seed", str(SEED),
    ]


def vllm_env(path: VllmPath, base: dict, report_sm_dir: Path) -> dict:
    env = dict(base, **path.env)
    if path.report_sm:
        env["PYTHONPATH"] = ":".join(p for p in (str(report_sm_dir), base.get("PYTHONPATH")) if p)
    return env


def bench_serve(w: Workload, port: int, hf: Path, result_dir: Path, result_file: str,
                warmup: bool = False, python: str = "python3") -> list[str]:
    """`vllm bench serve` for one workload against a server on ``port``
    (vLLM's or llama-server's OpenAI completions endpoint)."""
    prompts = w.warmup_prompts if warmup else w.num_prompts
    out_len = min(w.output_len, 16) if warmup else w.output_len
    return [
        python, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
        "--endpoint", "/v1/completions",
        "--model", SERVED_NAME, "--tokenizer", str(hf),
        "--dataset-name", "random",
        "--random-input-len", str(w.input_len), "--random-output-len", str(out_len),
        "--random-range-ratio", "0",
        "--num-prompts", str(prompts), "--max-concurrency", str(w.concurrency),
        "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--seed", str(prompt_seed(w, warmup)), "--num-warmups", "0",
        "--disable-tqdm", "--save-result", "--result-dir", str(result_dir),
        "--result-filename", result_file,
    ]


def llama_server_slots(workloads: list[Workload]) -> tuple[int, int]:
    """(parallel slots, context) for one llama-server serving ``workloads``:
    as many slots as the highest concurrency, each as long as the longest
    context (llama-server splits -c evenly over -np slots)."""
    slots = max(w.concurrency for w in workloads)
    per_slot = max_model_len(workloads, 256)
    return slots, slots * per_slot


def llama_server(binary: Path, gguf: Path, port: int, slots: int, ctx: int) -> list[str]:
    return [
        str(binary), "-m", str(gguf), "--alias", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "-ngl", "999", "-fa", "on", "-c", str(ctx), "-np", str(slots),
        "--seed", str(SEED),
    ]


def llama_server_groups(workloads: list[Workload]) -> list[list[Workload]]:
    """Workloads that share one llama-server: the single-stream and prefill
    ones (1 slot, the longest context), the concurrent ones (a slot per
    stream, 2k + 512 each)."""
    one = [w for w in workloads if w.concurrency == 1]
    many = [w for w in workloads if w.concurrency > 1]
    return [g for g in (one, many) if g]


def llama_bench(binary: Path, gguf: Path, workloads: list[Workload]) -> list[list[str]]:
    """llama.cpp's own tool on the same file: prompt processing at each
    prefill length, token generation at each single-stream context. Prompts
    at llama.cpp's default micro-batch (512 tokens, what llama-server ran)
    and at 2048, which users raise it to for prompt speed."""
    base = [str(binary), "-m", str(gguf), "-ngl", "999", "-fa", "1", "-o", "json"]
    cmds = []
    pp = [w.input_len for w in workloads if w.kind == "prefill"]
    if pp:
        cmds.append([*base, "-p", ",".join(map(str, pp)), "-n", "0", "-ub", "512,2048",
                     "-r", "2"])
    tg = [w.input_len for w in workloads if w.kind == "single"]
    if tg:
        cmds.append([*base, "-p", "0", "-n", "128", "-d", ",".join(map(str, tg)), "-r", "2"])
    return cmds


def plan(quick: bool, files: list[tuple[str, str]] | None = None,
         paths: list[str] | None = None, workloads: list[str] | None = None) -> dict:
    """What a run does, in order: per file, per path, the workloads. A path
    given as ``<path>:<workload>+<workload>`` runs only those of the run's
    workloads (``only``), so that paths of one run may measure different
    subsets with one max model length."""
    files = files or (QUICK_FILES if quick else FULL_FILES)
    names = workloads or (QUICK_WORKLOADS if quick else list(WORKLOADS))
    for n in names:
        if n not in WORKLOADS:
            raise ValueError(f"unknown workload {n!r} (known: {', '.join(WORKLOADS)})")
    only: dict[str, list[str]] = {}
    picked = []
    for item in paths or (QUICK_PATHS if quick else FULL_PATHS):
        p, _, subset = item.partition(":")
        if p != LLAMA_CPP and p not in PATHS:
            raise ValueError(f"unknown path {p!r} (known: {', '.join([*PATHS, LLAMA_CPP])})")
        if subset:
            only[p] = subset.split("+")
            for n in only[p]:
                if n not in names:
                    raise ValueError(f"path {p}: workload {n!r} is not one of the run's "
                                     f"({', '.join(names)})")
        picked.append(p)
    return {"files": files, "paths": picked, "workloads": [WORKLOADS[n] for n in names],
            "only": only}


def path_workloads(plan: dict, path: str) -> list[Workload]:
    """The run's workloads that ``path`` measures, in the run's order."""
    only = plan.get("only", {}).get(path)
    return [w for w in plan["workloads"] if only is None or w.name in only]
