"""Render the end-to-end run record (E2E_RECORD, JSON lines written by
test_engine.py, test_serve.py, test_decode_batches.py and
test_long_context.py) as markdown tables: `python tests/e2e/record.py IN.jsonl OUT.md`.
The output is generated; notes about a run belong in tests/e2e/runs/<card>/<date>/NOTES.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _fig(m: dict) -> str:
    greedy = "-" if m.get("greedy") is None else f"{m['greedy']:.3f}"
    if m.get("greedy_strict") is not None:
        greedy += f" ({m['greedy_strict']:.3f})"
    decode = f"; decode {m['decode']['mean']:.3f} / {m['decode']['p90']:.3f}" \
        if "decode" in m else ""
    if m.get("decode_forced", {}).get("n"):
        decode += (f"; forced decode {m['decode_forced']['mean']:.3f} / "
                   f"{m['decode_forced']['p90']:.3f}")
    return f"{m['mean']:.3f} / {m['p90']:.3f} / {m['top1']:.3f} / {greedy}{decode}"


def _by_selection(m: dict) -> str:
    """Figures where the indexer's top-k selection is active and where every
    key is selected: mean |d logprob| / scale-free error."""
    parts = []
    for label, where in (("", m), ("decode ", m.get("decode", {})),
                         ("forced decode ", m.get("decode_forced", {}))):
        for part, name in (("topk_active", "active"), ("all_keys", "all keys")):
            f = where.get(part)
            if f and f.get("n"):
                rel = f" / {f['rel']:.3f}" if "rel" in f else ""
                parts.append(f"{label}{name} {f['mean']:.3f}{rel}")
    return "; ".join(parts)


def _tp(r: dict) -> str:
    d = r.get("vs_tp1")
    return "" if d is None else f"{d['mean']:.4f} / {d['p90']:.4f} / {d['greedy_equal']:.3f}"


def _greedy_note(rows: list[dict]) -> str:
    if any("near_tie" in r.get("vs_transformers", {}) for r in rows):
        return ("share of greedy tokens that are the oracle's top-1 on the engine's own "
                "prefix or within the peer's p90 of it (in parentheses: the oracle's "
                "top-1 exactly)")
    # records written before test_engine.py judged near-ties
    return ("share of greedy tokens that are the oracle's top-1 on the engine's own "
            "prefix (transformers only)")


def _section(title: str, note: str, header: str, align: str, body: list[str],
             rows: list[dict], first: dict) -> list[str]:
    """A table of another test's rows under the engine table (none without
    rows); rows of another run than the engine rows' name that run."""
    if not body:
        return []
    own = (first.get("date"), first.get("vllm"))
    runs = sorted({(r["date"], r.get("vllm")) for r in rows if r.get("date")} - {own})
    when = [f"Run of {d} with vLLM {v}." for d, v in runs]
    return ["", f"## {title}", "", note, *(["", *when] if when else []), "", header, align,
            *body]


def _serve(rows: list[dict], first: dict) -> list[str]:
    """test_serve.py's rows: `vllm serve` as SM120 users start it."""
    body = []
    for r in rows:
        misses = ", ".join(f"{g:.3f}" for g in r["greedy_miss_gaps"]) or "none"
        body.append(f"| {r['model']} | {r['gguf_type']} | {r['serve']} | "
                    f"{r['prompt_tokens']} | {r['greedy']:.3f} ({r['greedy_strict']:.3f}) | "
                    f"{r['near_tie']} | {misses} | {'yes' if r['passed'] else 'NO'} |")
    return _section(
        "vllm serve (--dtype float16, the device reported as SM 12.0)",
        ("Greedy tokens of the reply that are transformers fp32's top-1 on the reply's "
         "own prefix or within the near-tie of it (in parentheses: its top-1 exactly); "
         "bar: 0.9."),
        ("| model | GGUF | endpoint | prompt tokens | greedy | near-tie (nats) | "
         "misses (nats) | pass |"),
        "|---|---|---|---:|---|---:|---|---|", body, rows, first)


def _decode_batches(rows: list[dict], first: dict) -> list[str]:
    """test_decode_batches.py's rows: many sequences a decode step."""
    body = [f"| {r['model']} | {r['gguf_type']} | {r['decode_batch']} | "
            f"{r.get('setup', 'triton-fp16')} | {r['ours']['steps']} | "
            + " | ".join(f"{f['mean']} / {f['p90']} / {f['max']}"
                         for f in (r["ours"], r["peer"]))
            + f" | {'yes' if r['passed'] else 'NO'}"
            + (f" (judged after the run: {r['judged']})" if "judged" in r else "") + " |"
            for r in rows]
    return _section(
        "Decode batches (CUDA graphs)",
        ("Every prompt decodes the greedy text of transformers fp32 on the file's weights, "
         "all of them together each step: mean / p90 / max |d logprob| of those steps "
         "against transformers fp32; bars: 1.5x the peer's mean + 0.01, 1.5x its p90 "
         "+ 0.02."),
        "| model | GGUF | sequences a step | ours | steps | ours' figures | peer | pass |",
        "|---|---|---:|---|---:|---|---|---|", body, rows, first)


def _long_figure(f) -> str:
    if isinstance(f, dict):  # apart where the selection is active and where not
        return f"{f['active']:.4f} / {f['all_keys']:.4f}"
    return f"{f:.4f}"


def _long_context(rows: list[dict], first: dict) -> list[str]:
    """test_long_context.py's rows: index_topk 2048 at 8-12k tokens."""
    body = [f"| {r['model']} | {r['gguf_type']} | {r['long_context']} | {r['run']} | "
            f"{_long_figure(r['ours'])} | {_long_figure(r['peer'])} | "
            + (_long_figure(r["ggml"]) if "ggml" in r else "")
            + f" | {'yes' if r['passed'] else 'NO'} |" for r in rows]
    return _section(
        "Long context (index_topk 2048, prompts of 8,192 and 12,288 tokens)",
        ("vs fp32: scale-free error against transformers fp32 on the file's weights, "
         "positions that see more than 2048 keys / the others. Chunked prefill (1,536-token "
         "steps) and a cached prefix: the scale-free distance each moves a path from its own "
         "run in one step / without the cache. Bars: 1.5x the peer's (and ggml's kernels' "
         "for the Q4_K_M runs), at least 0.002."),
        "| model | GGUF | check | run | ours | peer | ggml's kernels | pass |",
        "|---|---|---|---|---|---|---|---|", body, rows, first)


# the key that marks another test's row: test_serve.py's, test_decode_batches.py's,
# test_long_context.py's (each its own table after the engine rows')
OTHER_TESTS = ("serve", "decode_batch", "long_context")


def engine_rows(rows: list[dict]) -> list[dict]:
    """test_engine.py's rows of a record."""
    return [r for r in rows if not any(key in r for key in OTHER_TESTS)]


def render(rows: list[dict]) -> str:
    serve, batches, long = ([r for r in rows if key in r] for key in OTHER_TESTS)
    rows = engine_rows(rows)
    first = (rows or serve or batches or long)[0]
    # records written before the figures were split by top-k selection
    split = any("topk_active" in r.get("vs_transformers", {}) for r in rows)
    lines = [
        "# End-to-end engine run (generated by tests/e2e/record.py)",
        "",
        (f"- date: {first.get('date')}; card: {first.get('card')} x {first.get('gpus')}; "
         f"driver {first.get('driver')}"),
        (f"- vLLM {first.get('vllm')} (the series' wheel); torch {first.get('torch')}; "
         f"triton {first.get('triton')}"),
        "- figures against each oracle: mean / p90 |d logprob| of the prompt's next "
        "tokens (nats), top-1 agreement, " + _greedy_note(rows),
        *([("- decode: mean / p90 |d logprob| of the generated tokens on the engine's "
            "own prefix")] if any("decode" in r.get("vs_transformers", {}) for r in rows)
          else []),
        *([("- forced decode: the same on one text every path decoded (the fp32 "
            "checkpoint's greedy continuation)")]
          if any("decode_forced" in r.get("vs_transformers", {}) for r in rows) else []),
        *([("- vs transformers: each position against transformers with its own fp32 "
            "index scores or vLLM's fp8 ones, whichever is closer")]
          if any(r.get("tf_index_scores") for r in rows) else []),
        *([("- vs transformers: also each selection with its MoE routers' near-ties "
            "(experts within 0.005) taken as the engine took them (router_ties_taken)")]
          if any("router_ties_taken" in r.get("vs_transformers", {}) for r in rows) else []),
        *([f"- judged after the run: {first['judged']}"] if "judged" in first else []),
        *([("- by selection (vs transformers fp32): mean |d logprob| / scale-free "
            "error (||d of the mean-centred log-probabilities|| / the oracle's, over the "
            "vocabulary) where the indexer's top-k selection is active (more keys than "
            "index_topk) and where every key is selected")] if split else []),
        ("- TP > 1: mean / p90 |d logprob| against the same file's triton-fp16 run at "
         "TP 1, share of equal greedy tokens"),
        "",
        "| model | GGUF | path | TP | backend, dtype, indexer | vs transformers fp32 | "
        + ("by selection | " if split else "")
        + "vs llama.cpp | MTP | vs TP 1 | start s | pass |",
        "|---|---|---|---:|---|---|---|---|---|---:|---|" + ("---|" if split else ""),
    ]
    if not rows:  # another test's rows alone: the run's header and their tables
        lines = lines[:4] + [x for x in lines if x.startswith("- judged after the run")]
    blank = "| | | | | |" + (" |" if split else "")
    for r in rows:
        case = f"| {r['model']} | {r['gguf_type']} | {r['path']} | {r.get('tp', 1)} |"
        if "skipped" in r:
            lines.append(f"{case} not run: {r['skipped']} {blank} skipped |")
            continue
        if "error" in r:
            lines.append(f"{case} {r['error']} {blank} NO |")
            continue
        mtp = ""
        if "acceptance" in r:
            mtp = (f"acceptance {r['acceptance']}, greedy = no-spec: "
                   f"{'yes' if r.get('greedy_equal_to_no_spec') else 'NO'}")
            if "mtp_drafts" in r:  # judging.mtp_draft_figures
                d = r["mtp_drafts"]
                mtp += (f"; drafts unlike fp32's: {d['disagree']} of "
                        f"{d['drafts'] - d['near_ties']}")
        if "unjudged" in r:  # its engine ran (E2E_JUDGE=later)
            cells = [r["unjudged"], *([""] if split else []), "", mtp, "", r.get("start_s")]
            lines.append(f"{case} {r['backend']}, {r['dtype']}, {r['indexer']} | "
                         + " ".join(f"{c} |" if c else "|" for c in cells) + " not judged |")
            continue
        lines.append(
            f"{case} {r['backend']}, {r['dtype']}, {r['indexer']} | "
            f"{_fig(r['vs_transformers'])} | "
            + (f"{_by_selection(r['vs_transformers'])} | " if split else "")
            + f"{_fig(r['vs_llama_cpp'])} | {mtp} | {_tp(r)} | "
            f"{r['start_s']} | {'yes' if r.get('passed') else 'NO'} |"
        )
    return "\n".join(lines + _serve(serve, first) + _decode_batches(batches, first)
                     + _long_context(long, first)) + "\n"


if __name__ == "__main__":
    rows = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line]
    Path(sys.argv[2]).write_text(render(rows))
