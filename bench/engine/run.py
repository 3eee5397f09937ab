# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine benchmark on a GPU: for each file, each path's server in
turn, in the order of --paths (never two at once; with --rounds, the paths
again in the same order), each workload against it (a warm-up invocation,
then the measured one), the server's own figures from its log, GPU memory
from nvidia-smi. With --start-together, a file's vLLM servers start at
once, where the first of them stands in that order, each with a KV cache
of that size, and are measured in turn while the others wait idle: one
start's wait for all of them, where device time is short. llama.cpp
listed first runs before them (its server starts in seconds). After a
vLLM server's workloads, --consistency holds its decode to its prefill
on the same tokens (consistency.py; table "consistency").
The data file is rewritten after every workload, so a run cut short
(device time, --budget-s) keeps what it measured."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchdata import BenchData, environment, portable_path, results_dir

from . import consistency, parse, record
from . import spec as specs
from . import workloads as wl

REPO = Path(__file__).resolve().parents[2]
REPORT_SM = REPO / "tests" / "e2e" / "report_sm"
START_TIMEOUT = int(os.environ.get("BENCH_ENGINE_START_TIMEOUT", "900"))
BENCH_TIMEOUT = int(os.environ.get("BENCH_ENGINE_BENCH_TIMEOUT", "900"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_mib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse.nvidia_smi_mib(out)


def prefix_cache(port: int) -> dict | None:
    """The server's prefix-cache counters (parse.prefix_cache), None where
    it has none or does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return parse.prefix_cache(r.read().decode())
    except OSError:
        return None


class Peak(threading.Thread):
    """GPU memory used, sampled every second; ``peak`` the largest."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak: float | None = None
        self.stop = threading.Event()

    def run(self):
        while not self.stop.wait(1.0):
            m = gpu_mib()
            if m is not None and (self.peak is None or m > self.peak):
                self.peak = m


def _shown(cmd: list[str], env_extra: dict | None = None) -> str:
    pre = " ".join(f"{k}={v}" for k, v in sorted((env_extra or {}).items()) if k != "PYTHONPATH")
    if env_extra and "PYTHONPATH" in env_extra:
        pre = (pre + " PYTHONPATH=tests/e2e/report_sm").strip()
    shown = []
    for i, c in enumerate(cmd):
        if i == 0 and Path(c).name.startswith("python"):
            c = "python3"  # the interpreter's path is the machine's
        elif i and cmd[i - 1] in _PLACEHOLDERS:
            c = _PLACEHOLDERS[cmd[i - 1]]
        elif i == 0 or cmd[i - 1] not in _NOT_PATHS:
            c = portable_path(c)
        shown.append(shlex.quote(c))
    return f"{pre} {' '.join(shown)}".strip()


# Options whose value starts with "/" and is no file: shown as given.
_NOT_PATHS = ("--endpoint",)
# Scratch folders, shown by the names `bench_engine.py plan` gives them (the
# record holds what was written there).
_PLACEHOLDERS = {"--result-dir": "<results>"}


class Server:
    """A server in its own process group, its log in a file."""

    def __init__(self, cmd: list[str], env: dict, log: Path, health: str):
        self.cmd, self.log_path, self.health = cmd, log, health
        self.log = open(log, "w")  # noqa: SIM115 (open while the server runs; stop() closes it)
        self.t0 = time.monotonic()
        # faulthandler: SIGABRT makes each Python process of the server
        # write its threads' stacks to the log (a start that hangs, below)
        env = dict(env, PYTHONFAULTHANDLER="1")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float, limit: str) -> float:
        """Seconds until the health check answers; limit names what set the
        timeout (the run's budget or BENCH_ENGINE_START_TIMEOUT)."""
        deadline = self.t0 + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n"
                                   f"{self.log_path.read_text()[-6000:]}")
            try:
                with urllib.request.urlopen(self.health, timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - self.t0
            except OSError:
                pass
            time.sleep(2)
        self.abort_with_stacks()
        raise RuntimeError(f"server not ready in {timeout:.0f} s ({limit}); its processes' "
                           f"Python stacks at the deadline end its log:\n"
                           f"{self.log_path.read_text(errors='replace')[-6000:]}")

    def abort_with_stacks(self, wait: float = 15) -> None:
        """SIGABRT to the server's process group: faulthandler writes where
        each Python process was to the log, then they end."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait)
        self.log.flush()

    def stop(self, wait_gpu: bool = True) -> None:
        """wait_gpu: until the GPU's memory is back (no other server up)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        # the GPU's memory back before the next server starts
        for _ in range(30 if wait_gpu else 0):
            m = gpu_mib()
            if m is None or m < 2048:
                break
            time.sleep(1)

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")


class Runner:
    def __init__(self, args, plan: dict):
        self.args, self.plan = args, plan
        self.t_start = time.monotonic()
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        env = environment()
        env["quick"] = bool(args.quick)
        env["workloads"] = [w.name for w in plan["workloads"]]
        if plan.get("only"):
            env["only"] = plan["only"]
        # each round starts every path's server once more, in --paths order
        # (A B A B): a path's figures come with their spread between servers
        self.rounds = getattr(args, "rounds", 1) or 1
        if self.rounds > 1:
            env["rounds"] = self.rounds
        # --start-together: the KV cache of each server, GiB (None: alone)
        self.kv_cache_gib = getattr(args, "start_together", None)
        if self.kv_cache_gib is not None:
            env["start_together_kv_cache_gib"] = self.kv_cache_gib
        self.data = BenchData("engine", env)
        self.data.notes.append(
            "Paths: " + "; ".join(f"`{p}`: {wl.PATHS[p].about}" if p in wl.PATHS else
                                  f"`{p}`: llama-server (CUDA, built from the pinned source), "
                                  "same client" for p in plan["paths"]))
        if self.kv_cache_gib is not None:
            self.data.notes.append(
                f"Started together (--start-together {self.kv_cache_gib:g}): a file's vLLM "
                "servers started at once, each with a KV cache of "
                f"{self.kv_cache_gib:g} GiB (--kv-cache-memory-bytes; "
                "--gpu-memory-utilization 0.05, the free memory vLLM asks for at start), "
                "then measured one at a time, the others idle. Their KV tokens and 32k "
                "sequences are of that cache, their start times those of concurrent "
                "starts; GPU memory is not measured.")
        self.folder = results_dir(env.get("card", "unknown-card"), args.results)
        self.max_len = wl.max_model_len(plan["workloads"])
        # the longest start of each server (vLLM, llama-server) in this run:
        # a server the budget left cannot wait for is not started
        self.longest_start = {"vllm": 0.0, wl.LLAMA_CPP: 0.0}

    # -- bookkeeping --------------------------------------------------------

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t_start)

    def save(self) -> None:
        path = self.data.write(self.folder)
        record.render(self.folder.parent)
        print(f"[bench-engine] data: {path}", flush=True)

    def skip(self, what: str, need: float = 0.0) -> bool:
        """Whether what is left out for the budget: spent, or less left than
        need (a server start)."""
        left = self.left()
        if left > need:
            return False
        if left <= 0:
            note = f"Not run (--budget-s {self.args.budget_s:g} spent): {what}."
        else:
            note = (f"Not run (--budget-s {self.args.budget_s:g}: {left:.0f} s left, a server "
                    f"start took {need:.0f} s in this run): {what}.")
        print(f"[bench-engine] {note}", flush=True)
        self.data.notes.append(note)
        return True

    def start_limit(self) -> tuple[float, str]:
        """How long to wait for a server to start, and what sets it."""
        left = self.left()
        if left < START_TIMEOUT:
            return max(60.0, left), f"what --budget-s {self.args.budget_s:g} left"
        return START_TIMEOUT, "BENCH_ENGINE_START_TIMEOUT"

    def started(self, server: Server, kind: str = "vllm") -> float:
        start_s = server.wait_ready(*self.start_limit())
        self.longest_start[kind] = max(self.longest_start[kind], start_s)
        return start_s

    # -- one workload against a running server --------------------------------

    def bench(self, w: wl.Workload, port: int, hf: Path, inputs: dict, tag: str) -> None:
        rdir = self.work / "results"
        rdir.mkdir(exist_ok=True)
        py = sys.executable
        for warm in (True, False):
            fname = f"{tag}-{w.name}{'-warmup' if warm else ''}.json"
            cmd = wl.bench_serve(w, port, hf, rdir, fname, warmup=warm, python=py)
            print(f"[bench-engine] {tag} {w.name}{' (warm-up)' if warm else ''}", flush=True)
            before = None if warm else prefix_cache(port)
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=BENCH_TIMEOUT)
            (rdir / (fname + ".log")).write_text(r.stdout + r.stderr)
            if r.returncode:
                raise RuntimeError(f"vllm bench serve failed ({w.name}):\n"
                                   f"{(r.stdout + r.stderr)[-4000:]}")
        result = json.loads((rdir / fname).read_text())
        figures = parse.bench_serve(result, w)
        # prompt tokens the prefix cache served: none, unless prompts repeat
        after = prefix_cache(port)
        if before and after:
            figures["prefix_cache_query_tokens"] = after["queries"] - before["queries"]
            figures["prefix_cache_hit_tokens"] = after["hits"] - before["hits"]
        figures["command"] = _shown(cmd)
        self.data.row("serve", {**inputs, "workload": w.name, "kind": w.kind,
                                "input_len": w.input_len, "output_len": w.output_len,
                                "concurrency": w.concurrency, "num_prompts": w.num_prompts},
                      **figures)
        # a run cut short (device time, a lost machine) keeps every measured workload
        self.save()

    def consistency(self, w: wl.Workload, port: int, hf: Path, inputs: dict) -> None:
        """The server's decode against its prefill (consistency.py)."""
        print(f"[bench-engine] {inputs['path']} {w.name}", flush=True)
        vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
        t0 = time.monotonic()
        figures = consistency.check(f"http://127.0.0.1:{port}", w, vocab, wl.SEED)
        figures["seconds"] = round(time.monotonic() - t0, 1)
        self.data.row("consistency", {**inputs, "workload": w.name,
                                      "input_len": w.input_len, "output_len": w.output_len,
                                      "concurrency": w.concurrency}, **figures)
        self.save()

    # -- paths ----------------------------------------------------------------

    def vllm(self, path: str, name: str, gtype: str, gguf: Path, hf: Path,
             round_: int | None = None) -> None:
        self.measure(self.start(path, name, gtype, gguf, hf, round_))

    def together(self, paths: list[str], name: str, gtype: str, gguf: Path, hf: Path,
                 round_: int | None = None) -> None:
        """--start-together: every vLLM path's server on this file at once,
        then each measured in turn while the others wait idle."""
        started = []
        try:
            for path in paths:
                started.append(self.start(path, name, gtype, gguf, hf, round_))
            # each server's own time to ready, waited for side by side
            with ThreadPoolExecutor(len(started)) as pool:
                for one in started:
                    one["ready"] = pool.submit(self.started, one["server"])
            for i, one in enumerate(started):
                self.measure(one, last=i == len(started) - 1)
        finally:
            for one in started:
                if not one.get("stopped"):  # a start or a wait that raised
                    one["server"].stop(wait_gpu=one is started[-1])

    def start(self, path: str, name: str, gtype: str, gguf: Path, hf: Path,
              round_: int | None) -> dict:
        p = wl.PATHS[path]
        port = free_port()
        cmd = wl.vllm_serve(p, gguf, hf, port, self.max_len, python=sys.executable,
                            kv_cache_gib=self.kv_cache_gib)
        env = wl.vllm_env(p, dict(os.environ), REPORT_SM)
        tag = f"{name}-{gtype}-{path}" + (f"-round{round_}" if round_ else "")
        log = self.work / f"{tag}.log"
        inputs = {"checkpoint": name, "type": gtype, "path": path}
        if round_:
            inputs["round"] = round_
        print(f"[bench-engine] start {path} on {gguf.name}"
              + (f" (round {round_})" if round_ else ""), flush=True)
        return {"path": p, "port": port, "cmd": cmd, "tag": tag, "log": log, "hf": hf,
                "inputs": inputs, "what": f"{name} {gtype} {path}",
                "server": Server(cmd, env, log, f"http://127.0.0.1:{port}/health")}

    def measure(self, one: dict, last: bool = True) -> None:
        """Wait for a started server, record its start, run its workloads,
        stop it (GPU memory is measured only with no other server up)."""
        p, server, inputs = one["path"], one["server"], one["inputs"]
        alone = self.kv_cache_gib is None
        peak = Peak()
        try:
            start_s = one["ready"].result() if "ready" in one else self.started(server)
            ready = gpu_mib() if alone else None
            if alone:
                peak.start()
            figures = parse.vllm_log(server.text())
            shown_env = {k: v for k, v in p.env.items()}
            if p.report_sm:
                shown_env["PYTHONPATH"] = "tests/e2e/report_sm"
            srow = dict(figures, start_s=round(start_s, 1), gpu_mib_ready=ready,
                        command=_shown(one["cmd"], shown_env))
            self.data.row("servers", inputs, **srow)
            row = self.data.rows[-1]["figures"]
            for w in wl.path_workloads(self.plan, p.name):
                if self.skip(f"{one['what']} {w.name}"):
                    break
                self.bench(w, one["port"], one["hf"], inputs, one["tag"])
            n = getattr(self.args, "consistency", 0)
            if n and not self.skip(f"{one['what']} consistency-{n}"):
                self.consistency(wl.consistency(n), one["port"], one["hf"], inputs)
            row["gpu_mib_peak"] = peak.peak
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            self.data.notes.append(f"{one['what']}: {type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''} "
                                   f"(log: {one['log'].name})")
            print(f"[bench-engine] FAILED {p.name}: {e}", flush=True)
        finally:
            peak.stop.set()
            server.stop(wait_gpu=last)
            one["stopped"] = True
            self.save()

    def llama(self, name: str, gtype: str, gguf: Path, hf: Path) -> None:
        bins = Path(self.args.llama_cpp)
        inputs = {"checkpoint": name, "type": gtype, "path": wl.LLAMA_CPP}
        mine = wl.path_workloads(self.plan, wl.LLAMA_CPP)
        for group in wl.llama_server_groups(mine):
            if self.skip(f"{name} {gtype} llama.cpp {[w.name for w in group]}",
                         self.longest_start[wl.LLAMA_CPP]):
                return
            slots, ctx = wl.llama_server_slots(group)
            port = free_port()
            cmd = wl.llama_server(bins / "llama-server", gguf, port, slots, ctx)
            log = self.work / f"{name}-{gtype}-llama-server-np{slots}.log"
            print(f"[bench-engine] start llama-server -np {slots} -c {ctx}", flush=True)
            server = Server(cmd, dict(os.environ), log, f"http://127.0.0.1:{port}/health")
            try:
                start_s = self.started(server, wl.LLAMA_CPP)
                figures = dict(parse.llama_server_log(server.text()), start_s=round(start_s, 1),
                               gpu_mib_ready=gpu_mib(), slots=slots, command=_shown(cmd))
                self.data.row("servers", dict(inputs, slots=slots), **figures)
                for w in group:
                    if self.skip(f"{name} {gtype} llama.cpp {w.name}"):
                        break
                    self.bench(w, port, hf, inputs, f"{name}-{gtype}-llama.cpp")
            except Exception as e:  # noqa: BLE001
                first = str(e).splitlines()[0] if str(e) else ""
                self.data.notes.append(f"{name} {gtype} llama-server: {type(e).__name__}: "
                                       f"{first} (log: {log.name})")
                print(f"[bench-engine] FAILED llama-server: {e}", flush=True)
            finally:
                server.stop()
                self.save()
        for cmd in wl.llama_bench(bins / "llama-bench", gguf, mine):
            if self.skip(f"{name} {gtype} llama-bench"):
                return
            print(f"[bench-engine] {_shown(cmd)}", flush=True)
            try:
                r = subprocess.run(cmd, capture_output=True, text=True,
                                   timeout=max(60, min(BENCH_TIMEOUT, self.left())))
                (self.work / f"{name}-{gtype}-llama-bench.log").write_text(r.stdout + r.stderr)
                for row in parse.llama_bench(r.stdout):
                    test = parse.llama_bench_test(row)
                    self.data.row("llama_bench", dict(inputs, test=test),
                                  tok_s=row["tok_s"], tok_s_stddev=row["tok_s_stddev"],
                                  command=_shown(cmd))
            except Exception as e:  # noqa: BLE001
                self.data.notes.append(f"{name} {gtype} llama-bench: {type(e).__name__}: {e}")
        self.save()

    # -- the run --------------------------------------------------------------

    def run(self) -> int:
        models = Path(self.args.models)
        for name, gtype in self.plan["files"]:
            info, gguf, hf = built_file(models, name, gtype)
            f = info["files"][gtype]
            routing = [v["max_over_mean"] for v in info.get("routing", {}).values()]
            self.data.row("files", {"checkpoint": name, "type": gtype}, bytes=f["bytes"],
                          types=f["types"], parameters=info.get("parameters"),
                          routing_max_over_mean=max(routing) if routing else None,
                          build_s=sum(v for k, v in info["seconds"].items()
                                      if k != "total_last_build"),
                          spec=info["spec"])
            for r in range(1, self.rounds + 1):
                round_ = r if self.rounds > 1 else None
                vllm_paths = [p for p in self.plan["paths"] if p != wl.LLAMA_CPP]
                for path in self.plan["paths"]:
                    if path == wl.LLAMA_CPP and r > 1:
                        continue  # llama-bench repeats on its own
                    if path != wl.LLAMA_CPP and self.kv_cache_gib is not None:
                        # the file's vLLM servers, together, where the first stands
                        if path == vllm_paths[0]:
                            what = f"{name} {gtype} {', '.join(vllm_paths)}" + (
                                f" round {r}" if round_ else "")
                            if not self.skip(what, self.longest_start["vllm"]):
                                self.together(vllm_paths, name, gtype, gguf, hf, round_)
                        continue
                    what = f"{name} {gtype} {path}" + (f" round {r}" if round_ else "")
                    kind = wl.LLAMA_CPP if path == wl.LLAMA_CPP else "vllm"
                    if self.skip(what, self.longest_start[kind]):
                        continue
                    if path == wl.LLAMA_CPP:
                        self.llama(name, gtype, gguf, hf)
                    else:
                        self.vllm(path, name, gtype, gguf, hf, round_)
        self.save()
        failed = [n for n in self.data.notes if "Error" in n or "FAILED" in n]
        return 1 if failed else 0


def built_file(models: Path, name: str, gtype: str) -> tuple[dict, Path, Path]:
    """(build.json, GGUF file, HF folder) of one built file; a missing build
    or type is an error that says so."""
    info_path = models / name / "build.json"
    if not info_path.is_file():
        raise SystemExit(f"{info_path}: missing; build the files first "
                         f"(bench_engine.py build-models)")
    info = json.loads(info_path.read_text())
    if gtype not in info["files"]:
        raise SystemExit(f"{name}: no {gtype} file in {info_path}; build it first")
    return info, models / name / info["files"][gtype]["file"], models / name / "hf"


def known_files(arg: str | None) -> list[tuple[str, str]] | None:
    if not arg:
        return None
    out = []
    for item in arg.split(","):
        name, _, gtype = item.partition(":")
        if name not in specs.SPECS or gtype not in specs.TYPES:
            raise SystemExit(f"--files {item}: expected <checkpoint>:<type> with checkpoint in "
                             f"{', '.join(specs.SPECS)} and type in {', '.join(specs.TYPES)}")
        out.append((name, gtype))
    return out
