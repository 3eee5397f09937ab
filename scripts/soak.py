#!/usr/bin/env python3
"""`make soak`: `vllm serve` on the series' path under load and abuse for
minutes, on 127.0.0.1 (a GPU machine).

    python scripts/soak.py --gguf FILE --hf DIR --out DIR [--minutes 5]
        [--max-concurrency 128] [--max-model-len 2048] [--probe-len 200]
        [--peer-minutes 0] [-- extra `vllm serve` arguments]

Starts `vllm serve FILE` as the README says (--dtype float16, chunked
prefill and prefix caching on, a KV cache small enough that the load
preempts), then drives it from a bounded client: concurrency ramped up to
--max-concurrency; prompts of 1 token to max_model_len; completions and
chat, streamed and not, n > 1, logprobs, stop strings, clients that
disconnect mid-stream or abort; and bad input (malformed JSON, prompts
past max_model_len, huge max_tokens, negative or huge logprobs, an unknown
model, an empty prompt, token ids past the vocabulary or negative, a wrong content
type). A fixed greedy probe runs before, during and after. Extra arguments
go to `vllm serve` unchanged (e.g. --tensor-parallel-size 2).

It passes when every request ends in a completion or a 4xx whose message
says what was wrong (no 5xx, no request past its deadline); the server
answers afterwards; the probe's tokens are identical every time (but where
they part at a near-tie: each probe has the other's token among its
PROBE_TOP most likely, within twice the probes' spread of
log-probabilities), and that spread is at most PROBE_NOISE_CAP nats, or with
--peer-minutes PEER_FACTOR x the spread of upstream's path (FLASHMLA_SPARSE,
bf16, vLLM's GGUF kernels) under the same load first, in --out/peer (the
near-tie bar then twice that: a routing flip moves a step's
log-probabilities more than the steps where the probes agree show; the
record says whether the peer itself passes the bar); no log-probability is
NaN or infinite; the server's GPU memory (its processes', or the whole GPU's
where the driver does not list them) and resident memory do not grow over
the last half; no stall (no token while requests are in flight) is longer
than --stall-s; the load preempted requests; and the server log holds no
traceback. Output in --out: soak.jsonl (one line per minute, then the
verdict) and soak.md (rendered from it), the server log, every request's
outcome (outcomes.jsonl) and every probe's tokens, log-probabilities and top
tokens (probes.jsonl). Exit status 1 when it fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

# A request may take this long before it counts as hung (the longest
# prompts wait behind preempted ones).
DEADLINE_S = 120.0
# Memory that may come and go without being a leak: the CUDA caching
# allocator's blocks, Python's arenas.
GPU_SLACK_MIB = 256
RSS_SLACK = 0.10
PROBE_TOKENS = 32
# The probe's tokens may part at a near-tie (vLLM's batches of other sizes
# round differently, and a rounding can flip a router's or the indexer's
# choice): where each of the two probes has the other's token among its
# PROBE_TOP most likely, within twice the probe's spread of log-probabilities
# where its tokens agree (random routers tie three ways as well as two).
# That spread past a cap is a fault in itself: this one without a peer; with
# one (--peer-minutes), PEER_FACTOR x the spread of upstream's path under
# the same load, at least PROBE_NOISE_FLOOR, and the near-tie bar twice that.
PROBE_NOISE_CAP = 0.1
PEER_FACTOR = 2.0
PROBE_NOISE_FLOOR = 0.02
PROBE_TOP = 5
# The peer: upstream's path as vLLM 0.23 runs it on the same file (its
# attention, indexer and GGUF kernels), as the engine benchmark's
# flashmla-bf16. Its arguments come after the soak's own, so they win.
PEER_ARGS = ["--attention-backend", "FLASHMLA_SPARSE", "--dtype", "bfloat16"]
PEER_ENV = {"VLLM_GGUF_KERNELS": "upstream"}


@dataclass
class Outcome:
    """One request as the client saw it."""

    kind: str
    start: float
    end: float
    status: int | None = None  # HTTP status; None: no answer
    tokens: int = 0
    error: str = ""  # what went wrong on our side (timeout, 5xx body, ...)
    message: str = ""  # the server's message on a 4xx
    bad_input: bool = False
    nonfinite: bool = False
    client_stop: bool = False  # the client disconnected or aborted on purpose


@dataclass
class Sample:
    t: float
    gpu_mib: float | None
    rss_mib: float | None
    in_flight: int


@dataclass
class Probe:
    """One greedy probe: its tokens, their log-probabilities, and at each
    step the most likely tokens as [token, log-probability] pairs."""

    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    top: list[list[list]] = field(default_factory=list)

    def logprob_of(self, step: int, token: int) -> float | None:
        """token's log-probability at step, None where it is not in the top."""
        if step >= len(self.top):
            return None
        return next((lp for t, lp in self.top[step] if t == token), None)


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    events: list[float] = field(default_factory=list)  # token arrivals
    busy: list[tuple[float, float]] = field(default_factory=list)  # in-flight spans
    probes: list[Probe] = field(default_factory=list)
    preemptions: float | None = None
    alive_after: bool = False
    log_tracebacks: list[str] = field(default_factory=list)
    gpu_measure: str | None = None  # what gpu_mib counts: _gpu_mib


# ---------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    base: str
    model: str
    max_model_len: int
    vocab: int
    first_token: int = 8  # token ids below are special in the test models
    chat: bool = True  # the tokenizer has a chat template (else no chat requests)


def _prompt(rng: random.Random, target: Target, length: int) -> list[int]:
    return [rng.randrange(target.first_token, target.vocab) for _ in range(length)]


def _length(rng: random.Random, target: Target, room: int) -> int:
    # Mostly short, some at the limit: 1 token to max_model_len - room.
    top = max(1, target.max_model_len - room)
    return min(top, int(math.exp(rng.uniform(0, math.log(top)))) if rng.random() < 0.85
               else top)


def good_request(rng: random.Random, target: Target) -> tuple[str, str, dict, dict]:
    """(kind, path, JSON body, client options) of one well-formed request."""
    max_tokens = rng.randint(1, 64)
    prompt = _prompt(rng, target, _length(rng, target, max_tokens))
    body = {"model": target.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randrange(1 << 30)}
    kinds = ["complete", "stream", "chat", "chat_stream", "n_best", "logprobs", "stop",
             "disconnect", "abort", "shared_prefix"]
    kind = rng.choice(kinds if target.chat else [k for k in kinds if not k.startswith("chat")])
    if kind == "shared_prefix":
        # Prefix caching: one fixed prefix, a fresh tail.
        head = _prompt(random.Random(7), target, len(prompt) // 2 + 1)
        body["prompt"] = (head + prompt)[: len(prompt)]
    opts: dict = {}
    path = "/v1/completions"
    if kind in ("chat", "chat_stream"):
        path = "/v1/chat/completions"
        words = " ".join(f"<t{t}>" for t in prompt[: min(len(prompt), 200)])
        body = {"model": target.model, "messages": [{"role": "user", "content": words}],
                "max_tokens": max_tokens, "temperature": body["temperature"]}
    if kind in ("stream", "chat_stream", "disconnect"):
        body["stream"] = True
    if kind == "n_best":
        body.update(n=3, temperature=1.0)
    if kind in ("logprobs", "stream"):
        body["logprobs"] = 5
    if kind == "stop":
        body["stop"] = [f"<t{rng.randrange(target.first_token, target.vocab)}>"]
    if kind == "disconnect":
        opts["drop_after_chunks"] = rng.randint(1, 3)
    if kind == "abort":
        opts["abort_after_s"] = rng.uniform(0.05, 1.0)
    return kind, path, body, opts


def has_chat_template(hf: Path) -> bool:
    """Whether the tokenizer folder carries a chat template (vLLM answers chat
    requests without one with a 400: a file whose tokenizer has none, such
    as the engine benchmark's, is soaked without chat requests)."""
    if (hf / "chat_template.jinja").exists() or (hf / "chat_template.json").exists():
        return True
    config = hf / "tokenizer_config.json"
    return config.exists() and bool(json.loads(config.read_text()).get("chat_template"))


def bad_requests(target: Target) -> list[tuple[str, str, bytes | dict, str]]:
    """(kind, path, body, content type) of each kind of bad input."""
    ok = {"model": target.model, "prompt": [target.first_token] * 4, "max_tokens": 4}
    return [
        ("malformed_json", "/v1/completions", b'{"model": "x", "prompt": [1, 2', "json"),
        ("prompt_too_long", "/v1/completions",
         {**ok, "prompt": [target.first_token] * (target.max_model_len + 16)}, "json"),
        ("max_tokens_huge", "/v1/completions", {**ok, "max_tokens": 10**9}, "json"),
        ("logprobs_negative", "/v1/completions", {**ok, "logprobs": -5}, "json"),
        ("logprobs_huge", "/v1/completions", {**ok, "logprobs": 10**6}, "json"),
        ("unknown_model", "/v1/completions", {**ok, "model": "no-such-model"}, "json"),
        ("empty_prompt", "/v1/completions", {**ok, "prompt": ""}, "json"),
        ("token_ids_past_vocab", "/v1/completions",
         {**ok, "prompt": [target.vocab + 100, target.vocab * 1000]}, "json"),
        ("token_ids_negative", "/v1/completions", {**ok, "prompt": [target.first_token, -1]},
         "json"),
        ("wrong_content_type", "/v1/completions", json.dumps(ok).encode(), "text"),
    ]


def _finite_logprobs(payload: dict) -> bool:
    """False when any number in a completion's or chunk's logprobs is NaN or
    infinite (Python's json reads NaN and Infinity)."""
    def ok(x) -> bool:
        if isinstance(x, float):
            return math.isfinite(x)
        if isinstance(x, dict):
            return all(ok(v) for v in x.values())
        if isinstance(x, list):
            return all(ok(v) for v in x)
        return True

    return all(ok(c.get("logprobs")) for c in payload.get("choices", []))


def _error_text(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace").strip()
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or "")
    return str(body.get("detail") or "") if isinstance(body, dict) else str(err)


async def send(session, run: Run, target: Target, kind: str, path: str, body,
               opts: dict | None = None, content: str = "json",
               bad_input: bool = False) -> Outcome:
    import aiohttp

    opts = opts or {}
    out = Outcome(kind=kind, start=time.monotonic(), end=0.0, bad_input=bad_input)
    headers = {"Content-Type": "application/json" if content == "json" else "text/plain"}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    timeout = aiohttp.ClientTimeout(total=opts.get("abort_after_s", DEADLINE_S))
    try:
        async with session.post(target.base + path, data=data, headers=headers,
                                timeout=timeout) as resp:
            out.status = resp.status
            if resp.status >= 400:
                raw = await resp.read()
                if resp.status < 500:
                    out.message = _error_text(raw)
                else:
                    out.error = f"HTTP {resp.status}: {raw[:500].decode(errors='replace')}"
            elif isinstance(body, dict) and body.get("stream"):
                chunks = 0
                async for line in resp.content:
                    line = line.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    payload = json.loads(line[5:])
                    if "error" in payload:
                        out.error = f"error in stream: {payload['error']}"
                        break
                    run.events.append(time.monotonic())
                    out.tokens += 1
                    out.nonfinite |= not _finite_logprobs(payload)
                    chunks += 1
                    if chunks >= opts.get("drop_after_chunks", 1 << 30):
                        out.client_stop = True
                        resp.close()  # the client goes away mid-stream
                        break
            else:
                payload = await resp.json(content_type=None)
                run.events.append(time.monotonic())
                out.tokens = payload.get("usage", {}).get("completion_tokens", 0)
                out.nonfinite = not _finite_logprobs(payload)
    except asyncio.TimeoutError:
        if "abort_after_s" in opts:
            out.client_stop = True  # aborted on purpose
        else:
            out.error = f"no answer in {DEADLINE_S:.0f} s"
    except aiohttp.ClientError as e:
        out.error = f"{type(e).__name__}: {e}"
    out.end = time.monotonic()
    run.outcomes.append(out)
    return out


async def probe(session, target: Target, prompt: list[int]) -> Probe:
    """The fixed greedy probe, with its top PROBE_TOP log-probabilities a step."""
    body = {"model": target.model, "prompt": prompt, "max_tokens": PROBE_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "logprobs": PROBE_TOP, "return_tokens_as_token_ids": True}
    async with session.post(target.base + "/v1/completions", json=body) as resp:
        payload = await resp.json(content_type=None)
        if resp.status != 200:
            raise RuntimeError(f"probe: HTTP {resp.status}: {payload}")
        return parse_probe(payload["choices"][0])


def parse_probe(choice: dict) -> Probe:
    """A completion choice as a Probe (top_logprobs keyed "token_id:N")."""
    lp = choice.get("logprobs") or {}
    out = Probe(list(choice["token_ids"]),
                [float(v) for v in lp.get("token_logprobs") or []])
    for top in lp.get("top_logprobs") or []:
        ranked = sorted(((int(k.rsplit(":", 1)[1]), float(v)) for k, v in (top or {}).items()),
                        key=lambda tv: (-tv[1], tv[0]))
        out.top.append([list(tv) for tv in ranked])
    return out


# ---------------------------------------------------------------------------
# The load
# ---------------------------------------------------------------------------


def concurrency_at(t: float, duration: float, max_concurrency: int) -> int:
    """Doubling from 4 over the first half, then held."""
    steps = max(1, int(math.log2(max(max_concurrency, 4) / 4)))
    step = min(steps, int(t / (duration / 2) * steps))
    return min(max_concurrency, 4 << step)


async def drive(target: Target, duration: float, max_concurrency: int, seed: int,
                sample, run: Run, probe_len: int = 200) -> None:
    import aiohttp

    rng = random.Random(seed)
    probe_len = max(1, min(probe_len, target.max_model_len - PROBE_TOKENS))
    probe_prompt = _prompt(random.Random(2026), target, probe_len)
    # A connection per request: a broken one is then the server's doing, not
    # a pooled keep-alive connection the server closed as the client took it.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        run.probes.append(await probe(session, target, probe_prompt))
        start = time.monotonic()
        in_flight: set[asyncio.Task] = set()
        busy_since: float | None = None
        next_sample = next_probe = next_bad = start
        while (now := time.monotonic()) - start < duration:
            want = concurrency_at(now - start, duration, max_concurrency)
            while len(in_flight) < want:
                kind, path, body, opts = good_request(rng, target)
                in_flight.add(asyncio.create_task(
                    send(session, run, target, kind, path, body, opts)))
            if now >= next_bad:
                for kind, path, body, content in bad_requests(target):
                    in_flight.add(asyncio.create_task(send(
                        session, run, target, kind, path, body, content=content,
                        bad_input=True)))
                next_bad = now + 20
            if now >= next_probe and now > start:
                run.probes.append(await probe(session, target, probe_prompt))
                next_probe = now + 30
            if now >= next_sample:
                run.samples.append(Sample(now - start, *sample(), len(in_flight)))
                next_sample = now + 5
            if in_flight and busy_since is None:
                busy_since = now
            if in_flight:
                _, pending = await asyncio.wait(in_flight, timeout=0.2,
                                                return_when=asyncio.FIRST_COMPLETED)
                in_flight = set(pending)
            if not in_flight and busy_since is not None:
                run.busy.append((busy_since, time.monotonic()))
                busy_since = None
        if in_flight:
            await asyncio.wait(in_flight, timeout=DEADLINE_S + 10)
        if busy_since is not None:
            run.busy.append((busy_since, time.monotonic()))
        for t in in_flight:
            t.cancel()
        run.probes.append(await probe(session, target, probe_prompt))
        run.samples.append(Sample(time.monotonic() - start, *sample(), 0))


# ---------------------------------------------------------------------------
# Judging (pure functions of the run)
# ---------------------------------------------------------------------------


def max_stall(events: list[float], busy: list[tuple[float, float]]) -> float:
    """The longest time without a token while requests were in flight."""
    worst = 0.0
    ev = sorted(events)
    for lo, hi in busy:
        inside = [lo] + [t for t in ev if lo <= t <= hi] + [hi]
        worst = max(worst, max(b - a for a, b in zip(inside, inside[1:])))
    return worst


def growth(values: list[float]) -> float:
    """How far the last half's peak is above the first half's."""
    if len(values) < 4:
        return 0.0
    half = len(values) // 2
    return max(values[half:]) - max(values[:half])


def per_minute(run: Run, t0: float) -> list[dict]:
    rows: dict[int, dict] = {}
    for o in run.outcomes:
        m = int((o.end - t0) // 60)
        row = rows.setdefault(m, {"minute": m, "requests": 0, "tokens": 0, "4xx": 0,
                                  "failed": 0})
        row["requests"] += 1
        row["tokens"] += o.tokens
        row["4xx"] += o.status is not None and 400 <= o.status < 500
        row["failed"] += bool(o.error)
    for row in rows.values():
        row["tokens_per_s"] = round(row["tokens"] / 60, 1)
    return [rows[m] for m in sorted(rows)]


def verdict(run: Run, stall_s: float, probe_cap: float = PROBE_NOISE_CAP,
            tie_bar: float | None = None) -> tuple[dict, list[str]]:
    failures = []
    failed = [o for o in run.outcomes if o.error]
    silent = [o for o in run.outcomes if o.status is not None and 400 <= o.status < 500
              and not o.message]
    nonfinite = [o for o in run.outcomes if o.nonfinite]
    for what, bad in (("failed (5xx, no answer, broken connection)", failed),
                      ("4xx without a message", silent), ("non-finite logprobs", nonfinite)):
        if bad:
            kinds = sorted({o.kind for o in bad})
            first = (bad[0].error or bad[0].message)[:300]
            failures.append(f"{len(bad)} requests {what}: {kinds}; first: {first}")
    if not run.alive_after:
        failures.append("the server did not answer /health after the load")
    distinct = {tuple(p.tokens) for p in run.probes}
    noise, bar, flips, probe_fails = probe_verdict(run.probes, probe_cap, tie_bar)
    failures += probe_fails
    gpu = [s.gpu_mib for s in run.samples if s.gpu_mib is not None]
    rss = [s.rss_mib for s in run.samples if s.rss_mib is not None]
    if gpu and growth(gpu) > GPU_SLACK_MIB:
        failures.append(f"GPU memory grew {growth(gpu):.0f} MiB over the last half")
    if rss and growth(rss) > RSS_SLACK * max(rss[: len(rss) // 2] or rss):
        failures.append(f"server RSS grew {growth(rss):.0f} MiB over the last half")
    stall = max_stall(run.events, run.busy)
    if stall > stall_s:
        failures.append(f"a stall of {stall:.1f} s (no token with requests in flight)")
    if not run.preemptions:
        failures.append("the load preempted nothing: shrink the KV cache or raise "
                        "--max-concurrency")
    if run.log_tracebacks:
        failures.append(f"{len(run.log_tracebacks)} tracebacks in the server log; first:\n"
                        + run.log_tracebacks[0][:1500])
    summary = {
        "requests": len(run.outcomes),
        "completed": sum(o.status == 200 and not o.error for o in run.outcomes),
        "rejected_4xx": sum(o.status is not None and 400 <= o.status < 500
                            for o in run.outcomes),
        "client_stops": sum(o.client_stop for o in run.outcomes),
        "bad_input_accepted": sorted({o.kind for o in run.outcomes
                                      if o.bad_input and o.status == 200}),
        "failed": len(failed),
        "probes": len(run.probes),
        "probe_outputs": len(distinct),
        "probe_noise_nats": round(noise, 4),
        "probe_noise_cap": round(probe_cap, 4),
        "probe_tie_bar": round(bar, 4),
        "probe_near_ties": [[f["token"], f["gap"]] for f in flips if f["near_tie"]],
        "max_stall_s": round(stall, 2),
        "gpu_mib_growth": round(growth(gpu), 1) if gpu else None,
        "gpu_measure": run.gpu_measure,
        "rss_mib_growth": round(growth(rss), 1) if rss else None,
        "preemptions": run.preemptions,
        "tracebacks": len(run.log_tracebacks),
    }
    return summary, failures


def judge_probes(probes: list[Probe]) -> tuple[float, list[dict]]:
    """(spread, partings): the largest |log-probability difference| from the
    first probe where the tokens agree, and for each later probe whose tokens
    part from the first's, where, and the gap there (the larger of how far each
    probe put the other's token behind its own; None where one of them is not
    in the other's top)."""
    if not probes:
        return 0.0, []
    ref, noise, flips = probes[0], 0.0, []
    for p in probes[1:]:
        n = min(len(ref.tokens), len(p.tokens))
        at = next((i for i in range(n) if ref.tokens[i] != p.tokens[i]),
                  None if len(ref.tokens) == len(p.tokens) else n)
        agree = range(at if at is not None else n)
        noise = max([noise, *(abs(p.logprobs[i] - ref.logprobs[i]) for i in agree
                              if i < min(len(p.logprobs), len(ref.logprobs)))])
        if at is None:
            continue
        gap = None
        if at < len(p.tokens):
            mine, theirs = ref.tokens[at], p.tokens[at]
            lps = (ref.logprob_of(at, mine), ref.logprob_of(at, theirs),
                   p.logprob_of(at, theirs), p.logprob_of(at, mine))
            if None not in lps:
                gap = max(lps[0] - lps[1], lps[2] - lps[3])
        flips.append({"token": at, "gap": None if gap is None else round(gap, 4)})
    return noise, flips


def probe_verdict(probes: list[Probe], cap: float = math.inf, tie_bar: float | None = None
                  ) -> tuple[float, float, list[dict], list[str]]:
    """(spread, near-tie bar, partings each marked near_tie or not, failures):
    the probe passes when its spread is within `cap` and every parting is a
    near-tie, a gap within tie_bar (by default twice the spread, the spread
    taken at most `cap`)."""
    noise, flips = judge_probes(probes)
    bar = 2 * min(noise, cap) if tie_bar is None else tie_bar
    for f in flips:
        f["near_tie"] = f["gap"] is not None and f["gap"] <= bar
    failures = []
    if noise > cap:
        failures.append(f"the greedy probe's log-probabilities moved by {noise:.3f} nats "
                        f"where its tokens agree (more than {cap:.3f})")
    changed = [f for f in flips if not f["near_tie"]]
    if changed:
        outputs = len({tuple(p.tokens) for p in probes})
        failures.append(f"the greedy probe changed: {outputs} different outputs over "
                        f"{len(probes)} probes; first difference at token "
                        f"{changed[0]['token']} (gap {changed[0]['gap']} nats, "
                        f"near-tie bar {bar:.4f}; None: a token "
                        f"outside the other's top {PROBE_TOP})")
    return noise, bar, flips, failures


def tracebacks(log: str) -> list[str]:
    """The server log's tracebacks, their files named from the package on
    (site-packages/vllm/..., not the machine's folders)."""
    return [re.sub(r'File "[^"]*/(site-packages|dist-packages)/', r'File "\1/', m.group(0))
            for m in re.finditer(r"Traceback \(most recent call last\):\n(?:[ \t].*\n)*.*", log)]


def render(rows: list[dict]) -> str:
    head = rows[-1]
    notes = []
    if head.get("chat") is False:
        notes.append("- no chat requests: the tokenizer has no chat template")
    if head.get("path"):
        notes.append(f"- the peer: the same load on {head['path']}, judged with the fixed "
                     "bar; its probe's spread sets the soak's")
    if peer := head.get("peer"):
        notes.append(f"- the probe's bar from the peer ({peer['path']}, {peer['minutes']} "
                     f"min): {peer['probe_outputs']} outputs, spread "
                     f"{peer['probe_noise_nats']} nats")
        if "probe_bar_failures" in peer:
            own = peer["probe_bar_failures"]
            notes.append("- the peer's own probe against that bar: "
                         + ("; ".join(own) if own else "passes"))
    lines = ["# `vllm serve` soak (generated by scripts/soak.py)", "",
             (f"- {head.get('date')}; {head.get('card')}; vLLM {head.get('vllm')}; "
              f"{head.get('gguf')}; {head.get('minutes')} min; concurrency up to "
              f"{head.get('max_concurrency')}"),
             f"- command: `{head.get('command')}`", *notes, "",
             "| minute | requests | output tok/s | 4xx | failed |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "minute" in r:
            lines.append(f"| {r['minute']} | {r['requests']} | {r['tokens_per_s']} | "
                         f"{r['4xx']} | {r['failed']} |")
    lines += ["", "| check | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in head["summary"].items()]
    lines += ["", f"**{'passed' if head['passed'] else 'FAILED'}**"]
    lines += [f"- {f}" for f in head["failures"]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_pids(sid: int) -> set[int]:
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) == sid:  # session id
                pids.add(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return pids


def _session_rss_mib(sid: int) -> float | None:
    total = 0
    for pid in _session_pids(sid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            total += int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
        except (OSError, AttributeError, ValueError):
            continue
    return total / 1024 if total else None


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 60 s. A group
    already gone (the server died at start) is not an error: the reason it
    died must stay the one reported."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            break
        try:
            server.wait(60)
            break
        except subprocess.TimeoutExpired:
            continue
    server.poll()


def _smi(query: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=10, check=True).stdout
    return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]


def _gpu_mib(sid: int) -> tuple[float, str] | None:
    """The server's GPU memory: its processes' where the driver lists them
    (other work on the GPU does not count), else the whole GPU's (a
    container whose processes the driver does not see by pid)."""
    try:
        ours = _session_pids(sid)
        apps = [r for r in _smi("--query-compute-apps=pid,used_memory")
                if r[0].isdigit() and int(r[0]) in ours]
        if apps:
            return sum(float(r[1]) for r in apps), "server processes"
        return sum(float(r[0]) for r in _smi("--query-gpu=memory.used")), "whole GPU"
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _sample(sid: int, run: Run) -> tuple[float | None, float | None]:
    gpu = _gpu_mib(sid)
    if gpu:
        run.gpu_measure = run.gpu_measure or gpu[1]
        if gpu[1] != run.gpu_measure:  # one measure a run: the growth compares them
            gpu = None
    return (gpu[0] if gpu else None), _session_rss_mib(sid)


def _metric(base: str, name: str) -> float | None:
    import requests

    try:
        text = requests.get(base + "/metrics", timeout=10).text
    except requests.RequestException:
        return None
    values = [float(m.group(1)) for m in re.finditer(
        rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.M)]
    return sum(values) if values else None


def soak_server(args, target: Target, extra: list[str], env: dict, minutes: float,
                out: Path) -> tuple[Run, float]:
    """Start `vllm serve` on args.gguf, drive it for `minutes`, stop it: the
    run (tracebacks of its log included) and when the load began."""
    out.mkdir(parents=True, exist_ok=True)
    import requests

    target = replace(target, base=f"http://127.0.0.1:{_free_port()}")
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(args.gguf),
           "--hf-config-path", str(args.hf), "--tokenizer", str(args.hf),
           "--served-model-name", target.model, "--dtype", "float16",
           "--host", "127.0.0.1", "--port", target.base.rsplit(":", 1)[1],
           "--max-model-len", str(args.max_model_len), "--max-logprobs", "20",
           "--num-gpu-blocks-override", str(max(1, args.kv_cache_tokens // 64)),
           "--enable-chunked-prefill", "--enable-prefix-caching", "--seed", "0", *extra]
    log_path = out / "server.log"
    print("==> " + " ".join([*(f"{k}={v}" for k, v in env.items()), *cmd]), flush=True)
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True, env={**os.environ, **env})
    run = Run()
    try:
        deadline = time.monotonic() + 900
        while True:
            if server.poll() is not None:
                print(log_path.read_text()[-6000:], file=sys.stderr)
                raise SystemExit(f"vllm serve exited ({server.returncode}); log: {log_path}")
            try:
                if requests.get(target.base + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"vllm serve not healthy in 900 s; log: {log_path}")
            time.sleep(2)
        print(f"==> load for {minutes} min, concurrency up to {args.max_concurrency}",
              flush=True)
        t0 = time.monotonic()
        asyncio.run(drive(target, minutes * 60, args.max_concurrency, args.seed,
                          lambda: _sample(server.pid, run), run, args.probe_len))
        run.preemptions = _metric(target.base, "vllm:num_preemptions_total")
        try:
            run.alive_after = requests.get(target.base + "/health", timeout=10).ok
        except requests.RequestException:
            run.alive_after = False
    finally:
        stop_server(server)
    run.log_tracebacks = tracebacks(log_path.read_text(errors="replace"))
    return run, t0


def peer_cap(peer_noise: float) -> float:
    """The probe's spread allowed, from upstream's path's under the same load."""
    return max(PROBE_NOISE_FLOOR, PEER_FACTOR * peer_noise)


def record_head(head: dict, minutes: float, summary: dict, failures: list[str],
                **extra) -> dict:
    """The record's last line: the run's setting, its verdict."""
    return {**head, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "minutes": minutes, **extra, "summary": summary, "failures": failures,
            "passed": not failures}


def write_record(out: Path, rows: list[dict], run: Run) -> None:
    (out / "soak.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "soak.md").write_text(render(rows))
    (out / "outcomes.jsonl").write_text(
        "".join(json.dumps(asdict(o)) + "\n" for o in run.outcomes))
    (out / "probes.jsonl").write_text(
        "".join(json.dumps(asdict(p)) + "\n" for p in run.probes))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--hf", type=Path, required=True, help="--hf-config-path and --tokenizer")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--max-concurrency", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-tokens", type=int, default=16384,
                    help="KV cache size in tokens: small, so that the load preempts")
    ap.add_argument("--stall-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe-len", type=int, default=200,
                    help="prompt tokens of the greedy probe (past index_topk: the "
                         "indexer's selection is in play)")
    ap.add_argument("--peer-minutes", type=float, default=0.0,
                    help="first the same load on upstream's path (FLASHMLA_SPARSE, bf16, "
                         "vLLM's GGUF kernels) for this long: its probe's spread sets the "
                         "probe's bar (default: no peer, a fixed bar)")
    ap.add_argument("serve_args", nargs="*", help="after --: more `vllm serve` arguments")
    args = ap.parse_args()
    import vllm

    if args.peer_minutes < 0:
        ap.error(f"--peer-minutes {args.peer_minutes}: not negative")
    args.out.mkdir(parents=True, exist_ok=True)
    config = json.loads((args.hf / "config.json").read_text())
    target = Target("", "soak", args.max_model_len,
                    config["vocab_size"], chat=has_chat_template(args.hf))
    if not target.chat:
        print(f"==> {args.hf}: the tokenizer has no chat template; no chat requests",
              flush=True)
    head = {"card": _gpu_name(), "vllm": vllm.__version__, "gguf": args.gguf.name,
            "max_concurrency": args.max_concurrency, "chat": target.chat,
            "command": " ".join(["scripts/soak.py", *map(_portable, sys.argv[1:])])}
    cap, tie_bar, peer = PROBE_NOISE_CAP, None, None
    if args.peer_minutes:
        print("==> the peer: upstream's path under the same load", flush=True)
        peer_run, t0 = soak_server(args, target, [*args.serve_args, *PEER_ARGS], PEER_ENV,
                                   args.peer_minutes, args.out / "peer")
        summary, failures = verdict(peer_run, args.stall_s)
        cap = peer_cap(summary["probe_noise_nats"])
        tie_bar = 2 * cap
        # the bar, held to upstream's own path: a bar it fails is miscalibrated
        own = probe_verdict(peer_run.probes, cap, tie_bar)[3]
        peer = {"path": "upstream: " + " ".join(PEER_ARGS) + " " + " ".join(
                    f"{k}={v}" for k, v in PEER_ENV.items()),
                "minutes": args.peer_minutes, "probe_outputs": summary["probe_outputs"],
                "probe_noise_nats": summary["probe_noise_nats"], "failures": failures,
                "probe_bar_failures": own}
        rows = [*per_minute(peer_run, t0), record_head(head, args.peer_minutes, summary,
                                                        failures, path=peer["path"])]
        write_record(args.out / "peer", rows, peer_run)
    run, t0 = soak_server(args, target, args.serve_args, {}, args.minutes, args.out)
    summary, failures = verdict(run, args.stall_s, cap, tie_bar)
    rows = [*per_minute(run, t0), record_head(head, args.minutes, summary, failures,
                                              **({"peer": peer} if peer else {}))]
    write_record(args.out, rows, run)
    print(render(rows))
    return 0 if not failures else 1


def _portable(arg: str) -> str:
    """An absolute path as its last two parts: the record names the file, not
    the machine's folders."""
    return str(Path(*Path(arg).parts[-2:])) if arg.startswith("/") else arg


def _gpu_name() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10,
                              check=True).stdout.splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


if __name__ == "__main__":
    sys.exit(main())
