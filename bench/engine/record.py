# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine benchmark's data and its document.

``bench/results/<card>/engine.jsonl`` (bench/benchdata.py's format: a run
record, then one row per measured case) with these tables:

- ``files``: a GGUF file (checkpoint, type): bytes, tensor types,
  parameters, the routing check, build seconds;
- ``servers``: one server start (file, path; its round with --rounds):
  what vLLM chose (backend, indexer), weights / KV cache / CUDA-graph
  memory, KV tokens, bytes per token, 32k-token sequences that fit, GPU
  memory, start seconds, command;
- ``serve``: one workload against one server (`vllm bench serve`): output
  and total tok/s, TTFT / TPOT / ITL percentiles, per-stream and prefill
  tok/s, the prompt tokens the prefix cache was asked for and served
  (vLLM's /metrics), command;
- ``llama_bench``: llama.cpp's own tool on the file (pp / tg at depth).

``engine.md`` is rendered from it, next to it (bench/render.py's style:
deterministic, the same data give the same bytes). The profile
(bench/engine/step_profile.py) is ``engine_profile.jsonl``, one ``profile`` row
per (file, path, scenario), rendered to ``engine_profile.md``.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from benchdata import read
from render import fmt, header, table

from . import estimate

PEER = "flashmla-bf16"
OURS = "triton-fp16"
ENGINE_DOC = "../../../docs/performance.md"


def _gb(b) -> str:
    return "" if b is None else f"{b / 1e9:.2f}"


def _types(t: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(t.items(), key=lambda kv: -kv[1]))


# (figure, its column, format) of the Across rounds table
ROUND_FIGURES = [("output_tok_s", "output tok/s", ".1f"), ("tpot_p50_ms", "TPOT p50 ms", ".2f"),
                 ("itl_p50_ms", "ITL p50 ms", ".2f"), ("ttft_p50_ms", "TTFT p50 ms", ".1f")]


def across_rounds(serve: list[tuple[dict, dict]]) -> list[str]:
    """Each (file, workload, path): its rounds' median, and their range
    (min–max) with its width as a share of the median."""
    groups: dict[tuple, list[dict]] = {}
    for i, f in serve:
        groups.setdefault((f"{i['checkpoint']} {i['type']}", i["workload"], i["path"]),
                          []).append(f)
    cells = []
    for key, figs in groups.items():
        row = [*key, str(len(figs))]
        for name, _, spec in ROUND_FIGURES:
            v = [f[name] for f in figs if f.get(name) is not None]
            if not v:
                row.append("")
                continue
            m = statistics.median(v)
            width = f" ±{50 * (max(v) - min(v)) / m:.0f} %" if m else ""
            row.append(f"{fmt(m, spec)} ({fmt(min(v), spec)}–{fmt(max(v), spec)}{width})")
        cells.append(row)
    out = ["## Across rounds", "",
           ("Median of the rounds (range; ± half its width as a share of the median). "
            "Two paths differ past their noise where their ranges do not overlap."), ""]
    out += table(["file", "workload", "path", "rounds", *[c for _, c, _ in ROUND_FIGURES]],
                 "lllr" + "r" * len(ROUND_FIGURES), cells)
    return [*out, ""]


def _hit_pct(f: dict) -> float | None:
    q = f.get("prefix_cache_query_tokens")
    return 100.0 * f["prefix_cache_hit_tokens"] / q if q else None


_SEED = re.compile(r"--seed (\d+)")
# the KV cache's block: vLLM serves whole blocks of a prompt, never its last token
KV_BLOCK = 64


def shared_prompts(serve: list[tuple[dict, dict]]) -> dict[int, float]:
    """Runs before each workload had its own seed: per row index, the share
    of a vLLM workload's prompt tokens that earlier workloads of the same
    server and seed had computed (the random dataset started prompt i of
    every workload at the same token). Nothing evicted assumed: an upper
    bound. Rows with measured counters or their own seed are left out."""
    done: dict[tuple, list[tuple[int, int, str]]] = {}
    shares = {}
    for k, (i, f) in enumerate(serve):
        if i["path"] == "llama.cpp":
            continue
        seed = _SEED.search(f.get("command", ""))
        if not seed:
            continue
        server = (i["checkpoint"], i["type"], i["path"], i.get("round"))
        before = done.setdefault(server, [])
        n, length = i["num_prompts"], i["input_len"]
        if "prefix_cache_query_tokens" not in f:
            cached = 0
            for j in range(n):
                common = max((min(length, n2_len) for n2, n2_len, s in before
                              if s == seed[1] and j < n2), default=0)
                cached += min(common, length - 1) // KV_BLOCK * KV_BLOCK
            if cached:
                shares[k] = 100.0 * cached / (n * length)
        before.append((n, length, seed[1]))
    return shares


def engine_md(run: dict, rows: list[dict]) -> str:
    out = ["# Engine: `vllm serve` under `vllm bench serve`, peers in the same run", ""]
    out += [*header(run), ""]
    env = run["env"]
    if env.get("quick"):
        out += ["**Quick run** (`--quick`): a subset of files, paths and workloads.", ""]
    seeds = {m[1] for r in rows if r["table"] == "serve"
             if (m := _SEED.search(r["figures"].get("command", "")))}
    prompts = ("every measured workload's prompts drawn with one seed (≤ below; runs since "
               "give each workload its own)" if seeds == {"0"} else
               "every workload and warm-up its own prompts. Cache hit %: the measured prompt "
               "tokens vLLM's prefix cache served (the server's /metrics before and after)")
    out += [
        ("Checkpoints: random weights at one tensor-parallel rank's shapes of the real models "
         "(bench/engine/spec.py), a few layers each: figures are the slice's, not the whole "
         "model's. Each workload: `vllm bench serve`, random dataset, greedy, EOS ignored, "
         f"after a warm-up invocation on other prompts that is not counted; {prompts}. "
         "CUDA graphs on, vLLM's defaults otherwise. × upstream = this path's figure / "
         "FLASHMLA_SPARSE bf16's on the same file and workload (throughput: higher is better; "
         "TTFT: lower)."),
        "",
    ]
    files = [(r["inputs"], r["figures"]) for r in rows if r["table"] == "files"]
    if files:
        out += ["## Files", ""]
        out += table(
            ["checkpoint", "type", "GB", "parameters", "tensor types", "routing max/mean load",
             "build s"],
            "llrrlrr",
            [[i["checkpoint"], i["type"], _gb(f.get("bytes")), fmt(f.get("parameters"), ",") ,
              _types(f.get("types", {})), fmt(f.get("routing_max_over_mean"), ".2f"),
              fmt(f.get("build_s"), ".0f")] for i, f in files],
        )  # fmt: skip
        out.append("")
    rounds = bool(env.get("rounds"))
    if rounds:
        out += [(f"Rounds: {env['rounds']}: each vLLM path's server started {env['rounds']} "
                 "times, the paths in turn (A B A B); × upstream against the same round's "
                 "peer; the medians and ranges are under Across rounds."), ""]

    def path_of(i: dict) -> str:
        return f"{i['path']} #{i['round']}" if "round" in i else i["path"]

    servers = [(r["inputs"], r["figures"]) for r in rows if r["table"] == "servers"]
    if servers:
        out += ["## Servers", ""]
        out += table(
            ["file", "path", "backend", "indexer", "weights GiB", "KV GiB", "KV tokens",
             "KV B/token", "32k seqs", "GPU MiB", "start s"],
            "llllrrrrrrr",
            [[f"{i['checkpoint']} {i['type']}", path_of(i), f.get("attention_backend", ""),
              f.get("indexer", "") if i["path"] != "llama.cpp" else "",
              fmt(f.get("weights_gib"), ".2f"), fmt(f.get("kv_cache_gib"), ".2f"),
              fmt(f.get("kv_cache_tokens"), ","), fmt(f.get("kv_bytes_per_token"), ".0f"),
              fmt(f.get("seqs_32k"), ".1f"), fmt(f.get("gpu_mib_ready"), ".0f"),
              fmt(f.get("start_s"), ".0f")] for i, f in servers],
        )  # fmt: skip
        out.append("")
    serve = [(r["inputs"], r["figures"]) for r in rows if r["table"] == "serve"]
    if serve:
        peer = {(i["checkpoint"], i["type"], i["workload"], i.get("round")): f
                for i, f in serve if i["path"] == PEER}

        def ratio(i: dict, f: dict, key: str) -> str:
            p = peer.get((i["checkpoint"], i["type"], i["workload"], i.get("round")))
            if i["path"] == PEER or not p or not p.get(key) or f.get(key) is None:
                return ""
            return f"{f[key] / p[key]:.2f}"

        shared = shared_prompts(serve)

        def hits(k: int, f: dict) -> str:
            return f"≤ {shared[k]:.1f}" if k in shared else fmt(_hit_pct(f), ".1f")

        out += ["## Workloads", ""]
        out += table(
            ["file", "workload", "path", "output tok/s", "total tok/s", "× upstream",
             "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "tok/s per stream",
             "prefill tok/s", "cache hit %", "failed"],
            "lllrrrrrrrrrrr",
            [[f"{i['checkpoint']} {i['type']}", i["workload"], path_of(i),
              fmt(f.get("output_tok_s"), ".1f"), fmt(f.get("total_tok_s"), ".1f"),
              ratio(i, f, "prefill_tok_s" if i["kind"] == "prefill" else "output_tok_s"),
              fmt(f.get("ttft_p50_ms"), ".1f"), fmt(f.get("ttft_p99_ms"), ".1f"),
              fmt(f.get("itl_p50_ms"), ".2f"), fmt(f.get("itl_p99_ms"), ".2f"),
              fmt(f.get("decode_tok_s_per_stream"), ".1f"), fmt(f.get("prefill_tok_s"), ".0f"),
              hits(k, f), str(f.get("failed", ""))] for k, (i, f) in enumerate(serve)],
        )  # fmt: skip
        out.append("")
        if shared:
            out += [("≤: not measured. In this run every workload drew its prompts with one "
                     "seed, so prompt i of a workload began as prompt i of every other; the "
                     "figure is the share of its prompt tokens that earlier workloads on the "
                     "same server had computed, which the prefix cache could serve (none "
                     "evicted assumed). Those workloads' TTFT, prefill and throughput figures "
                     "are not of prompts computed in full."), ""]
        hit = [f"{i['checkpoint']} {i['type']} {path_of(i)} {i['workload']}"
               for i, f in serve if f.get("prefix_cache_hit_tokens")]
        if hit:
            out += [("**Prefix-cache hits** in " + "; ".join(hit) + ": their TTFT and "
                     "prefill figures are not those of prompts computed in full."), ""]
        if rounds:
            out += across_rounds(serve)
    checks = [(r["inputs"], r["figures"]) for r in rows if r["table"] == "consistency"]
    if checks:
        out += ["## Decode against prefill", "",
                ("Each prompt's continuation, decoded in batches of as many sequences, "
                 "again as a prompt: |decode logprob − prefill logprob| of each token "
                 "after the first, and how often the prefill's top-1 is the token decoded "
                 "(bench/engine/consistency.py)."), ""]
        out += table(
            ["file", "path", "sequences", "tokens compared", "|Δ| p50", "|Δ| p99", "|Δ| max",
             "top-1 agree %"],
            "llrrrrrr",
            [[f"{i['checkpoint']} {i['type']}", path_of(i), str(i["concurrency"]),
              fmt(f.get("compared"), ","), fmt(f.get("dlogprob_p50"), ".4f"),
              fmt(f.get("dlogprob_p99"), ".4f"), fmt(f.get("dlogprob_max"), ".4f"),
              fmt(100 * f["top1_agree"] if f.get("top1_agree") is not None else None, ".1f")]
             for i, f in checks],
        )  # fmt: skip
        out.append("")
    lb = [(r["inputs"], r["figures"]) for r in rows if r["table"] == "llama_bench"]
    if lb:
        out += ["## llama-bench (llama.cpp's own tool, same files)", ""]
        out += table(
            ["file", "test", "tok/s", "± stddev"],
            "llrr",
            [[f"{i['checkpoint']} {i['type']}", i["test"], fmt(f.get("tok_s"), ".1f"),
              fmt(f.get("tok_s_stddev"), ".1f")] for i, f in lb],
        )  # fmt: skip
        out.append("")
    cmds = [(r["inputs"], r["figures"]) for r in rows if r["table"] in ("servers", "serve")]
    if cmds:
        out += ["## Commands", "", "```"]
        seen = set()
        for i, f in cmds:
            for key in ("env", "command"):
                c = f.get(key)
                if c and c not in seen:
                    seen.add(c)
                    out.append(c)
        out += ["```", ""]
    out += [(f"Rendered by bench/bench_engine.py render from `engine.jsonl`; analysis: "
             f"[docs/performance.md]({ENGINE_DOC}).")]
    return "\n".join(out) + "\n"


def profile_md(run: dict, rows: list[dict]) -> str:
    out = ["# Engine profile: where the time of one step goes", ""]
    out += [*header(run), ""]
    out += [
        ("`vllm serve` with vLLM's torch profiler (worker only, no stacks), CUDA graphs on; "
         "each scenario's steps after the profiler's first two (decode), or the long prompt's "
         "chunks (prefill). Step: start to the next step's start (decode), or to its last "
         "kernel's end (prefill); GPU busy: the union of its kernels; not on the GPU: the "
         "rest (CPU work, launches, waiting). Kernel times are summed per category, so "
         "overlapping kernels can add up past the busy time."),
        "",
    ]
    prof = [(r["inputs"], r["figures"]) for r in rows if r["table"] == "profile"]
    if prof:
        out += ["## Steps", ""]
        out += table(
            ["file", "scenario", "path", "steps", "step µs", "GPU busy µs", "not on GPU µs",
             "batch"],
            "lllrrrrl",
            [[f"{i['checkpoint']} {i['type']}", i["scenario"], i["path"], str(f["steps"]),
              fmt(f["step_us"], ".1f"), fmt(f["gpu_busy_us"], ".1f"),
              fmt(f["not_gpu_us"], ".1f"),
              (f"{f['batch']['gen_requests']:g} decoding" if not f["batch"]["ctx_requests"]
               else f"{f['batch']['ctx_tokens']:g} prompt tokens")] for i, f in prof],
        )  # fmt: skip
        out.append("")
        out += ["## By category (µs per step, share of the step)", ""]
        out += [("Outside graphs: the part of a category's time launched on its own, not "
                 "in a captured CUDA graph (in decode, what runs around the model's graph: "
                 "the logits' projection, the sampler, input preparation)."), ""]
        cats = []
        for i, f in prof:
            outside = f.get("outside_graphs_us", {})
            for cat, us in f["categories_us"].items():
                cats.append([f"{i['checkpoint']} {i['type']}", i["scenario"], i["path"], cat,
                             fmt(us, ".1f"), f"{100 * us / f['step_us']:.1f} %",
                             fmt(outside.get(cat, 0.0), ".1f")])
        out += table(["file", "scenario", "path", "category", "µs", "share",
                      "outside graphs µs"], "llllrrr", cats)
        out.append("")
        out += ["## Largest kernels", ""]
        top = [[i["scenario"], i["path"], k["category"],
                "`" + k["kernel"].replace("|", "\\|") + "`", fmt(k["us"], ".1f")]
               for i, f in prof for k in f["top_kernels"][:8]]
        out += table(["scenario", "path", "category", "kernel", "µs per step"], "llllr", top)
        out.append("")
        out += ["## Commands", "", "```"]
        seen = []
        for _, f in prof:
            if f.get("command") and f["command"] not in seen:
                seen.append(f["command"])
        out += [*seen, "```", ""]
    out += [(f"Rendered by bench/bench_engine.py render from `engine_profile.jsonl`; "
             f"analysis: [docs/performance.md]({ENGINE_DOC}).")]
    return "\n".join(out) + "\n"


# bench -> {file: renderer}, in bench/render.py's shape (for its RENDERERS)
RENDERERS = {"engine": {"engine.md": engine_md},
             "engine_profile": {"engine_profile.md": profile_md,
                                "engine_estimate.md": estimate.estimate_md}}


def render(root: Path, check: bool = False) -> list[str]:
    problems = []
    sources = [(src, src.parent / name, renderer)
               for bench, files in RENDERERS.items()
               for src in sorted(Path(root).glob(f"*/{bench}.jsonl"))
               for name, renderer in files.items()]
    for src, target, renderer in sources:
        run, rows = read(src)
        content = renderer(run, rows).encode()
        if check:
            if not target.exists() or target.read_bytes() != content:
                problems.append(f"{target}: differs from what {src.name} renders")
        elif not target.exists() or target.read_bytes() != content:
            target.write_bytes(content)
            print(f"wrote {target}")
    return problems
