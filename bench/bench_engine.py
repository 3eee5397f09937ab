#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine benchmark's command line (`make bench-engine` runs it through
scripts/run-bench-engine.sh); its modules are the package bench/engine.

    bench_engine.py plan [--quick]              # what a run does: files, servers, commands
    bench_engine.py build-models [--quick | --files glm5-tp8:q4_k_m,...] [--out DIR]
    bench_engine.py build-llama-cpp [--cache DIR]  # llama-server + llama-bench, CUDA, once
    bench_engine.py pack-llama-src DEST.tar.gz  # pinned llama.cpp source, trimmed (LLAMA_CPP_SRC)
    bench_engine.py run [--quick] [--files ...] [--paths ...] [--workloads ...] [--budget-s N]
                        [--rounds N]            # N servers a path, the paths in turn
    bench_engine.py profile [--quick] [--files ...] [--paths ...] [--scenarios ...]
                                                # where a step's time goes (GPU)
    bench_engine.py recut-profile --traces DIR [--results DIR]
                                                # engine_profile.jsonl cut again from its traces
    bench_engine.py render [--results DIR] [--check]  # engine*.md from their .jsonl

build-models, build-llama-cpp and pack-llama-src take the pinned llama.cpp
from scripts/ (patchseries): run them with scripts/ on PYTHONPATH, as
scripts/run-bench-engine.sh does.

Checkpoints: glm5-tp8, glm5-tp4, glm52-tp8, dsv32-tp8, glm5-full (bench/engine/spec.py);
types: f16, q8_0, q4_k_m, mix-iq2_xxs, mix-q2_k.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine import spec as specs
from engine import workloads as wl

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

MODELS = REPO / "build" / "bench-engine" / "models"
LLAMA_CACHE = REPO / "build" / "bench-engine" / "llama.cpp"
WORK = REPO / "build" / "bench-engine" / "work"


def _files(args) -> list[tuple[str, str]]:
    from engine.run import known_files

    return known_files(args.files) or (wl.QUICK_FILES if args.quick else wl.FULL_FILES)


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text}: a count of 1 or more")
    return n


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not x > 0:
        raise argparse.ArgumentTypeError(f"{text}: a size in GiB above 0")
    return x


def cmd_plan(args) -> int:
    plan = wl.plan(args.quick, _files(args), args.paths and args.paths.split(","),
                   args.workloads and args.workloads.split(","))
    max_len = wl.max_model_len(plan["workloads"])
    print(f"max model length {max_len}; workloads: "
          + ", ".join(w.name for w in plan["workloads"]))
    hf, port = Path("<models>/<checkpoint>/hf"), 8000
    for name, gtype in plan["files"]:
        s = specs.SPECS[name]
        print(f"\n# {name} {gtype}: {s.title}, {specs.parameter_count(s) / 1e9:.2f} B parameters")
        gguf = Path(f"<models>/{name}/{name}-{gtype}.gguf")
        for p in plan["paths"]:
            if p in plan["only"]:
                print(f"# {p}: {', '.join(plan['only'][p])} only")
            if p == wl.LLAMA_CPP:
                mine = wl.path_workloads(plan, p)
                for g in wl.llama_server_groups(mine):
                    slots, ctx = wl.llama_server_slots(g)
                    print(" ".join(wl.llama_server(Path("llama-server"), gguf, port, slots, ctx)))
                for c in wl.llama_bench(Path("llama-bench"), gguf, mine):
                    print(" ".join(c))
                continue
            path = wl.PATHS[p]
            env = " ".join(f"{k}={v}" for k, v in path.env.items())
            serve = wl.vllm_serve(path, gguf, hf, port, max_len, "python3")
            print(f"{env} {' '.join(serve)}".strip())
    print("\n# each workload, against each server:")
    for w in plan["workloads"]:
        print(" ".join(wl.bench_serve(w, port, hf, Path("<results>"), f"{w.name}.json")))
    return 0


def cmd_build_models(args) -> int:
    from engine import build

    out = Path(args.out)
    wanted: dict[str, list[str]] = {}
    for name, gtype in _files(args):
        wanted.setdefault(name, []).append(gtype)
    summary = {}
    for name, types in wanted.items():
        spec = specs.SPECS[name]
        if args.tiny:
            spec = specs.tiny(spec)
        info = build.build(spec, types, out, args.threads)
        summary[spec.name] = {
            "seconds": info["seconds"],
            "files": {t: f["bytes"] for t, f in info["files"].items()},
            "routing": {k: v["max_over_mean"] for k, v in info["routing"].items()},
        }
    print(json.dumps(summary, indent=1))
    return 0


def cmd_build_llama_cpp(args) -> int:
    from engine import llamacpp

    print(llamacpp.build(Path(args.cache), args.jobs))
    return 0


def cmd_pack(args) -> int:
    from engine import llamacpp

    dest = llamacpp.pack_source(Path(args.dest))
    print(f"{dest} ({dest.stat().st_size / 1e6:.1f} MB)")
    return 0


def cmd_run(args) -> int:
    from engine import run

    plan = wl.plan(args.quick, _files(args), args.paths and args.paths.split(","),
                   args.workloads and args.workloads.split(","))
    return run.Runner(args, plan).run()


def cmd_profile(args) -> int:
    from engine import step_profile as profile

    paths = args.paths.split(",") if args.paths else ["triton-fp16", "flashmla-bf16"]
    scenarios = (args.scenarios.split(",") if args.scenarios else
                 profile.QUICK_SCENARIOS if args.quick else list(profile.SCENARIOS))
    for name in scenarios:
        if name not in profile.SCENARIOS:
            raise SystemExit(f"--scenarios {name}: one of {', '.join(profile.SCENARIOS)}")
    for path in paths:
        if path not in wl.PATHS:
            raise SystemExit(f"--paths {path}: one of {', '.join(wl.PATHS)}")
    return profile.run(args, _files(args), paths, scenarios)


def cmd_recut_profile(args) -> int:
    from benchdata import repo_state
    from engine import record
    from engine import step_profile as profile

    sources = sorted(Path(args.results).glob("*/engine_profile.jsonl"))
    if not sources:
        raise SystemExit(f"--results {args.results}: no <card>/engine_profile.jsonl")
    # the traces' folder is where this machine kept them: not part of the record
    note = ("Steps cut again from the run's traces by `bench/bench_engine.py recut-profile` "
            f"(repo commit {repo_state()['commit']}).")
    problems = []
    for src in sources:
        problems += profile.recut(src, Path(args.traces), note)
    problems += record.render(Path(args.results))
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return 1 if problems else 0


def cmd_render(args) -> int:
    from engine import record

    problems = record.render(Path(args.results), args.check)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    from engine import step_profile as profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    sub = ap.add_subparsers(dest="command", required=True)

    def selection(p):
        p.add_argument("--quick", action="store_true", help="the ~11-minute subset")
        p.add_argument("--files", help="<checkpoint>:<type>,... instead of the run's list")

    p = sub.add_parser("plan", help="print what a run does")
    selection(p)
    p.add_argument("--paths")
    p.add_argument("--workloads")
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("build-models", help="build the GGUF files")
    selection(p)
    p.add_argument("--out", default=str(MODELS))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="tiny widths (a CPU smoke test)")
    p.set_defaults(fn=cmd_build_models)

    p = sub.add_parser("build-llama-cpp", help="llama-server + llama-bench with CUDA")
    p.add_argument("--cache", default=str(LLAMA_CACHE))
    p.add_argument("--jobs", type=int, default=None)
    p.set_defaults(fn=cmd_build_llama_cpp)

    p = sub.add_parser("pack-llama-src", help="trimmed pinned llama.cpp source archive")
    p.add_argument("dest")
    p.set_defaults(fn=cmd_pack)

    p = sub.add_parser("run", help="the benchmark (GPU)")
    selection(p)
    p.add_argument("--paths", help=f"comma-separated, of {', '.join([*wl.PATHS, wl.LLAMA_CPP])}; "
                                   "<path>:<workload>+<workload> runs only those of the "
                                   "run's workloads on that path")
    p.add_argument("--workloads", help=f"comma-separated, of {', '.join(wl.WORKLOADS)}")
    p.add_argument("--models", default=str(MODELS))
    p.add_argument("--llama-cpp", default=str(LLAMA_CACHE / "build" / "bin"),
                   help="folder with llama-server and llama-bench")
    p.add_argument("--results", default=str(BENCH / "results"))
    p.add_argument("--work", default=str(WORK), help="server logs, raw results")
    p.add_argument("--budget-s", type=float, default=float("inf"),
                   help="start nothing new after this many seconds, nor wait past them for a "
                        "server to be ready (partial data is kept; a server that is not "
                        "leaves its Python stacks at the end of its log)")
    p.add_argument("--rounds", type=_positive, default=1,
                   help="start each vLLM path's server this many times, the paths in turn "
                        "(A B A B); engine.md gives each figure's median and range")
    p.add_argument("--consistency", type=int, default=wl.CONSISTENCY_PROMPTS, metavar="N",
                   help="after each vLLM server's workloads, N prompts at once, their decode "
                        "against their prefill (bench/engine/consistency.py; 0: not run)")
    p.add_argument("--start-together", type=_positive_float, metavar="KV_GIB",
                   help="start a file's vLLM servers at once, each with a KV cache of "
                        "KV_GIB GiB, where the first of them stands in --paths, and measure "
                        "them in turn while the others wait idle (one start's wait for all; "
                        "KV and memory figures are not the defaults', the record says so)")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("profile", help="where the time of a step goes (GPU)")
    selection(p)
    p.add_argument("--paths", help=f"comma-separated, of {', '.join(wl.PATHS)} "
                                   "(default: triton-fp16,flashmla-bf16)")
    p.add_argument("--scenarios", help=f"comma-separated, of {', '.join(profile.SCENARIOS)}")
    p.add_argument("--models", default=str(MODELS))
    p.add_argument("--results", default=str(BENCH / "results"))
    p.add_argument("--work", default=str(WORK), help="server logs, traces")
    p.set_defaults(fn=cmd_profile)

    p = sub.add_parser("recut-profile",
                       help="engine_profile.jsonl's figures cut again from the traces it names")
    p.add_argument("--traces", required=True, help="folder holding the run's traces")
    p.add_argument("--results", default=str(BENCH / "results"))
    p.set_defaults(fn=cmd_recut_profile)

    p = sub.add_parser("render", help="engine.md from engine.jsonl")
    p.add_argument("--results", default=str(BENCH / "results"))
    p.add_argument("--check", action="store_true")
    p.set_defaults(fn=cmd_render)

    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
