"""One engine run, in its own process (the environment decides vLLM's
choices at import time): `python run_engine.py CASE.json OUT.json`.

CASE: {"gguf", "hf", "prompts", "max_tokens", "llm": {LLM keyword args},
"full_logprobs": vocabulary size (optional), "forced": per prompt, tokens
to decode again after the greedy run (optional; forced_tokens.py),
"sequential": one prompt after the other (optional: a later prompt can
reuse an earlier one's cached prefix), "prompt_logprobs": false (optional:
none asked; vLLM reads no cached prefix for a request that asks)}.
OUT: per prompt the teacher-forced log-probability of each prompt token and
the engine's top-1 token there, the greedy continuation, plus what the
engine chose (attention backend, dtype, indexer) and spec-decode counters.
With full_logprobs (the LLM needs max_logprobs as large), OUT minus its
".json" plus ".logprobs.pt" holds every position's whole log-probability
vector: per prompt, "prompt" [prompt tokens - 1, vocab] and "generated"
[generated tokens, vocab], and "forced" [forced tokens, vocab] (float32;
NaN where the engine gave none). With forced, each prompt's "forced" and
"forced_logprob": the engine's log-probability of each forced token, decoded
on that text.

launch() runs one in a process of its own and returns engine_result(),
which reads what a run left (test_engine.py, rejudge.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def full_logprobs_path(out: Path) -> Path:
    return out.with_name(out.name.removesuffix(".json") + ".logprobs.pt")


def engine_result(out_file: Path, log: str) -> dict:
    """An engine run's output file (and its whole log-probability vectors,
    where it wrote them), plus what it chose, read from its log."""
    import torch

    try:
        result = json.loads(out_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{out_file} is not complete JSON ({e}): the engine was stopped "
                         "while writing it?") from None
    vectors = full_logprobs_path(out_file)
    if vectors.is_file():
        for res, full in zip(result["prompts"], torch.load(vectors)):
            res["full"] = full
    result["backend"] = next((b for b in ("TRITON_MLA_SPARSE", "FLASHMLA_SPARSE",
                                           "FLASHINFER_MLA_SPARSE")
                              if f"Using AttentionBackendEnum.{b}" in log
                              or f"Using {b}" in log), "unknown")
    result["indexer"] = "triton" if "DSA indexer: Triton kernels" in log else "deepgemm"
    result["cuda_graphs"] = "Graph capturing finished" in log or "Capturing CUDA graph" in log
    result["marlin_moe"] = "on vLLM's Marlin MoE kernel, repacked at load" in log
    return result


# The process groups of the engines launch() is waiting for: each runs in a
# session of its own, which a signal to the test run does not reach.
_RUNNING: set[int] = set()
_STOPPED = threading.Event()
# held from the check for _STOPPED to the engine's entry in _RUNNING
# (re-entrant: stop_all runs in a signal handler of the main thread)
_LOCK = threading.RLock()


def _abort(pgids: list[int], grace: float = 2.0) -> None:
    """SIGABRT to the engines' process groups (faulthandler, on in their
    environment, writes each Python process's stacks to its log at once:
    where a hung engine waited), then, ``grace`` seconds later, SIGKILL to
    whatever is left of them."""
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGABRT)
    if pgids:
        time.sleep(grace)
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def stop_all() -> None:
    """End every engine launch() is waiting for (its process group, with
    its stacks in its log); later launches start none."""
    with _LOCK:
        _STOPPED.set()
        _abort(list(_RUNNING))


def stop_on_sigterm() -> None:
    """On SIGTERM (`timeout`, a CI runner), kill the running engines, then
    stop as on Ctrl-C (KeyboardInterrupt: fixtures' teardown runs). By
    default SIGTERM ends Python at once, and the engines would hold the
    GPU after the run."""

    def stop(signum, frame):
        stop_all()
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)


def launch(case: dict, work: Path, stem: str, env: dict[str, str]) -> dict:
    """Run one engine on case (this file, its own process) in work/<stem>.*:
    its result (engine_result), or {"error": ...} with its log's end.
    E2E_ENGINE_TIMEOUT (default 900 s) bounds it; the engine's process
    group goes on a timeout (its workers hold the output pipes)."""
    case_file, out_file = work / f"{stem}.json", work / f"{stem}.out.json"
    case_file.write_text(json.dumps(case))
    limit = int(os.environ.get("E2E_ENGINE_TIMEOUT", "900"))
    with _LOCK:
        if _STOPPED.is_set():
            return {"error": f"{stem}: not started, the test run is stopping"}
        proc = subprocess.Popen([sys.executable, str(HERE / "run_engine.py"), str(case_file),
                                 str(out_file)], env=dict(env, PYTHONFAULTHANDLER="1"),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        _RUNNING.add(proc.pid)
    try:
        log, _ = proc.communicate(timeout=limit)
        timed_out = False
    except subprocess.TimeoutExpired:
        _abort([proc.pid])
        log, _ = proc.communicate()
        timed_out = True
    finally:
        _RUNNING.discard(proc.pid)
    (work / f"{stem}.log").write_text(log)
    name = Path(case["gguf"]).name
    if timed_out:
        return {"error": f"{stem}: engine on {name} did not finish in {limit} s "
                         f"(E2E_ENGINE_TIMEOUT):\n{log[-4000:]}"}
    if proc.returncode:
        return {"error": f"{stem}: engine failed on {name}:\n{log[-6000:]}"}
    return engine_result(out_file, log)


def _dense(entries, vocab: int):
    import torch

    rows = torch.full((len(entries), vocab), float("nan"))
    for i, entry in enumerate(entries):
        for token, lp in entry.items():
            rows[i, token] = lp.logprob
    return rows


def step_counts(llm, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Each prompt alone, driven one engine step at a time: the prompt, the
    greedy tokens and how many tokens each step added. With one speculative token a decode step
    adds 2 where its draft was accepted and 1 where not (vLLM reports no
    drafts, only counts): judging.mtp_draft_figures holds the steps to the
    drafts of the fp32 reference."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    out = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        engine.add_request(f"steps-{i}", TokensPrompt(prompt_token_ids=prompt), params)
        counts, tokens = [], []
        while engine.has_unfinished_requests():
            for o in engine.step():
                new = list(o.outputs[0].token_ids) if o.outputs else []
                if new:
                    counts.append(len(new))
                    tokens += new
        out.append({"prompt": prompt, "generated": tokens, "counts": counts})
    return out


def main() -> None:
    case = json.loads(Path(sys.argv[1]).read_text())
    from vllm import LLM, SamplingParams, TokensPrompt

    forced = case.get("forced")
    llm_args = {"tokenizer": case["hf"], **case["llm"]}
    if forced:
        # found by name in the engine's processes (this folder is on sys.path)
        llm_args["logits_processors"] = ["forced_tokens:ForcedTokens"]
    start = time.monotonic()
    llm = LLM(model=case["gguf"], hf_config_path=case["hf"], seed=0, **llm_args)
    started = time.monotonic() - start
    full = case.get("full_logprobs")
    asked = case.get("prompt_logprobs", True)
    params = SamplingParams(temperature=0.0, max_tokens=case["max_tokens"], ignore_eos=True,
                            prompt_logprobs=(full or 1) if asked else None, logprobs=full or 1)
    token_prompts = [TokensPrompt(prompt_token_ids=p) for p in case["prompts"]]
    if case.get("sequential"):
        outputs = [out for p in token_prompts for out in llm.generate([p], params)]
    else:
        outputs = llm.generate(token_prompts, params)
    result = {"start_s": round(started, 1), "prompts": []}
    vectors = []
    for out in outputs:
        if full:
            vectors.append({"prompt": _dense((out.prompt_logprobs or [None])[1:], full),
                            "generated": _dense(out.outputs[0].logprobs, full)})
        actual, top1 = [], []
        for pos, entry in enumerate(out.prompt_logprobs or []):
            if entry is None:  # the first token has no prediction
                continue
            token = out.prompt_token_ids[pos]
            actual.append(entry[token].logprob)
            top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
        result["prompts"].append({
            "prompt_logprob": actual,
            "prompt_top1": top1,
            "generated": list(out.outputs[0].token_ids),
            # the engine's log-probability of each token it generated (decode)
            "generated_logprob": [entry[token].logprob for token, entry in
                                  zip(out.outputs[0].token_ids, out.outputs[0].logprobs)],
        })
    if forced:
        # The same prompts again, each decoding its forced tokens: every
        # path's decode steps on one text.
        params = [SamplingParams(temperature=0.0, max_tokens=len(f), ignore_eos=True,
                                 logprobs=full or 1, extra_args={"forced_tokens": f})
                  for f in forced]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in case["prompts"]], params)
        for i, (out, tokens) in enumerate(zip(outs, forced)):
            got = list(out.outputs[0].token_ids)
            if got != tokens:
                raise RuntimeError(f"prompt {i}: forced decoding took {got}, not {tokens}: "
                                   "the forcing logits processor did not act")
            result["prompts"][i].update(forced=tokens, forced_logprob=[
                entry[t].logprob for t, entry in zip(tokens, out.outputs[0].logprobs)])
            if full:
                vectors[i]["forced"] = _dense(out.outputs[0].logprobs, full)
    if case.get("step_tokens"):
        result["steps"] = step_counts(llm, case["step_prompts"], case["step_tokens"])
    config = llm.llm_engine.vllm_config
    result["dtype"] = str(config.model_config.dtype).removeprefix("torch.")
    result["spec"] = {}
    try:
        for metric in llm.get_metrics():
            if metric.name.startswith("vllm:spec_decode_num_"):
                result["spec"][metric.name.removeprefix("vllm:spec_decode_")] = getattr(
                    metric, "value", None)
    except Exception as e:  # metrics are informative only
        result["spec"]["error"] = repr(e)
    if full:
        import torch

        torch.save(vectors, full_logprobs_path(Path(sys.argv[2])))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
