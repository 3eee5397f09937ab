"""How the end-to-end engine runs are judged: each engine against
transformers in fp32 and llama.cpp on the same weights (oracles.py), held to
upstream's peer on the same file. test_engine.py judges its runs with
evaluate(); rejudge.py judges a run's outputs again on another machine, or
for the first time after an E2E_JUDGE=later run (engines only: device time
is scarcer than CPU time); test_judging.py checks the rules on made-up
numbers.

Tolerances are calibrated, not guessed: every (model, GGUF type) first runs
upstream's own sparse path (FLASHMLA_SPARSE + DeepGEMM indexer, bf16) and
the series' paths, fp16 and bf16, must do as well as it does against the
same oracles. Over all positions (teacher-forced prompt tokens, and the
generated tokens' own log-probabilities):

    mean |d logprob| <= 1.5 x peer + 0.01
    p90  |d logprob| <= 1.5 x peer + 0.02
    top-1 agreement  >= peer - 0.03
    greedy tokens that are the oracle's top-1 on the engine's own prefix, or
    within the peer's p90 of it (a near-tie upstream's rounding flips too)
                     >= peer - 0.05

and, apart, where the indexer's top-k selection is active (more keys than
index_topk) and where every key is selected, with no absolute slack (a
wrong selection shows only where it is active, and a mean over all
positions plus a slack hid a 4.8x error there):

    mean |d logprob| and the scale-free error <= 1.5 x peer
    (the decode steps' mean |d logprob|: 1.5 x peer + 0.01, DECODE_MEAN_SLACK)

The decode steps' bars compare ours and the peer over the steps where the
two continuations share their prefix (up to and including the first token
where they part): after a near-tie flips, each writes another text.

Against transformers, each position counts the smaller error of its two
selections (oracles.fp8_index_scores): its own fp32 index scores and vLLM's
fp8 ones. fp8 rounding moves keys across the top-k boundary, sometimes one
that carries attention weight (GLM-5 Q6_K, 2026-12-02: a key 1.6 % above
the boundary in fp32 falls 0.04 % below it in fp8, moving that step's
output 0.08 scale-free); an engine that selects as either is right there.
A wrong selection (a broken K cache) is far from both.

So are the MoE routers' near-ties (oracles.ROUTER_TIE): where two experts
score within 0.005 in fp32, rounding upstream of the router picks one, and
the choice carries on through the KV cache (GLM-5 IQ4_XS, 2026-12-02: 0.06-
0.11 scale-free at the steps after a 0.0006 margin, on either path). Each
selection is therefore also run "routed as the engine" (routed_as()): each
near-tie, in sequence order, taken the way that brings transformers' row
nearer the engine's. Only near-ties move, so a wrong router or a wrong
expert stays far from it; how many were taken the other way is in the
record (router_ties_taken).

The scale-free error of a position is ||d (lp - mean lp)|| / ||lp_oracle -
mean lp_oracle|| over the whole vocabulary (0 exact, ~1.4 unrelated). Plus
an absolute floor against a broken peer (top-1 agreement >= 0.8). Random
prompts of 384 tokens (3x index_topk: the indexer's choice matters) and 96
tokens (top-k covers the context).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import multiprocessing
import os
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch

from cases import index_topk, model_paths, prompts
from models import shards
from oracles import (
    ROUTER_TIE,
    fp8_index_scores,
    generated_logprobs,
    greedy_gaps,
    llama_cpp_logprobs,
    mtp_reference,
    routed,
    transformers_logprobs,
    transformers_model,
)
from setups import PEER, PEER_MTP, SETUPS

# The decode bars pair ours with the peer over the steps their continuations
# share when every prompt shares at least this many (a third of MAX_TOKENS).
MIN_PAIRED_STEPS = 8

# The test models' NextN block proposes the target's greedy token about 0.8
# of the time in fp32 (tests/e2e/models.py, recipe 8); a broken draft path
# proposes noise (1 in 512).
MIN_ACCEPTANCE = 0.15

# The drafts themselves (mtp_draft_figures): a step's draft is accepted
# exactly where it is the target's greedy token, so each accepted or rejected
# draft says whether the engine's draft agrees with the fp32 reference's on
# that point. Drafts whose reference top two are closer than MTP_TIE nats
# (bf16's p90 distance from fp32 on the test models: 0.10) are left out.
# Ours disagree in at most MTP_SLACK more drafts than upstream's bf16 path
# with MTP (flashmla-bf16-mtp) at its rate, which itself must stay under
# MTP_PEER_MAX (a broken draft path disagrees as often as the reference is
# right, ~0.8). Measured on an H100 (2026-12-06, GLM-5 and GLM-5.2 F16, about
# 160 drafts each): upstream's path and triton-fp16-mtp 0; the fp16 block
# whose attention and MoE enter its residual at 1/2.5 weight (without patch
# 0043) 2 and 4.
MTP_TIE = 0.1
MTP_SLACK = 1
MTP_PEER_MAX = 0.1


def draft_disagreement(prompt_len: int, tokens: list[int], counts: list[int],
                       logits: torch.Tensor) -> dict:
    """How often one speculative token's accept or reject disagrees with the
    reference: tokens, the prompt and the greedy text; counts, the tokens
    each engine step added (1 for the prefill, then 1 + accepted drafts);
    logits, the reference drafter's (row i: its guess for tokens[i + 2]).
    After a step the last known token is tokens[m]; the next draft guesses
    tokens[m + 1] from row m - 1. The last step is left out: max_tokens may
    have cut the token an accepted draft brings."""
    if not counts or counts[0] != 1 or any(c not in (1, 2) for c in counts[1:]) \
            or sum(counts) != len(tokens) - prompt_len:
        raise ValueError(f"step counts {counts} do not describe {len(tokens) - prompt_len} "
                         "tokens with one speculative token")
    top2 = logits.float().topk(2, dim=-1)
    guess = top2.indices[:, 0].tolist()
    margin = (top2.values[:, 0] - top2.values[:, 1]).tolist()
    m = prompt_len
    drafts = near_ties = disagree = 0
    for added in counts[1:-1]:
        drafts += 1
        if margin[m - 1] < MTP_TIE:
            near_ties += 1
        else:
            disagree += (added == 2) != (guess[m - 1] == tokens[m + 1])
        m += added
    return {"drafts": drafts, "near_ties": near_ties, "disagree": disagree}


def expected_step_counts(prompt_len: int, tokens: list[int], drafts) -> list[int]:
    """What an engine with one speculative token reports for a greedy text
    (tokens) whose drafter proposes drafts(i) for tokens[i + 2]: the
    counterpart of draft_disagreement, for its tests."""
    counts, m = [1], prompt_len
    while m + 1 < len(tokens):
        hit = drafts(m - 1) == tokens[m + 1] and m + 2 < len(tokens)
        counts.append(2 if hit else 1)
        m += counts[-1]
    return counts


def mtp_draft_figures(hf: Path, steps: list[dict]) -> dict:
    """draft_disagreement over every prompt's one-step-at-a-time run
    (run_engine.step_counts), against the fp32 reference drafter
    (oracles.mtp_reference) on the same weights; rate: disagreements per
    compared draft."""
    total = {"drafts": 0, "near_ties": 0, "disagree": 0}
    reference = mtp_reference(hf)
    for run in steps:
        tokens = run["prompt"] + run["generated"]
        got = draft_disagreement(len(run["prompt"]), tokens, run["counts"],
                                 reference(tokens))
        total = {k: total[k] + got[k] for k in total}
    compared = total["drafts"] - total["near_ties"]
    return {**total, "rate": round(total["disagree"] / compared, 4) if compared else None}


def scale_free(engine: torch.Tensor, oracle: torch.Tensor) -> torch.Tensor:
    """Per position: ||d of the mean-centred log-probabilities|| / ||the
    oracle's, mean-centred|| over the vocabulary (0 exact, ~1.4 unrelated)."""
    assert torch.isfinite(engine).all(), "engine returned non-finite log-probabilities"
    e = engine.double() - engine.double().mean(-1, keepdim=True)
    r = oracle.double() - oracle.double().mean(-1, keepdim=True)
    return (e - r).norm(dim=-1) / r.norm(dim=-1)


def _figures(d: torch.Tensor, rel: torch.Tensor | None = None,
             agree: torch.Tensor | None = None) -> dict:
    if not len(d):
        return {"n": 0}
    out = {"n": len(d), "mean": round(d.mean().item(), 4),
           "p90": round(d.quantile(0.9).item(), 4), "max": round(d.max().item(), 4)}
    if agree is not None:
        out["top1"] = round(agree.float().mean().item(), 4)
    if rel is not None:
        out["rel"] = round(rel.mean().item(), 4)
        out["rel_p90"] = round(rel.quantile(0.9).item(), 4)
    return out


def _split(d: torch.Tensor, active: torch.Tensor, rel: torch.Tensor | None,
           agree: torch.Tensor | None = None) -> dict:
    """Figures where the top-k selection is active and where every key is
    selected."""
    def pick(x, m):
        return None if x is None else x[m]

    return {"topk_active": _figures(d[active], pick(rel, active), pick(agree, active)),
            "all_keys": _figures(d[~active], pick(rel, ~active), pick(agree, ~active))}


def _alternatives(lp: torch.Tensor) -> torch.Tensor:
    """An oracle's log-probabilities over one sequence as [alternatives,
    positions, vocabulary]: [positions, vocabulary] is one alternative."""
    return lp if lp.ndim == 3 else lp[None]


def _closest(per_alternative: list[torch.Tensor]) -> torch.Tensor:
    """Per position, the smallest of each alternative's error."""
    return torch.stack(per_alternative).min(0).values


def _common(a: list[int], b: list[int]) -> int:
    """How many leading tokens two continuations share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _decode(result: dict, greedy_oracle: list[torch.Tensor], topk: int | None,
            full: bool, keep: list[int] | None = None, text: str = "generated",
            prompt_list: list[list[int]] | None = None) -> dict:
    """Decode-step figures of result's generated tokens against the oracle over
    prompt + generated; keep: per prompt, how many leading steps count (their
    prefixes must be the ones greedy_oracle saw); text "forced": the tokens
    it decoded on the forced text instead (the oracle over prompt + those);
    prompt_list: the prompts result ran (default: cases.prompts())."""
    ds, actives, rels = [], [], []
    for i, (p, r, lp) in enumerate(zip(prompt_list or prompts(), result["prompts"],
                                       greedy_oracle)):
        n = len(r[text]) if keep is None else min(keep[i], len(r[text]))
        gen = r[text][:n]
        got = torch.tensor(r[f"{text}_logprob"][:n])
        assert torch.isfinite(got).all(), "engine returned non-finite log-probabilities"
        alts = _alternatives(lp)
        ds.append(_closest([(got - generated_logprobs(a, len(p), gen)).abs() for a in alts]))
        # generated token j is predicted from len(prompt) + j keys
        actives.append(torch.arange(n) + len(p) > (topk or 0))
        if topk and full:
            rels.append(_closest([scale_free(r["full"][text][:n],
                                             a[len(p) - 1 : len(p) - 1 + n]) for a in alts]))
    dd = torch.cat(ds)
    if not len(dd):
        return {"n": 0}
    out = {"n": len(dd), "mean": round(dd.mean().item(), 4),
           "p90": round(dd.quantile(0.9).item(), 4), "max": round(dd.max().item(), 4)}
    if topk:
        out.update(_split(dd, torch.cat(actives), torch.cat(rels) if full else None))
    return out


def compare(result: dict, oracle: list[torch.Tensor],
            greedy_oracle: list[torch.Tensor] | None, near_tie: float | None = None,
            topk: int | None = None, peer: dict | None = None,
            forced_oracle: list[torch.Tensor] | None = None) -> dict:
    """Engine against one oracle's teacher-forced log-probabilities and, with
    greedy_oracle (its log-probabilities over prompt + the engine's tokens),
    the greedy tokens: a token counts when it is the oracle's top-1 or within
    near_tie nats of it (default: this run's own p90 |d logprob|): the test
    models' continuations have near-ties (margins down to 0.01 nats) that
    rounding flips on any path. The strict share and the gaps of the misses
    are kept. With peer (the peer's engine result), the decode figures of
    both again over the steps their continuations share, and the first that
    differs ("decode_paired", "decode_paired_peer": the decode bars' pair).
    With topk (the model's index_topk), the figures also apart
    where a position sees more keys than topk (the indexer's selection is
    active) and where it does not; with the engine's whole vectors
    ("full"), the scale-free error too. With forced_oracle (the oracle over
    prompt + the forced text every path decoded), the decode figures on
    that text ("decode_forced")."""
    diffs, agree, active, rel = [], [], [], []
    full = all("full" in r for r in result["prompts"])
    for prompt, res, lp in zip(prompts(), result["prompts"], oracle):
        target = torch.tensor(prompt[1:])
        alts = _alternatives(lp)
        got = torch.tensor(res["prompt_logprob"])
        assert torch.isfinite(got).all(), "engine returned non-finite log-probabilities"
        diffs.append(_closest([(got - a[:-1].gather(1, target[:, None])[:, 0]).abs()
                               for a in alts]))
        top1 = torch.tensor(res["prompt_top1"])
        agree.append(torch.stack([top1 == a[:-1].argmax(-1) for a in alts]).any(0))
        # position i predicts token i + 1 from keys 0..i
        active.append(torch.arange(1, len(prompt)) > (topk or len(prompt)))
        if full:
            rel.append(_closest([scale_free(res["full"]["prompt"], a[:-1]) for a in alts]))
    d, hit = torch.cat(diffs), torch.cat(agree)
    out = {
        "mean": round(d.mean().item(), 4),
        "p90": round(d.quantile(0.9).item(), 4),
        "max": round(d.max().item(), 4),
        "top1": round(hit.float().mean().item(), 4),
        "greedy": None,
    }
    if topk:
        out.update(_split(d, torch.cat(active), torch.cat(rel) if full else None, hit))
    if greedy_oracle is not None:
        tie = out["p90"] if near_tie is None else near_tie
        gaps = torch.cat([_closest([greedy_gaps(a, len(p), r["generated"])
                                    for a in _alternatives(lp)])
                          for p, r, lp in zip(prompts(), result["prompts"], greedy_oracle)])
        out.update(greedy=round((gaps <= tie).float().mean().item(), 4),
                   greedy_strict=round((gaps == 0).float().mean().item(), 4),
                   near_tie=tie, greedy_miss_gaps=[round(g, 3) for g in gaps[gaps > 0].tolist()])
        if all("generated_logprob" in r for r in result["prompts"]):
            # Decode steps: the engine's log-probability of each generated token
            # against the oracle's on the same prefix (the prompt figures above
            # come from prefill).
            out["decode"] = _decode(result, greedy_oracle, topk, full)
            if peer is not None and all("generated_logprob" in r for r in peer["prompts"]):
                # The steps before the two continuations part, and the step where
                # they do (the same prefix): after it the texts differ, and so do
                # the figures, whichever path is right. Too few such steps and
                # one token decides: then each path over its own continuation.
                shared = [_common(r["generated"], q["generated"])
                          for r, q in zip(result["prompts"], peer["prompts"])]
                out["decode_parted_at"] = [None if n == len(r["generated"]) else n
                                           for n, r in zip(shared, result["prompts"])]
                if all(n + 1 >= MIN_PAIRED_STEPS for n in shared):
                    keep = [n + 1 for n in shared]
                    both = full and all("full" in q for q in peer["prompts"])
                    out["decode_paired"] = _decode(result, greedy_oracle, topk, both, keep)
                    out["decode_paired_peer"] = _decode(peer, greedy_oracle, topk, both, keep)
    if forced_oracle is not None and all("forced_logprob" in r for r in result["prompts"]):
        forced_full = all("forced" in r.get("full", {}) for r in result["prompts"])
        out["decode_forced"] = _decode(result, forced_oracle, topk, forced_full, text="forced")
    return out


def drift(res: dict, base: dict) -> dict:
    """Two engine runs on the same file: |d logprob| of the prompt tokens and
    the share of greedy tokens that are equal."""
    d = torch.cat([(torch.tensor(a["prompt_logprob"]) - torch.tensor(b["prompt_logprob"])).abs()
                   for a, b in zip(res["prompts"], base["prompts"])])
    same = sum(x == y for a, b in zip(res["prompts"], base["prompts"])
               for x, y in zip(a["generated"], b["generated"]))
    total = sum(len(a["generated"]) for a in res["prompts"])
    return {"mean": round(d.mean().item(), 4), "p90": round(d.quantile(0.9).item(), 4),
            "max": round(d.max().item(), 4), "greedy_equal": round(same / total, 4)}


def decode_bar(mine: dict, theirs: dict) -> list[str]:
    """The decode steps' mean and p90 |d logprob| (_decode's figures) against
    the peer's over the same steps; what fails, as check_bar words it."""
    bad = []
    for key, slack in (("mean", 0.01), ("p90", 0.02)):
        if key in mine and key in theirs and mine[key] > 1.5 * theirs[key] + slack:
            bad.append(f"decode {key} {mine[key]} > 1.5 x {theirs[key]} + {slack}")
    return bad


def check_bar(ours: dict, peer: dict) -> list[str]:
    bad = []
    if ours["mean"] > 1.5 * peer["mean"] + 0.01:
        bad.append(f"mean {ours['mean']} > 1.5 x {peer['mean']} + 0.01")
    if ours["p90"] > 1.5 * peer["p90"] + 0.02:
        bad.append(f"p90 {ours['p90']} > 1.5 x {peer['p90']} + 0.02")
    if ours["top1"] < peer["top1"] - 0.03:
        bad.append(f"top-1 {ours['top1']} < {peer['top1']} - 0.03")
    if ours["greedy"] is not None and ours["greedy"] < peer["greedy"] - 0.05:
        bad.append(f"greedy {ours['greedy']} < {peer['greedy']} - 0.05")
    # The decode steps: on the forced text both decoded, else over the steps
    # both continuations share where the figures were paired (compare's
    # peer), else each over its own.
    forced = "decode_forced" in ours and "decode_forced" in peer
    paired = "decode_paired" in ours and "decode_paired_peer" in ours
    if forced:
        mine_d, theirs_d = ours["decode_forced"], peer["decode_forced"]
    elif paired:
        mine_d, theirs_d = ours["decode_paired"], ours["decode_paired_peer"]
    else:
        mine_d, theirs_d = ours.get("decode", {}), peer.get("decode", {})
    bad += decode_bar(mine_d, theirs_d)
    for where, o, p in (("", ours, peer), ("decode ", mine_d, theirs_d)):
        for part in ("topk_active", "all_keys"):
            mine, theirs = o.get(part, {}), p.get(part, {})
            for key in ("mean", "rel"):
                if key not in mine or key not in theirs:
                    continue
                slack = DECODE_MEAN_SLACK if where and key == "mean" else 0.0
                if mine[key] > _ratio_bar(theirs[key]) + slack:
                    bad.append(f"{where}{part} {key} {mine[key]} > {RATIO} x {theirs[key]}"
                               + (f" + {slack}" if slack else ""))
    if ours["top1"] < 0.8:
        bad.append(f"top-1 {ours['top1']} < 0.8 (absolute floor)")
    return bad


# Where the selection is active and where it is not: held to the peer by
# ratio alone. The floor only keeps a peer at exactly 0 from failing
# rounding; it is far below every figure these models give (>= 0.005).
RATIO = 1.5
_FLOOR = 0.002
# Except the decode steps' mean |d logprob| apart: at most 24 tokens per
# part, means of 0.006-0.02 nats that one near-tie token moves by half. On
# the H200 run of 2026-12-01 (evening) the series' bf16 path, the same
# arithmetic as the peer's, gave 0.53-1.91x the peer there (prompt parts:
# 0.81-1.13x, decode scale-free: 0.77-1.36x). A 4x gap still fails: 0.04
# against the bar 0.025 at a peer of 0.01. The decode bars compare the steps
# both continuations share (compare's peer): after a near-tie flip the texts
# differ (2026-12-02: GLM-5 BF16 fp16 flipped a 0.015-nat tie at step 7 and
# then looped; 0.028 there against the peer's 0.009 on its own text). Where
# they part within MIN_PAIRED_STEPS, each over its own: GLM-5 Q5_K_M fp16
# parted at step 1, on a flat step (top tokens 0.2 nats apart) where each
# path's one token is 0.08-0.18 nats off.
DECODE_MEAN_SLACK = 0.01


def _ratio_bar(peer: float) -> float:
    return RATIO * max(peer, _FLOOR)


_oracle_cache: dict = {}


@functools.cache
def file_digest(path: Path) -> str:
    """A GGUF file's sha256 (16 hex digits; of all its shards, for a split
    set's first): files of the same recipe built on two machines can differ
    (llama.cpp's K-quant search rounds differently on another CPU), and an
    oracle is only an oracle on the engine's bytes."""
    h = hashlib.sha256()
    for shard in shards(path):
        with open(shard, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:16]


def transformers_alternatives(tf, tokens: list[int]) -> torch.Tensor:
    """transformers' log-probabilities over tokens with its own fp32 index
    scores and with vLLM's fp8 ones (oracles.fp8_index_scores), stacked:
    [2, positions, vocabulary]."""
    fp32 = transformers_logprobs(tf, tokens)
    with fp8_index_scores(tf):
        return torch.stack([fp32, transformers_logprobs(tf, tokens)])


@torch.no_grad()
def routed_as(tf, tokens: list[int], engine: torch.Tensor,
              tie: float = ROUTER_TIE) -> tuple[torch.Tensor, int]:
    """transformers' log-probabilities over tokens with each routing near-tie
    (margin < tie) of the rows the engine has (engine: [rows, vocabulary], row
    i after tokens[: i + 1]) taken the way whose row is nearer the engine's,
    in sequence order, each on the rows before it as decided. Returns them
    and how many near-ties were taken the other way. Each choice runs its
    one row on a cache of the rows before it; a choice taken, the rows after
    it again (their near-ties move); the result is one whole forward."""
    ids = torch.tensor([tokens], device=next(tf.parameters()).device)

    def rows(state, start: int, end: int, cache):
        """Log-probabilities of rows start..end-1 on cache (rows before start)."""
        state.offset = start
        out = tf(input_ids=ids[:, start:end], past_key_values=cache, use_cache=True)
        state.offset = 0
        return torch.log_softmax(out.logits[0].float(), dim=-1).cpu(), out.past_key_values

    with routed(tf) as state:
        lp, cache = rows(state, 0, len(tokens), None)
        taken, decided = 0, set()
        while True:
            pending = sorted((row, i) for i, margin in enumerate(state.margins)
                             for row in (margin < tie).nonzero()[:, 0].tolist()
                             if row < len(engine) and (i, row) not in decided)
            if not pending:
                break
            row, i = pending[0]
            decided.add((i, row))
            before = None
            if row:
                before = copy.deepcopy(cache)
                before.crop(row - len(tokens))  # rows before this one
            state.flips.add((i, row))
            state.record = False
            other, _ = rows(state, row, row + 1, copy.deepcopy(before))
            state.record = True
            here = engine[row : row + 1]
            if scale_free(here, other) < scale_free(here, lp[row : row + 1]):
                taken += 1
                after, cache = rows(state, row, len(tokens), before)
                lp = torch.cat([lp[:row], after])
            else:
                state.flips.discard((i, row))
        if taken:
            state.record = False
            lp = transformers_logprobs(tf, tokens)
    return lp, taken


def routed_alternatives(tf, tokens: list[int], engine: torch.Tensor,
                        topk: int | None = None) -> tuple[torch.Tensor, int]:
    """routed_as() on both of transformers' selections, stacked as
    transformers_alternatives(), and the near-ties taken the other way.
    Where no row sees more than topk keys the two selections are one (run
    once)."""
    fp32, n32 = routed_as(tf, tokens, engine)
    if topk is not None and len(tokens) <= topk:
        return torch.stack([fp32, fp32]), n32
    with fp8_index_scores(tf):
        fp8, n8 = routed_as(tf, tokens, engine)
    return torch.stack([fp32, fp8]), n32 + n8


def _engine_rows(r: dict, text: str) -> torch.Tensor:
    """The engine's whole vectors over prompt + text: row i after i + 1 tokens."""
    return torch.cat([r["full"]["prompt"], r["full"][text]])


# judge_all()'s worker processes run transformers on the CPU: ten of them on
# one H100 (2026-12-06, the whole matrix: 42 files) had not finished after 13
# minutes, where a file takes about half a minute of two CPU cores; each
# oracle is thousands of small steps that wait for the GPU, which the
# processes share.
_in_worker = False


def oracle_device() -> str:
    """Where oracles_for() runs transformers (fp32 either way):
    E2E_ORACLE_DEVICE (cpu or cuda); else the CPU in judge_all()'s worker
    processes, and the GPU, where there is one, in any other process."""
    given = os.environ.get("E2E_ORACLE_DEVICE")
    if given:
        if given not in ("cpu", "cuda"):
            raise ValueError(f"E2E_ORACLE_DEVICE={given}: expected cpu or cuda")
        return given
    return "cpu" if _in_worker or not torch.cuda.is_available() else "cuda"


def judge_later() -> bool:
    """E2E_JUDGE=later: test_engine.py runs the engines and checks what they
    chose, and leaves the oracles to rejudge.py on any machine."""
    given = os.environ.get("E2E_JUDGE", "")
    if given not in ("", "later"):
        raise ValueError(f"E2E_JUDGE={given}: expected later (or unset: judge in the run)")
    return given == "later"


def oracles_for(manifest, model: str, gguf_type: str):
    """transformers (fp32, oracle_device(); both selections) and llama.cpp
    (CPU) on one file."""
    key = (model, gguf_type)
    if key not in _oracle_cache:
        hf, gguf = model_paths(manifest, model, gguf_type)
        tf = transformers_model(hf, gguf, oracle_device())
        _oracle_cache[key] = (tf, [transformers_alternatives(tf, p) for p in prompts()],
                              [llama_cpp_logprobs(gguf, p) for p in prompts()])
    return _oracle_cache[key]


def forced_oracles(manifest, model: str, gguf_type: str, forced: list[list[int]]):
    """Both oracles over each prompt + its forced text (the same for every
    path on the file)."""
    key = (model, gguf_type, tuple(map(tuple, forced)))
    if key not in _oracle_cache:
        tf, _, _ = oracles_for(manifest, model, gguf_type)
        _, gguf = model_paths(manifest, model, gguf_type)
        seqs = [p + f for p, f in zip(prompts(), forced)]
        _oracle_cache[key] = ([transformers_alternatives(tf, s) for s in seqs],
                              [llama_cpp_logprobs(gguf, s) for s in seqs])
    return _oracle_cache[key]


def judge(manifest, model: str, gguf_type: str, res: dict, peer: dict | None = None) -> dict:
    """res against both oracles; greedy near-ties at the peer's p90 against
    the same oracle (the peer itself: its own)."""
    tf, tf_prompt, lc_prompt = oracles_for(manifest, model, gguf_type)
    _, gguf = model_paths(manifest, model, gguf_type)
    seqs = [p + r["generated"] for p, r in zip(prompts(), res["prompts"])]
    tf_gen = [transformers_alternatives(tf, s) for s in seqs]
    lc_gen = [llama_cpp_logprobs(gguf, s) for s in seqs]
    tf_forced = lc_forced = None
    if all("forced" in r for r in res["prompts"]):
        tf_forced, lc_forced = forced_oracles(manifest, model, gguf_type,
                                              [r["forced"] for r in res["prompts"]])

    topk = index_topk(manifest, model)
    taken = None
    if all("full" in r for r in res["prompts"]):
        # each selection routed as this engine, beside the two: over prompt +
        # generated (its prompt rows also stand for the prompt's: a row's
        # near-ties depend on the rows before it only) and prompt + forced
        taken = 0

        def routed(text):
            nonlocal taken
            out = []
            for p, r in zip(prompts(), res["prompts"]):
                alts, n = routed_alternatives(tf, p + r[text], _engine_rows(r, text), topk)
                taken += n
                out.append(alts)
            return out

        routed_gen = routed("generated")
        tf_prompt = [torch.cat([_alternatives(lp), extra[:, : len(p)]])
                     for p, lp, extra in zip(prompts(), tf_prompt, routed_gen)]
        tf_gen = [torch.cat([_alternatives(lp), extra]) for lp, extra in zip(tf_gen, routed_gen)]
        if tf_forced is not None and all("forced" in r["full"] for r in res["prompts"]):
            tf_forced = [torch.cat([_alternatives(lp), extra])
                         for lp, extra in zip(tf_forced, routed("forced"))]

    def tie(oracle: str) -> float | None:
        return peer[oracle]["p90"] if peer and oracle in peer else None

    vs_tf = compare(res, tf_prompt, tf_gen, tie("vs_transformers"), topk, peer, tf_forced)
    if taken is not None:
        vs_tf["router_ties_taken"] = taken
    out = {"vs_transformers": vs_tf,
           "vs_llama_cpp": compare(res, lc_prompt, lc_gen, tie("vs_llama_cpp"), topk, peer,
                                   lc_forced)}
    if "steps" in res:
        hf, _ = model_paths(manifest, model, gguf_type)
        out["mtp_drafts"] = mtp_draft_figures(hf, res["steps"])
    return out


def judged_peer(engine_runs, manifest, model: str, gguf_type: str) -> dict:
    """The peer's run on this file, judged (its greedy near-tie: its own p90)."""
    peer = engine_runs[(model, gguf_type, PEER.name)]
    if "prompts" in peer and "vs_transformers" not in peer:
        peer.update(judge(manifest, model, gguf_type, peer))
    return peer


def judge_file(manifest: dict, model: str, gguf_type: str, runs: dict[str, dict]) -> dict:
    """judge() on every run of one file that produced output (runs: setup
    name -> engine result), the peer first: its p90s are the others' near-
    ties. Returns setup name -> figures."""
    out = {}
    peer = runs.get(PEER.name, {})
    if "prompts" in peer:
        out[PEER.name] = judge(manifest, model, gguf_type, peer)
        peer = {**peer, **out[PEER.name]}
    for path, res in runs.items():
        if path != PEER.name and "prompts" in res:
            out[path] = judge(manifest, model, gguf_type, res, peer)
    return out


def _judge_worker(threads: int) -> None:
    global _in_worker
    _in_worker = True
    torch.set_num_threads(threads)


def judge_all(engine_runs: dict, manifest: dict, workers: int, judge_one=judge_file) -> dict:
    """Judge every engine run with output before the tests read them, a file
    per process, workers at a time (the oracles, transformers and llama.cpp,
    are mostly single-threaded Python on models this small), and add the
    figures to engine_runs, which evaluate() then uses as they are. A file
    whose judging raises is left unjudged: evaluate() judges it again in its
    own test, which fails with the error. Returns (model, GGUF type) -> that
    error, for files that raised."""
    files: dict[tuple[str, str], dict[str, dict]] = {}
    for (model, gguf_type, path), res in engine_runs.items():
        if "prompts" in res:
            files.setdefault((model, gguf_type), {})[path] = res
    errors = {}
    if not files:
        return errors
    threads = max(1, (os.cpu_count() or 1) // max(workers, 1))
    # spawn: the parent holds a CUDA context (a fork would share it)
    with ProcessPoolExecutor(max(workers, 1), mp_context=multiprocessing.get_context("spawn"),
                             initializer=_judge_worker, initargs=(threads,)) as pool:
        jobs = {pool.submit(judge_one, manifest, model, gguf_type, runs): (model, gguf_type)
                for (model, gguf_type), runs in files.items()}
        for job in as_completed(jobs):
            model, gguf_type = jobs[job]
            try:
                figures = job.result()
            except Exception:  # noqa: BLE001 - the file's tests judge it again
                errors[(model, gguf_type)] = traceback.format_exc()
                continue
            for path, fig in figures.items():
                engine_runs[(model, gguf_type, path)].update(fig)
    return errors


def _mtp_drafts_bar(row: dict, res: dict, peer_mtp: dict | None, is_peer: bool) -> list[str]:
    """Upstream's disagreement rate + MTP_SLACK drafts (MTP_PEER_MAX for
    upstream's own)."""
    if "mtp_drafts" not in res:
        return ["no one-step-at-a-time run to check the drafts with"]
    mine = row["mtp_drafts"] = res["mtp_drafts"]
    compared = mine["drafts"] - mine["near_ties"]
    if mine["rate"] is None:
        return [f"no draft to compare ({mine})"]
    if is_peer:
        if mine["rate"] > MTP_PEER_MAX:
            return [(f"drafts disagree with the fp32 reference's at {mine['rate']} of "
                    f"{compared} compared > {MTP_PEER_MAX}: the draft path is broken")]
        return []
    if not peer_mtp or (peer_mtp.get("mtp_drafts") or {}).get("rate") is None:
        return [f"no bar: {PEER_MTP.name} did not run or judge"]
    rate = peer_mtp["mtp_drafts"]["rate"]
    if mine["disagree"] > round(rate * compared) + MTP_SLACK:
        return [(f"{mine['disagree']} of {compared} drafts disagree with the fp32 "
                f"reference's > {PEER_MTP.name}'s rate {rate} + {MTP_SLACK}")]
    return []


def evaluate(engine_runs: dict, manifest: dict, model: str, gguf_type: str,
             path: str, oracles: bool = True) -> tuple[dict, list[str]]:
    """One case's record row and its failures (empty: passed); path: the
    name of its engine setup. oracles=False checks only what the engine
    chose and did (backend, dtype, indexer, CUDA graphs, speculation) and
    marks the row "unjudged" (E2E_JUDGE=later)."""
    setup = SETUPS[path]
    res = engine_runs[(model, gguf_type, path)]
    _, gguf = model_paths(manifest, model, gguf_type)
    row = {"model": model, "gguf_type": gguf_type,
           "types": manifest["models"][model]["types"][gguf_type], "path": path,
           "tp": setup.gpus, "gguf_sha256": file_digest(gguf)}
    if "skip" in res:
        return {**row, "skipped": res["skip"]}, []
    if "error" in res:
        # the error's first line in the record; the whole of it in the test's output
        return {**row, "error": res["error"].splitlines()[0], "passed": False}, [res["error"]]
    failures = []
    expected = (setup.backend, setup.dtype, setup.indexer)
    chose = (res["backend"], res["dtype"], res["indexer"])
    if chose != expected:
        failures.append(f"chose {chose}, expected {expected}")
    eager = setup.eager
    if res["cuda_graphs"] == eager:
        failures.append(f"CUDA graphs {'captured' if eager else 'not captured'} "
                        f"(enforce_eager={eager})")
    row.update(backend=res["backend"], dtype=res["dtype"], indexer=res["indexer"],
               cuda_graphs=res["cuda_graphs"], start_s=res["start_s"],
               # for re-analysis on a CPU (tests/e2e/oracles.py)
               generated=[r["generated"] for r in res["prompts"]])
    if setup.speculative:
        base = engine_runs.get((model, gguf_type, setup.held_to), {})
        same = "prompts" in base and all(
            a["generated"] == b["generated"] for a, b in zip(res["prompts"], base["prompts"]))
        spec = res["spec"]
        drafts = spec.get("num_draft_tokens") or 0
        row.update(spec=spec, greedy_equal_to_no_spec=same,
                   acceptance=round((spec.get("num_accepted_tokens") or 0) / drafts, 4)
                   if drafts else None)
        if not same and setup is not PEER_MTP:  # upstream's: recorded, not held
            failures.append(f"greedy output differs from {setup.held_to} without speculation")
        if not drafts:
            failures.append(f"no draft tokens were proposed ({spec})")
        elif row["acceptance"] < MIN_ACCEPTANCE:
            failures.append(f"acceptance {row['acceptance']} < {MIN_ACCEPTANCE}")
    if not oracles:
        if failures:
            row["passed"] = False
        else:
            row["unjudged"] = "E2E_JUDGE=later: judge with tests/e2e/rejudge.py"
        return row, failures
    peer = judged_peer(engine_runs, manifest, model, gguf_type)
    if setup is not PEER and "vs_transformers" not in res:  # judge_all() did not
        # Ours are held to the peer's near-tie: the same rounding scale.
        res.update(judge(manifest, model, gguf_type, res, peer))
    row.update(tf_index_scores=["fp32", "fp8"],  # transformers' selections (judge())
               vs_transformers=res["vs_transformers"], vs_llama_cpp=res["vs_llama_cpp"])
    if setup.gpus > 1:
        # TP changes the order of the reductions (and, in quantized GGUF
        # matmuls, how activations round to 8 bits): the distance to TP 1 is
        # held to the suite's bar on upstream's bf16 distance from fp32.
        base = engine_runs.get((model, gguf_type, setup.held_to), {})
        if "prompts" not in base or "vs_transformers" not in peer:
            failures.append(f"no bar: {setup.held_to} at TP 1 or the peer failed")
        else:
            row["vs_tp1"] = drift(res, base)
            bar = peer["vs_transformers"]
            for key, slack in (("mean", 0.01), ("p90", 0.02)):
                if row["vs_tp1"][key] > 1.5 * bar[key] + slack:
                    failures.append(f"TP {setup.gpus} vs TP 1: {key} "
                                    f"{row['vs_tp1'][key]} > 1.5 x the peer's {bar[key]} "
                                    f"vs fp32 + {slack}")
    if setup.speculative:
        failures += _mtp_drafts_bar(row, res, engine_runs.get((model, gguf_type, PEER_MTP.name)),
                                    setup is PEER_MTP)
    if setup is PEER:
        if res["vs_transformers"]["top1"] < 0.8:
            failures.append(f"peer top-1 {res['vs_transformers']['top1']} < 0.8: model or "
                            "oracle broken")
    elif setup is PEER_MTP:
        pass  # upstream's path with MTP: its figures are recorded, its drafts held above
    else:
        if "vs_transformers" not in peer:
            failures.append("no bar: the peer failed")
        else:
            for oracle in ("vs_transformers", "vs_llama_cpp"):
                failures += [f"{oracle}: {m}" for m in check_bar(res[oracle], peer[oracle])]
    row["passed"] = not failures
    return row, failures
