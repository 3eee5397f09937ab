# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the time of one engine step goes: `vllm serve` with vLLM's own
torch profiler (``--profiler-config``), driven into a steady state, and the
worker's trace cut into engine steps.

Scenarios (SCENARIOS): decode of 1 to 32 sequences whose prompts fill
a given context (the profile starts once every prompt is prefilled), and
one long prefill. The worker annotates every step with its batch
("execute_context_<requests>(<tokens>)_generation_<requests>(<tokens>)");
every GPU kernel belongs to the step launched last before it (correlation
ids of its launch, through the CUDA runtime or, for Triton's kernels, the
driver API: a CUDA graph's kernels share its launch's), and
to a category (CATEGORIES, by kernel name; kernels launched inside vLLM's
"gpu_model_runner: sample" scope are the sampler's). Per step kind
(decode, prefill): the step period (start to next start), the GPU's busy
time (the union of its kernels) and the rest (CPU work and launch gaps),
and each category's kernel time.
"""

from __future__ import annotations

import gzip
import json
import re
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# (category, kernel-name pattern), first match wins: the shares
CATEGORIES = [
    ("indexer: K cache write", r"indexer_k_quant|indexer_k_cache"),
    ("indexer: logits", r"mqa_logits"),
    ("indexer: top-k", (r"topkperrow|top_k_per_row|persistent_topk|_prepare_uniform_decode|"
                       r"_build_prefill_chunk_metadata")),
    ("sparse attention", (r"sparse_mla|flash_fwd.*mla|sparse_prefill|splitkv_mla|flashmla|"
                         r"mla.*combine|sparse_attn")),
    ("MLA KV cache write", r"concat_and_cache|reshape_and_cache"),
    # the float paths' dequantization (0024's Triton kernel, ggml's), experts and linears
    ("GGUF dequantize", r"_dequantize(_iq)?_kernel|dequantize_block"),
    # routed experts: ggml's kernels, the Triton fused MoE of the float path, 0023's
    ("GGUF MoE", r"\bmoe_q\d|moe_vec_q|fused_moe_kernel|gguf_moe_gemm"),
    ("GGUF linears", r"mul_mat_vec_q|mul_mat_q|quantize_q8_1"),
    ("MoE routing", (r"grouped_topk|topk_softmax|topk_sigmoid|moe_align|moe_sum|router_gemm|"
                    r"count_and_sort")),
    ("dense GEMMs", r"gemm|gemv|nvjet|cutlass|xmma|cublas|splitkreduce|bmm"),
    ("all-reduce", r"nccl|all_?reduce|cross_device"),
    ("norms, RoPE, quantization, elementwise",
     (r"norm|rotary|rope|quant|triton_|act_and_mul|silu|elementwise|vectorized|copy|fill|"
     r"cat|index|reduce|memcpy|memset")),
]
_COMPILED = [(c, re.compile(p, re.I)) for c, p in CATEGORIES]
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
GRAPH_LAUNCH = "cudaGraphLaunch"
SAMPLER = "sampler"
OTHER = "other"
SAMPLE_SCOPE = "gpu_model_runner: sample"
LONG_PREFILL = 1024  # prefill steps of at least this many prompt tokens
_STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")


def category(kernel: str) -> str:
    for name, pattern in _COMPILED:
        if pattern.search(kernel):
            return name
    return OTHER


def load_trace(path: Path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


@dataclass
class Step:
    start: float  # µs, CPU clock of the trace
    end: float
    ctx_requests: int
    ctx_tokens: int
    gen_requests: int
    gen_tokens: int

    @property
    def kind(self) -> str:
        if not self.ctx_requests:
            return "decode"
        return "prefill" if not self.gen_requests else "mixed"


def _steps(events: list[dict]) -> list[Step]:
    out = []
    for e in events:
        m = e.get("ph") == "X" and _STEP.fullmatch(e.get("name", ""))
        if m and e.get("cat") != "gpu_user_annotation":
            out.append(Step(e["ts"], e["ts"] + e["dur"], *map(int, m.groups())))
    return sorted(out, key=lambda s: s.start)


def _within(spans: list[tuple[float, float]], t: float) -> int | None:
    """Index of the span (sorted by start, not overlapping but for their
    ends) holding t."""
    lo, hi = 0, len(spans) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if t < spans[mid][0]:
            hi = mid - 1
        elif t > spans[mid][1]:
            lo = mid + 1
        else:
            return mid
    return None


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(trace: dict, skip_first: int = 2) -> dict:
    """Per step kind (decode: after skip_first steps, the profiler's own
    start; prefill: the steps of LONG_PREFILL tokens or more): how many
    steps, their mean period and GPU busy time (µs), the rest, and each
    category's kernel time per step, plus the kernels that take the most
    time."""
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict)]
    steps = _steps(events)
    if not steps:
        raise ValueError("no engine steps in the trace (vLLM's execute_context_... annotations): "
                         "was it the worker's trace of a profiled `vllm serve`?")
    # a step's launches: from its start to the next step's (vLLM samples after
    # its execute_model annotation ends, in sample_tokens)
    spans = [(s.start, nxt.start) for s, nxt in zip(steps, steps[1:])]
    spans.append((steps[-1].start, float("inf")))
    samples = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("ph") == "X" and e.get("name") == SAMPLE_SCOPE
                     and e.get("cat") != "gpu_user_annotation")
    launches = {}  # correlation id -> (launch time on the CPU, a CUDA graph's?)
    for e in events:
        # Triton launches through the driver API (cuLaunchKernel[Ex]), the rest
        # through the runtime
        if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (e["ts"], e.get("name") == GRAPH_LAUNCH)
    per_step: list[list[tuple[str, str, float, float]]] = [[] for _ in steps]
    eager: list[dict[str, float]] = [{} for _ in steps]  # per category, outside graphs
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        t, graphed = launches.get(e.get("args", {}).get("correlation"), (None, False))
        i = None if t is None else _within(spans, t)
        if i is None:
            continue
        name = e.get("name", "")
        cat = SAMPLER if _within(samples, t) is not None else category(name)
        per_step[i].append((name, cat, e["ts"], e["ts"] + e["dur"]))
        if not graphed:
            eager[i][cat] = eager[i].get(cat, 0.0) + e["dur"]
    out = {}
    for kind in ("decode", "prefill"):
        idx = [i for i, s in enumerate(steps) if s.kind == kind]
        if kind == "decode":
            # the profiler's own first steps out; a step's period runs to the
            # next step's start, when that one decodes too
            idx = [i for i in idx[skip_first:]
                   if i + 1 < len(steps) and steps[i + 1].kind == "decode"]
            periods = [steps[i + 1].start - steps[i].start for i in idx]
        else:
            # the long prompt's chunks (not a short request's), each from its
            # start to its last kernel's end
            idx = [i for i in idx if steps[i].ctx_tokens >= LONG_PREFILL and per_step[i]]
            periods = [max(b for *_, b in per_step[i]) - steps[i].start for i in idx]
        if not idx:
            continue
        n = len(idx)
        period = sum(periods) / n
        busy = sum(_union([(a, b) for _, _, a, b in per_step[i]]) for i in idx) / n
        cats: dict[str, float] = {}
        outside: dict[str, float] = {}
        kernels: dict[tuple[str, str], float] = {}
        for i in idx:
            for name, cat, a, b in per_step[i]:
                cats[cat] = cats.get(cat, 0.0) + (b - a) / n
                kernels[(name, cat)] = kernels.get((name, cat), 0.0) + (b - a) / n
            for cat, us in eager[i].items():
                outside[cat] = outside.get(cat, 0.0) + us / n
        top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
        out[kind] = {
            "steps": n,
            "batch": {"ctx_requests": round(sum(steps[i].ctx_requests for i in idx) / n, 2),
                      "ctx_tokens": round(sum(steps[i].ctx_tokens for i in idx) / n, 1),
                      "gen_requests": round(sum(steps[i].gen_requests for i in idx) / n, 2)},
            "step_us": round(period, 1),
            "gpu_busy_us": round(busy, 1),
            "not_gpu_us": round(max(period - busy, 0.0), 1),
            "categories_us": {k: round(v, 1) for k, v in sorted(cats.items(),
                                                              key=lambda kv: -kv[1])},
            # launched on their own, not in a captured CUDA graph (decode: what
            # runs around the model's graph, the logits' projection among it)
            "outside_graphs_us": {k: round(v, 1) for k, v in sorted(outside.items(),
                                                                   key=lambda kv: -kv[1])},
            "top_kernels": [{"kernel": k[0][:120], "category": k[1], "us": round(v, 1)}
                            for k, v in top],
        }
    return out


def recut(path: Path, traces: Path, note: str) -> list[str]:
    """Cut again, with this module's rules, the traces that the profile rows
    of ``path`` (an engine_profile.jsonl) name, found under ``traces``: each
    row's figures are replaced, the run record is kept and ``note`` added to
    it. Returns what is wrong (a trace not found, a scenario without its
    steps); then the file is left as it was."""
    from benchdata import BenchData, read

    run, rows = read(path)
    data = BenchData(run["bench"], run["env"])
    data.figures = dict(run["figures"])
    data.notes = [*run["notes"], note]
    problems = []
    for r in rows:
        figures = dict(r["figures"])
        if r["table"] == "profile":
            found = sorted(Path(traces).rglob(figures.get("trace") or "-"))
            scenario = SCENARIOS.get(r["inputs"].get("scenario"))
            where = f"{path.name}: {r['inputs']}"
            if not found:
                problems.append(f"{where}: trace {figures.get('trace')!r} not under {traces}")
            elif scenario is None:
                problems.append(f"{where}: unknown scenario")
            else:
                summary = summarize(load_trace(found[0])).get(scenario.kind)
                if summary is None:
                    problems.append(f"{where}: no {scenario.kind} steps in {found[0].name}")
                else:
                    figures.update(summary)
        data.row(r["table"], r["inputs"], **figures)
    if not problems:
        data.write(Path(path).parent)
    return problems


# -- driving a server -----------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str  # "decode" or "prefill": the steps the figures are of
    streams: int
    context: int  # prompt tokens of each stream
    about: str


SCENARIOS = {
    s.name: s
    for s in [
        Scenario("decode-1-32k", "decode", 1, 32768, "one sequence decoding at 32k of context"),
        Scenario("decode-32-32k", "decode", 32, 32768,
                 "32 sequences decoding, each at 32k of context"),
        Scenario("decode-1-4k", "decode", 1, 4096, "one sequence decoding at 4k of context"),
        Scenario("decode-8-4k", "decode", 8, 4096, "8 sequences decoding at 4k"),
        Scenario("decode-16-4k", "decode", 16, 4096, "16 sequences decoding at 4k"),
        Scenario("decode-32-4k", "decode", 32, 4096, "32 sequences decoding at 4k"),
        Scenario("prefill-16k", "prefill", 1, 16384, "one 16k-token prompt"),
    ]
}
QUICK_SCENARIOS = ["decode-1-32k", "decode-32-32k", "prefill-16k"]
DECODE_TOKENS = 2048  # each decode stream's max_tokens: longer than the profile
# seconds for every stream of a decode scenario to have its first token (32
# prompts of 32k tokens prefill in about a minute on one H200)
START_S = 600.0


def profiler_config(trace_dir: Path) -> str:
    """--profiler-config: the torch profiler, worker only, no Python stacks
    (their overhead is in every launch), no table dumps."""
    return json.dumps({"profiler": "torch", "torch_profiler_dir": str(trace_dir),
                       "ignore_frontend": True, "torch_profiler_with_stack": False,
                       "torch_profiler_dump_cuda_time_total": False})


def _post(url: str, body: dict | None = None, timeout: float = 600) -> bytes:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def _prompt(rng_seed: int, n: int, vocab: int, first: int = 1000) -> list[int]:
    """n token ids, the same for the same seed (no torch: a small LCG)."""
    x, out = rng_seed * 2654435761 % 2**32, []
    for _ in range(n):
        x = (1103515245 * x + 12345) % 2**31
        out.append(first + x % (vocab - first))
    return out


def _stream(base: str, model: str, prompt: list[int], max_tokens: int, first: threading.Event,
            stop: threading.Event, errors: list) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=1800) as r:
            for line in r:
                if line.startswith(b"data:"):
                    first.set()
                if stop.is_set():
                    return  # closing the connection aborts the request
    except Exception as e:  # noqa: BLE001 - reported by the caller
        errors.append(f"{type(e).__name__}: {e}")
        first.set()


def drive(base: str, model: str, s: Scenario, vocab: int, trace_dir: Path,
          seconds: float = 1.0, start_timeout: float = START_S) -> Path:
    """Run one scenario against a profiled server at ``base``; returns the
    worker trace it wrote. A decode scenario whose streams have not all
    produced a token within ``start_timeout`` seconds (their prefills
    together) fails naming how many had."""
    before = set(trace_dir.glob("*.pt.trace.json*")) if trace_dir.exists() else set()
    errors: list[str] = []
    if s.kind == "decode":
        stop = threading.Event()
        firsts = [threading.Event() for _ in range(s.streams)]
        threads = [threading.Thread(target=_stream, daemon=True,
                                    args=(base, model, _prompt(100 + i, s.context, vocab),
                                          DECODE_TOKENS, firsts[i], stop, errors))
                   for i in range(s.streams)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + start_timeout
        for f in firsts:
            f.wait(max(0.0, deadline - time.monotonic()))
        if errors:
            raise RuntimeError(f"{s.name}: {errors[0]}")
        started = sum(f.is_set() for f in firsts)
        if started < s.streams:
            stop.set()
            raise RuntimeError(f"{s.name}: {started} of {s.streams} streams produced a token "
                               f"within {start_timeout:.0f} s")
        time.sleep(0.5)  # the last prefill's step done; decode alone from here
        _post(f"{base}/start_profile")
        time.sleep(seconds)
        _post(f"{base}/stop_profile")
        stop.set()
        for t in threads:
            t.join(60)
    else:
        _post(f"{base}/start_profile")
        _post(f"{base}/v1/completions", {"model": model, "prompt": _prompt(7, s.context, vocab),
                                         "max_tokens": 1, "temperature": 0})
        _post(f"{base}/stop_profile")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # the trace is written after stop_profile returns
        new = sorted(set(trace_dir.glob("*.pt.trace.json*")) - before)
        if new and not str(new[-1]).endswith(".tmp"):
            size = new[-1].stat().st_size
            time.sleep(2)
            if new[-1].stat().st_size == size:
                return new[-1]
        time.sleep(1)
    raise RuntimeError(f"{s.name}: no trace in {trace_dir} 300 s after stop_profile")


# -- a run ------------------------------------------------------------------------


def run(args, files: list[tuple[str, str]], paths: list[str], scenarios: list[str]) -> int:
    """Each file, each path's profiled server in turn, each scenario against
    it; bench/results/<card>/engine_profile.jsonl, rendered next to it."""
    import os
    import sys

    from benchdata import BenchData, environment, results_dir

    from . import record
    from . import workloads as wl
    from .run import REPORT_SM, START_TIMEOUT, Server, _shown, built_file, free_port

    env = environment()
    env["scenarios"] = scenarios
    data = BenchData("engine_profile", env)
    folder = results_dir(env.get("card", "unknown-card"), args.results)
    work = Path(args.work)
    models = Path(args.models)
    picked = [SCENARIOS[s] for s in scenarios]
    # room for every prompt and the tokens decoded while the profile runs
    max_len = -(-(max(s.context for s in picked) + DECODE_TOKENS) // 1024) * 1024
    failed = 0
    for name, gtype in files:
        info, gguf, hf = built_file(models, name, gtype)
        vocab = info["spec"]["vocab"]
        for path in paths:
            p = wl.PATHS[path]
            port = free_port()
            traces = (work / "traces" / f"{name}-{gtype}-{path}").resolve()
            traces.mkdir(parents=True, exist_ok=True)
            cmd = [*wl.vllm_serve(p, gguf, hf, port, max_len, python=sys.executable),
                   "--profiler-config", profiler_config(traces)]
            senv = dict(wl.vllm_env(p, dict(os.environ), REPORT_SM),
                        VLLM_CUSTOM_SCOPES_FOR_PROFILING="1")
            log = work / f"{name}-{gtype}-{path}-profile.log"
            print(f"[bench-engine profile] start {path} on {gguf.name}", flush=True)
            server = Server(cmd, senv, log, f"http://127.0.0.1:{port}/health")
            try:
                server.wait_ready(START_TIMEOUT, "BENCH_ENGINE_START_TIMEOUT")
                for s in picked:
                    print(f"[bench-engine profile] {path} {s.name}", flush=True)
                    trace = drive(f"http://127.0.0.1:{port}", wl.SERVED_NAME, s, vocab, traces)
                    summary = summarize(load_trace(trace)).get(s.kind)
                    if summary is None:
                        raise RuntimeError(f"{s.name}: no {s.kind} steps in {trace.name}")
                    data.row("profile", {"checkpoint": name, "type": gtype, "path": path,
                                         "scenario": s.name},
                             **summary, trace=trace.name,
                             command=_shown(cmd[:-2]) + " --profiler-config <torch, worker only>")
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                failed += 1
                data.notes.append(f"{name} {gtype} {path}: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''} (log: {log.name})")
                print(f"[bench-engine profile] FAILED {path}: {e}", flush=True)
            finally:
                server.stop()
                data.write(folder)
                record.render(folder.parent)
    return 1 if failed else 0
