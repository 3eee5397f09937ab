"""scripts/soak.py (`make soak`) on CPU: its client against a small
OpenAI-style server on 127.0.0.1 that answers like `vllm serve` (and, on
purpose, breaks in the ways the soak must catch), and its judging on
made-up runs. The soak itself needs a GPU."""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

import soak

VOCAB, MAX_LEN = 512, 256


def _app(bug: str | None):
    from aiohttp import web

    state = {"probes": 0}

    def reject(status: int, message: str):
        return web.json_response({"error": {"message": message, "code": status}},
                                 status=status)

    async def health(_):
        return web.Response(text="")

    async def generate(request):
        if request.content_type != "application/json":
            return reject(415, f"unsupported content type {request.content_type}")
        try:
            body = json.loads(await request.read())
        except ValueError:
            return reject(400, "the request body is not valid JSON")
        if body.get("model") != "soak":
            return reject(404, f"the model `{body.get('model')}` does not exist")
        chat = "messages" in body
        prompt = [8] * 10 if chat else body.get("prompt")
        if not prompt:
            return reject(400, "the prompt is empty")
        if any(t >= VOCAB for t in prompt):
            return reject(400, "token id out of vocabulary")
        if any(t < 0 for t in prompt):
            return reject(400, "token id -1 is negative")
        max_tokens = body.get("max_tokens", 16)
        if len(prompt) + max_tokens > MAX_LEN:
            return reject(400, f"{len(prompt)} + {max_tokens} tokens exceed {MAX_LEN}")
        lp = body.get("logprobs")
        if lp is not None and not chat and not 0 <= lp <= 20:
            return reject(400, f"logprobs {lp} is not in [0, 20]")
        if bug == "500" and body.get("n") == 3:
            return web.Response(status=500, text="Internal Server Error")
        greedy = body.get("temperature") == 0.0
        probe = greedy and body.get("return_token_ids")
        if probe:
            state["probes"] += 1
        later = probe and state["probes"] > 2
        shift = 1 if bug == "probe" and later else 0
        tokens = [(sum(prompt) + i + shift) % VOCAB for i in range(max_tokens)]
        value = float("nan") if bug == "nan" and lp else -0.5
        logprobs = {"token_logprobs": [value] * len(tokens)} if lp else None
        if probe and body.get("return_tokens_as_token_ids"):
            # Step 5 is a near-tie (0.001 nats to the runner-up, token + 1);
            # "tie" takes the runner-up there in later probes, whose
            # log-probabilities move by 0.01 ("noisy": by 0.5).
            moved = {"tie": 0.01, "noisy": 0.5}.get(bug, 0.0) if later else 0.0
            margins = [0.001 if i == 5 else 1.0 for i in range(len(tokens))]
            top = [{f"token_id:{t}": value + moved, f"token_id:{(t + 1) % VOCAB}":
                    value + moved - m} for t, m in zip(tokens, margins)]
            if bug == "tie" and later:
                tokens[5] = (tokens[5] + 1) % VOCAB
            logprobs = {"token_logprobs": [value + moved] * len(tokens), "top_logprobs": top}
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for t in tokens:
                chunk = {"choices": [{"index": 0, "text": f"<t{t}>", "logprobs": (
                    {"token_logprobs": [value]} if lp else None)}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(0.002)
            await resp.write(b"data: [DONE]\n\n")
            return resp
        choice = {"index": 0, "text": "", "token_ids": tokens, "logprobs": logprobs}
        return web.json_response({"choices": [choice] * body.get("n", 1),
                                  "usage": {"completion_tokens": len(tokens)}},
                                 dumps=lambda x: json.dumps(x))

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app


@contextmanager
def fake_server(bug: str | None = None):
    from aiohttp import web

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(_app(bug))

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.05)
    try:
        yield soak.Target(f"http://127.0.0.1:{port}", "soak", MAX_LEN, VOCAB)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _soak(bug: str | None, seconds: float = 4.0) -> tuple[dict, list[str]]:
    run = soak.Run()
    with fake_server(bug) as target:
        asyncio.run(soak.drive(target, seconds, 8, 0, lambda: (1000.0, 500.0), run))
    run.preemptions, run.alive_after = 3.0, True
    return soak.verdict(run, stall_s=2.0)


def test_the_client_drives_every_kind_and_a_sound_server_passes():
    summary, failures = _soak(None)
    assert not failures, failures
    assert summary["probes"] >= 3 and summary["probe_outputs"] == 1
    assert summary["probe_noise_nats"] == 0 and summary["probe_near_ties"] == []
    assert summary["rejected_4xx"] >= len(soak.bad_requests(soak.Target("", "", 1, 1)))
    assert summary["client_stops"] > 0 and summary["completed"] > 20


@pytest.mark.parametrize("bug,expect", [
    ("500", "failed (5xx"),
    ("nan", "non-finite logprobs"),
    ("probe", "the greedy probe changed"),
    ("noisy", "log-probabilities moved by 0.500 nats"),
])
def test_a_broken_server_fails_the_soak(bug, expect):
    _, failures = _soak(bug)
    assert any(expect in f for f in failures), failures


def test_stall_is_the_longest_silence_with_requests_in_flight():
    events = [1.0, 2.0, 9.5, 10.0, 30.0]
    assert soak.max_stall(events, [(0.5, 10.5)]) == pytest.approx(7.5)
    # silence while nothing was in flight is no stall
    assert soak.max_stall(events, [(0.5, 10.5), (29.0, 30.5)]) == pytest.approx(7.5)
    assert soak.max_stall([], [(0.0, 4.0)]) == pytest.approx(4.0)


def test_memory_growth_is_judged_on_the_last_half():
    level = [1000.0] * 10 + [1010.0] * 10
    leak = [1000.0 + 40 * i for i in range(20)]
    assert soak.growth(level) == pytest.approx(10.0)
    assert soak.growth(leak) == pytest.approx(400.0)
    run = soak.Run(samples=[soak.Sample(i, g, 500.0, 1) for i, g in enumerate(leak)],
                   probes=[soak.Probe([1])], preemptions=1.0, alive_after=True)
    _, failures = soak.verdict(run, 5.0)
    assert failures == ["GPU memory grew 400 MiB over the last half"]


def test_silent_4xx_dead_server_no_preemption_and_tracebacks_fail():
    log = ("INFO ok\nTraceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
           "    g()\nRuntimeError: CUDA error: an illegal memory access\nINFO after\n")
    run = soak.Run(outcomes=[soak.Outcome("bad", 0.0, 1.0, status=400, message="")],
                   probes=[soak.Probe([1, 2]), soak.Probe([1, 2])], alive_after=False,
                   log_tracebacks=soak.tracebacks(log))
    _, failures = soak.verdict(run, 5.0)
    text = "\n".join(failures)
    for expect in ("4xx without a message", "did not answer /health", "preempted nothing",
                   "RuntimeError: CUDA error"):
        assert expect in text, failures


def test_tracebacks_name_files_from_the_package_on():
    log = ('ERROR Traceback (most recent call last):\n'
           '  File "/some/venv/lib/python3.12/site-packages/vllm/v1/engine/async_llm.py", '
           'line 660, in output_handler\n'
           '  File "/usr/lib/python3/dist-packages/x.py", line 1, in f\nValueError: x\n')
    (tb,) = soak.tracebacks(log)
    assert 'File "site-packages/vllm/v1/engine/async_llm.py"' in tb
    assert 'File "dist-packages/x.py"' in tb and "/some/venv" not in tb and "/usr/lib" not in tb


def test_logprob_check_sees_nan_and_inf_anywhere():
    good = {"choices": [{"logprobs": {"content": [{"logprob": -1.0, "bytes": [60],
                                                   "top_logprobs": [{"logprob": -2.0}]}]}}]}
    assert soak._finite_logprobs(good)
    for bad in (math.nan, math.inf, -math.inf):
        nested = json.loads(json.dumps(good))
        nested["choices"][0]["logprobs"]["content"][0]["top_logprobs"][0]["logprob"] = bad
        assert not soak._finite_logprobs(nested)


def test_concurrency_ramps_past_the_kv_cache_then_holds():
    seen = [soak.concurrency_at(t, 300, 128) for t in range(0, 300, 10)]
    assert seen[0] == 4 and max(seen) == 128 and seen == sorted(seen)
    assert all(c == 128 for c in seen[len(seen) // 2 + 1:])


def test_render_names_the_verdict():
    head = {"date": "d", "card": "c", "vllm": "v", "gguf": "g", "minutes": 5,
            "max_concurrency": 8, "command": "scripts/soak.py", "passed": False,
            "summary": {"requests": 3}, "failures": ["a stall of 9.0 s"]}
    md = soak.render([{"minute": 0, "requests": 3, "tokens_per_s": 1.5, "4xx": 1,
                       "failed": 0}, head])
    assert "| 0 | 3 | 1.5 | 1 | 0 |" in md and "**FAILED**" in md and "a stall of 9.0 s" in md


@pytest.mark.parametrize("command", [["true"], ["sleep", "600"]])
def test_stopping_the_server_copes_with_a_group_already_gone(command):
    """A server that died at start (its process group gone) is stopped without
    an error, which would hide why it died; a live one is terminated."""
    server = subprocess.Popen(command, start_new_session=True)
    if command == ["true"]:
        server.wait()
    soak.stop_server(server)
    assert server.returncode is not None


def test_gpu_memory_is_the_servers_processes_where_the_driver_lists_them(monkeypatch):
    rows = {"--query-compute-apps=pid,used_memory": [["11", "900"], ["12", "100"], ["99", "5000"]],
            "--query-gpu=memory.used": [["7000"]]}
    monkeypatch.setattr(soak, "_smi", rows.__getitem__)
    monkeypatch.setattr(soak, "_session_pids", lambda sid: {10, 11, 12})
    assert soak._gpu_mib(10) == (1000.0, "server processes")
    # a container whose processes the driver does not list by our pids
    monkeypatch.setattr(soak, "_session_pids", lambda sid: {20})
    assert soak._gpu_mib(20) == (7000.0, "whole GPU")
    run = soak.Run()
    monkeypatch.setattr(soak, "_session_rss_mib", lambda sid: 1.0)
    assert soak._sample(20, run) == (7000.0, 1.0) and run.gpu_measure == "whole GPU"
    # the measure may not change within a run: that sample is left out
    monkeypatch.setattr(soak, "_session_pids", lambda sid: {10, 11, 12})
    assert soak._sample(10, run) == (None, 1.0)


def test_the_record_names_files_not_the_machines_folders():
    assert soak._portable("/some/where/e2e/glm5/glm5-q4_k_m.gguf") == "glm5/glm5-q4_k_m.gguf"
    assert soak._portable("--minutes") == "--minutes"


def test_a_tokenizer_without_a_chat_template_gets_no_chat_requests(tmp_path):
    """vLLM answers chat without a template with a 400 that would count as a
    failed good request: such a tokenizer (the engine benchmark's) is soaked
    without chat requests, and the record says so."""
    assert not soak.has_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8}))
    assert not soak.has_chat_template(tmp_path)
    plain = soak.Target("", "m", MAX_LEN, VOCAB, chat=False)
    rng = random.Random(0)
    kinds = {soak.good_request(rng, plain)[0] for _ in range(400)}
    assert kinds and not {k for k in kinds if k.startswith("chat")}
    assert {soak.good_request(rng, soak.Target("", "m", MAX_LEN, VOCAB))[0]
            for _ in range(400)} >= {"chat", "chat_stream"}
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    assert soak.has_chat_template(tmp_path)
    head = {"date": "d", "card": "c", "vllm": "v", "gguf": "g", "minutes": 1,
            "max_concurrency": 2, "command": "x", "chat": False, "summary": {},
            "failures": [], "passed": True}
    assert "no chat requests: the tokenizer has no chat template" in soak.render([head])


def test_the_probe_may_part_at_a_near_tie_within_its_own_spread():
    summary, failures = _soak("tie")
    assert not failures, failures
    assert summary["probe_outputs"] == 2 and summary["probe_noise_nats"] == 0.01
    assert {t for t, _ in summary["probe_near_ties"]} == {5}


def _probe(tokens, logprobs, last_top):
    """A probe whose last step ranks last_top ({token: log-probability});
    the steps before rank their own token alone."""
    top = [[[t, lp]] for t, lp in zip(tokens[:-1], logprobs)]
    ranked = sorted(last_top.items(), key=lambda tv: -tv[1])
    return soak.Probe(tokens, logprobs, top + [[list(tv) for tv in ranked]])


# The first probe: token 3 at the last step; 9, 7 and 8 behind by 0.015, 0.018
# and 0.5.
REF = _probe([1, 2, 3], [-0.1, -0.2, -0.3], {3: -0.3, 9: -0.315, 7: -0.318, 8: -0.8})


@pytest.mark.parametrize("other, near", [
    # 9 taken where the first ranks it 0.015 behind and this one ranks 3
    # 0.005 behind: within twice the spread (0.01)
    (_probe([1, 2, 9], [-0.1, -0.21, -0.31], {9: -0.31, 3: -0.315}), True),
    # the first's third of a three-way tie, ranked within the bar by both
    (_probe([1, 2, 7], [-0.1, -0.21, -0.31], {7: -0.31, 9: -0.311, 3: -0.315}), True),
    # 8 is 0.5 behind in the first probe
    (_probe([1, 2, 8], [-0.1, -0.21, -0.3], {8: -0.3, 3: -0.31}), False),
    # 9, but this probe puts the first's token 0.4 behind
    (_probe([1, 2, 9], [-0.1, -0.21, -0.3], {9: -0.3, 3: -0.7}), False),
    # 9, but the first's token is not among this one's top
    (_probe([1, 2, 9], [-0.1, -0.21, -0.3], {9: -0.3, 5: -0.31}), False),
    # a token outside the first's top
    (_probe([1, 2, 6], [-0.1, -0.21, -0.3], {6: -0.3, 3: -0.301}), False),
    # 9 within the margin, but no spread: identical log-probabilities before
    (_probe([1, 2, 9], [-0.1, -0.2, -0.31], {9: -0.31, 3: -0.315}), False),
    # shorter: parted where the first is longer, nothing to excuse it
    (_probe([1, 2], [-0.1, -0.2], {2: -0.2}), False),
])
def test_probe_verdict_excuses_only_a_near_tie(other, near):
    noise, bar, flips, failures = soak.probe_verdict([REF, REF, other])
    assert len(flips) == 1 and flips[0]["near_tie"] is near
    assert flips[0]["token"] == min(2, len(other.tokens))
    assert bar == pytest.approx(2 * noise)
    assert bool(failures) is not near


def test_parse_probe_ranks_the_top_by_token_id():
    # a tie: the chosen token need not come first, and no token is its own runner-up
    choice = {"token_ids": [7, 3], "logprobs": {
        "token_logprobs": [-0.2, -1.0],
        "top_logprobs": [{"token_id:7": -0.2, "token_id:4": -0.7, "token_id:5": -0.2},
                         {"token_id:3": -1.0}]}}
    p = soak.parse_probe(choice)
    assert p.tokens == [7, 3] and p.logprobs == [-0.2, -1.0]
    assert p.top == [[[5, -0.2], [7, -0.2], [4, -0.7]], [[3, -1.0]]]
    assert p.logprob_of(0, 4) == -0.7 and p.logprob_of(0, 9) is None
    assert p.logprob_of(2, 3) is None


SOAK_RECORDS = sorted((soak.Path(__file__).parent / "e2e").glob("r*/nvidia-h200/**/soak*.jsonl"))


@pytest.mark.parametrize("data", SOAK_RECORDS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_committed_soak_records_are_rendered_from_their_data(data):
    rows = [json.loads(line) for line in data.read_text().splitlines() if line]
    assert soak.render(rows) == data.with_suffix(".md").read_text()


def _steady(spread: float) -> soak.Run:
    """A run that holds on everything but, maybe, its probe's spread."""
    probes = [soak.Probe([1, 2, 3], [-0.1, -0.2 - d, -0.3]) for d in (0.0, spread, 0.0)]
    return soak.Run(probes=probes, preemptions=5.0, alive_after=True)


@pytest.mark.parametrize("peer_minutes, spread, passed",
                         [(0, 0.15, False), (1.5, 0.15, True), (1.5, 0.5, False)])
def test_the_peers_spread_sets_the_probes_bar(tmp_path, monkeypatch, peer_minutes, spread,
                                              passed):
    """With --peer-minutes, upstream's path runs the same load first (its
    arguments after the soak's own) and twice its probe's spread is the
    bar: a 0.15-nat spread fails the fixed 0.1 bar and passes against a peer
    that spreads 0.08; 0.5 fails against it too."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"vocab_size": 512}))
    calls = []

    def fake(args, target, extra, env, minutes, out):
        calls.append((list(extra), dict(env), minutes))
        out.mkdir(parents=True, exist_ok=True)
        return _steady(0.08 if env else spread), 0.0

    monkeypatch.setattr(soak, "soak_server", fake)
    monkeypatch.setattr(soak.sys, "argv", [
        "soak.py", "--gguf", "/m/x.gguf", "--hf", str(hf), "--out", str(tmp_path / "out"),
        "--minutes", "3", "--peer-minutes", str(peer_minutes), "--", "--max-num-seqs", "64"])
    assert soak.main() == (0 if passed else 1)
    head = json.loads((tmp_path / "out" / "soak.jsonl").read_text().splitlines()[-1])
    assert head["passed"] is passed
    if peer_minutes:
        assert calls[0] == (["--max-num-seqs", "64", *soak.PEER_ARGS], soak.PEER_ENV, 1.5)
        assert head["summary"]["probe_noise_cap"] == 0.16
        assert head["peer"]["probe_noise_nats"] == 0.08
        peer = json.loads((tmp_path / "out" / "peer" / "soak.jsonl").read_text().splitlines()[-1])
        assert peer["path"].startswith("upstream") and peer["passed"]
        assert "the probe's bar from the peer" in (tmp_path / "out" / "soak.md").read_text()
    else:
        assert len(calls) == 1 and head["summary"]["probe_noise_cap"] == soak.PROBE_NOISE_CAP
    assert calls[-1] == (["--max-num-seqs", "64"], {}, 3.0)
    assert (tmp_path / "out" / "probes.jsonl").read_text().count("\n") == 3


def _parting(spread: float, gap: float) -> soak.Run:
    """A run whose probes spread by `spread` and whose last probe takes, at
    its last step, the token the first put `gap` nats behind its own."""
    ref = _probe([1, 2, 3], [-0.1, -0.2, -0.3], {3: -0.3, 9: -0.3 - gap})
    moved = _probe([1, 2, 3], [-0.1, -0.2 - spread, -0.3], {3: -0.3, 9: -0.3 - gap})
    parted = _probe([1, 2, 9], [-0.1, -0.2, -0.3], {9: -0.3, 3: -0.31})
    return soak.Run(probes=[ref, moved, parted], preemptions=5.0, alive_after=True)


@pytest.mark.parametrize("peer_minutes, series_gap, peer_gap, passed, peer_own", [
    (0, 0.3, 0.25, False, None),  # the fixed bar: twice the 0.1 spread
    (1.0, 0.3, 0.25, True, True),  # the peer's: twice 2 x 0.08
    (1.0, 0.4, 0.25, False, True),
    (1.0, 0.3, 0.5, True, False),  # a bar upstream's own path fails is said
])
def test_with_a_peer_the_near_tie_bar_is_twice_the_spread_allowed(
        tmp_path, monkeypatch, peer_minutes, series_gap, peer_gap, passed, peer_own):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"vocab_size": 512}))

    def fake(args, target, extra, env, minutes, out):
        out.mkdir(parents=True, exist_ok=True)
        return (_parting(0.08, peer_gap) if env else _parting(0.1, series_gap)), 0.0

    monkeypatch.setattr(soak, "soak_server", fake)
    monkeypatch.setattr(soak.sys, "argv", [
        "soak.py", "--gguf", "/m/x.gguf", "--hf", str(hf), "--out", str(tmp_path / "out"),
        "--peer-minutes", str(peer_minutes)])
    assert soak.main() == (0 if passed else 1)
    head = json.loads((tmp_path / "out" / "soak.jsonl").read_text().splitlines()[-1])
    assert head["passed"] is passed
    assert head["summary"]["probe_tie_bar"] == (0.32 if peer_minutes else 0.2)
    if peer_minutes:
        assert (not head["peer"]["probe_bar_failures"]) is peer_own
        md = (tmp_path / "out" / "soak.md").read_text()
        assert ("the peer's own probe against that bar: passes" in md) is peer_own


def test_peer_cap_has_a_floor():
    assert soak.peer_cap(0.0) == soak.PROBE_NOISE_FLOOR
    assert soak.peer_cap(0.1) == pytest.approx(0.2)


_FAKE_SERVE = """#!{python}
# `vllm serve` as the soak starts it: the fake server above on the --port it is given
import os
import sys

sys.path[:0] = {paths!r}
from aiohttp import web

import test_soak

print("env", os.environ.get("VLLM_GGUF_KERNELS"), "args", " ".join(sys.argv[1:]), flush=True)
web.run_app(test_soak._app(None), host="127.0.0.1",
            port=int(sys.argv[sys.argv.index("--port") + 1]), print=None)
"""


def test_soak_server_starts_drives_and_stops_a_server(tmp_path, monkeypatch):
    """soak_server as main calls it for the peer: its arguments after the
    soak's own, its environment, a port of its own; the load and probes
    run, and the server is gone afterwards."""
    fake = tmp_path / "python"
    fake.write_text(_FAKE_SERVE.format(python=sys.executable, paths=[
        str(soak.Path(__file__).parent), str(soak.Path(soak.__file__).parent)]))
    fake.chmod(0o755)
    monkeypatch.setattr(soak.sys, "executable", str(fake))
    args = soak.argparse.Namespace(gguf=tmp_path / "x.gguf", hf=tmp_path, max_model_len=MAX_LEN,
                                   kv_cache_tokens=4096, max_concurrency=8, seed=0,
                                   probe_len=16)
    target = soak.Target("", "soak", MAX_LEN, VOCAB)
    run, _ = soak.soak_server(args, target, ["--x", *soak.PEER_ARGS], soak.PEER_ENV, 0.05,
                              tmp_path / "peer")
    first = (tmp_path / "peer" / "server.log").read_text().splitlines()[0]
    assert first.startswith("env upstream args") and first.split()[-4:] == soak.PEER_ARGS
    assert "--dtype float16" in first  # the soak's own, which the peer's follow
    assert len(run.probes) >= 2 and run.alive_after
    port = int(first.split("--port ")[1].split()[0])
    with pytest.raises(OSError):  # stopped
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    assert run.outcomes and not [o for o in run.outcomes if o.error]
