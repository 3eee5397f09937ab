"""Where a path departs from fp32, layer by layer, on one prompt of the
end-to-end tests (GPU):

    python tests/e2e/layer_probe.py MODEL GGUF_TYPE OUT_DIR [--prompt 0]

(with scripts/ and tests/e2e on PYTHONPATH; E2E_MODELS as for the tests).
Runs, each engine in its own process and all side by side, on the prompt
(and the other test prompt beside it, as the tests batch them):

- the series' fp16 path as the tests run it (CUDA graphs, torch.compile),
  the same eager, the same with decode batches of 12 and 72 (vLLM's GGUF
  linear layers take their matrix-matrix kernels above 6 tokens for K and
  legacy types, its GGUF MoE above 64, the vector kernels below);
- fp16 and bf16 without torch.compile or CUDA graphs, with hooks that keep,
  at every position of the prompt's continuation, each decoder layer's
  attention output, MLP output, residual stream and the indexer's top-k;
- then the fp16 continuation as a prompt (one prefill: every step's
  distribution without the decode path);
- transformers in fp32 (TF32 off) on the same weights and tokens, with the
  same hooks, and again with vLLM's fp8 index scores (oracles.fp8_index_scores).

OUT_DIR/probe.json holds, per path and per generated step, the scale-free
error of the whole distribution (against both of fp32's selections) and
|d logprob| of the token fp32 prefers;
for the hooked paths, per step and layer, the scale-free error of each
hooked output and the top-k overlap with fp32's selection.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent

# what the engine runs of each path: vllm.LLM keyword arguments and environment
BASE_LLM = {"max_model_len": 512, "kv_cache_memory_bytes": 1 << 30,
            "gpu_memory_utilization": 0.05, "max_num_seqs": 80,
            "attention_backend": "TRITON_MLA_SPARSE"}
NO_COMPILE = {"enforce_eager": True, "compilation_config": {"mode": 0}}
PATHS = {
    "fp16": ({"dtype": "float16"}, {}),
    "fp16-eager": ({"dtype": "float16", "enforce_eager": True}, {}),
    "fp16-batch12": ({"dtype": "float16"}, {"copies": 6}),
    "fp16-batch72": ({"dtype": "float16"}, {"copies": 36}),
    "fp16-hooked": ({"dtype": "float16", **NO_COMPILE}, {"hooks": True}),
    "bf16-hooked": ({"dtype": "bfloat16", **NO_COMPILE}, {"hooks": True}),
}


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Scale-free error: ||a x - ref|| / ||ref|| at the best a (fp16 runs
    carry the residual stream divided by routed_scaling_factor)."""
    x, ref = x.double().flatten(), ref.double().flatten()
    a = (x @ ref) / (x @ x).clamp_min(1e-300)
    return float((a * x - ref).norm() / ref.norm().clamp_min(1e-300))


class Hooks:
    """Forward hooks on a decoder stack; keeps what each layer computed at the
    positions in `keep` (absolute positions of the probed prompt)."""

    def __init__(self, layers, keep: range, engine: bool):
        self.keep, self.engine = keep, engine
        self.positions: torch.Tensor | None = None
        self.rows: dict[int, dict[str, torch.Tensor]] = {}
        for i, layer in enumerate(layers):
            layer.self_attn.register_forward_hook(self._hook(i, "attn"))
            layer.mlp.register_forward_hook(self._hook(i, "mlp"))
            layer.register_forward_hook(self._hook(i, "stream"))
            indexer = getattr(layer.self_attn, "indexer", None)
            if indexer is None:  # vLLM: on the MLA wrapper
                indexer = getattr(getattr(layer.self_attn, "mla_attn", None), "indexer", None)
            if indexer is not None:
                indexer.register_forward_hook(self._hook(i, "topk"))

    def _hook(self, layer: int, what: str):
        def hook(module, args, output):
            if self.engine:
                # a decoder layer returns (hidden, residual): the stream is their sum
                out = output[0] + output[1] if what == "stream" else output
            else:  # transformers' modules may return tuples, output first
                out = output[0] if isinstance(output, tuple) else output
            if self.engine:
                n = args[0].shape[0] if args else self.positions.numel()
                pos = self.positions[:n]
                out = out[:n]
            else:  # transformers: batch 1, positions 0..S-1
                out = out[0]
                pos = torch.arange(out.shape[0], device=out.device)
            for row in (pos >= self.keep.start).nonzero().flatten().tolist():
                p = int(pos[row])
                if p in self.keep:
                    key = f"{what}.{layer}"
                    self.rows.setdefault(p, {})[key] = out[row].detach().float().cpu()
        return hook


def engine_main(case_file: str, out_file: str) -> None:
    """One engine (its own process): greedy continuation and every
    position's distribution, plus the hooks' rows where asked."""
    case = json.loads(Path(case_file).read_text())
    from vllm import LLM, SamplingParams, TokensPrompt

    from run_engine import _dense

    llm = LLM(model=case["gguf"], hf_config_path=case["hf"], tokenizer=case["hf"],
              seed=0, max_logprobs=case["vocab"], **case["llm"])
    hooks = None
    if case.get("hooks"):
        def install(model):
            nonlocal hooks
            hooks = Hooks(model.model.layers, range(case["keep"][0], case["keep"][1]), True)

            # vLLM's compiled model class skips nn.Module hooks on its own
            # call: its decoder layers (positions first) say where rows are
            def positions(module, args, kwargs):
                hooks.positions = kwargs["positions"] if "positions" in kwargs else args[0]
            for layer in model.model.layers:
                layer.register_forward_pre_hook(positions, with_kwargs=True)
        llm.apply_model(install)
    vocab = case["vocab"]
    params = SamplingParams(temperature=0.0, max_tokens=case["max_tokens"], ignore_eos=True,
                            prompt_logprobs=vocab, logprobs=vocab)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in case["prompts"]], params)
    out = outs[0]
    torch.save({
        "generated": list(out.outputs[0].token_ids),
        "prompt": _dense(out.prompt_logprobs[1:], vocab),
        "decode": _dense(out.outputs[0].logprobs, vocab),
        "rows": hooks.rows if hooks else None,
    }, out_file)


def run_engine(work: Path, name: str, case: dict) -> dict:
    case_file, out_file = work / f"{name}.json", work / f"{name}.pt"
    case_file.write_text(json.dumps(case))
    env = dict(os.environ, VLLM_DSA_INDEXER_TRITON="1")
    if case.get("hooks"):
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # hooks in this process
    log = subprocess.run([sys.executable, __file__, "engine", str(case_file), str(out_file)],
                         env=env, capture_output=True, text=True, timeout=900)
    (work / f"{name}.log").write_text(log.stdout + log.stderr)
    if log.returncode:
        return {"error": (log.stdout + log.stderr)[-3000:]}
    return torch.load(out_file)


def main() -> None:
    if sys.argv[1:2] == ["engine"]:
        engine_main(*sys.argv[2:4])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("gguf_type")
    ap.add_argument("out", type=Path)
    ap.add_argument("--prompt", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--paths", default=",".join(PATHS),
                    help="comma-separated, of " + ", ".join(PATHS) + " (fp16 always runs)")
    args = ap.parse_args()

    import cases
    from judging import scale_free
    from models import VOCAB
    from oracles import fp8_index_scores, transformers_model

    manifest = json.loads((cases.models_dir() / "manifest.json").read_text())
    hf, gguf = cases.model_paths(manifest, args.model, args.gguf_type)
    prompts = cases.prompts()
    probed = prompts[args.prompt]
    others = [p for i, p in enumerate(prompts) if i != args.prompt]
    n = len(probed)
    keep = [n - 1, n - 1 + args.max_tokens]
    args.out.mkdir(parents=True, exist_ok=True)

    def case(name: str) -> dict:
        llm, extra = PATHS[name]
        copies = extra.get("copies", 1)
        return {"gguf": str(gguf), "hf": str(hf), "vocab": VOCAB, "keep": keep,
                "max_tokens": args.max_tokens, "hooks": extra.get("hooks", False),
                "prompts": [probed, *others] * copies, "llm": {**BASE_LLM, **llm}}

    paths = ["fp16", *(p for p in args.paths.split(",") if p != "fp16")]
    unknown = set(paths) - set(PATHS)
    if unknown:
        ap.error(f"--paths: unknown {sorted(unknown)}; known: {', '.join(PATHS)}")
    with ThreadPoolExecutor(len(paths)) as pool:
        runs = dict(zip(paths, pool.map(lambda p: run_engine(args.out, p, case(p)), paths)))
    tokens = runs["fp16"]["generated"]
    # the fp16 continuation as one prompt: every step by prefill
    prefill = {**case("fp16"), "prompts": [probed + tokens[:-1]], "max_tokens": 1}
    runs["fp16-prefill"] = run_engine(args.out, "fp16-prefill", prefill)

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = transformers_model(hf, gguf, "cuda")
    ids = torch.tensor([probed + tokens], device="cuda")

    def logprobs() -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
        return torch.log_softmax(logits, -1).cpu()[n - 1 : n - 1 + len(tokens)]

    with fp8_index_scores(model):
        ref_fp8 = logprobs()
    # the hooks keep fp32's own selection's rows (hooked after the fp8 pass)
    ref_hooks = Hooks(model.model.layers, range(*keep), False)
    ref = logprobs()

    report = {"model": args.model, "gguf_type": args.gguf_type, "prompt": args.prompt,
              "fp32_tokens": ref.argmax(-1).tolist(), "fp16_tokens": tokens, "paths": {}}
    for name, run in runs.items():
        if "error" in run:
            report["paths"][name] = {"error": run["error"]}
            continue
        if name == "fp16-prefill":
            steps = torch.cat([run["prompt"][n - 1:], run["decode"]])
            gen = tokens
        else:
            steps, gen = run["decode"], run["generated"]
        shared = next((i for i, (a, b) in enumerate(zip(gen, tokens)) if a != b), len(gen))
        steps = steps[: min(shared + 1, len(ref))]
        best = ref[: len(steps)].argmax(-1)
        entry = {
            "generated": gen,
            "parts_from_fp16_at": shared if shared < len(gen) else None,
            "scale_free": [round(float(x), 4) for x in scale_free(steps, ref[: len(steps)])],
            # against fp32 with vLLM's fp8 index scores (the judge's second selection)
            "scale_free_fp8_selection": [
                round(float(x), 4) for x in scale_free(steps, ref_fp8[: len(steps)])],
            # |d logprob| of the token fp32 prefers, and of the token this path took
            "d_fp32_top1": [round(float(abs(steps[i, t] - ref[i, t])), 4)
                            for i, t in enumerate(best.tolist())],
            "d_own": [round(float(abs(steps[i, t] - ref[i, t])), 4)
                      for i, t in enumerate(gen[: len(steps)])],
        }
        if run.get("rows"):
            layers = {}
            for step in range(min(len(steps), shared + 1)):
                pos = n - 1 + step
                ours, theirs = run["rows"].get(pos, {}), ref_hooks.rows.get(pos, {})
                row = {}
                for key in sorted(theirs):
                    if key not in ours:
                        continue
                    if key.startswith("topk"):
                        k = theirs[key].numel()
                        a = set(ours[key][:k].long().tolist()) - {-1}
                        b = set(theirs[key].long().tolist())
                        row[key] = round(len(a & b) / max(1, len(b)), 3)
                    else:
                        row[key] = round(_rel(ours[key], theirs[key]), 5)
                layers[step] = row
            entry["layers"] = layers
        report["paths"][name] = entry
    (args.out / "probe.json").write_text(json.dumps(report, indent=1))
    for name, entry in report["paths"].items():
        if "error" in entry:
            print(f"{name}: ERROR {entry['error'][-400:]}")
            continue
        worst = max(range(len(entry["d_own"])), key=lambda i: entry["d_own"][i])
        print(f"{name:14s} parts at {entry['parts_from_fp16_at']}, worst step {worst}: "
              f"d_own {entry['d_own'][worst]} d_fp32_top1 {entry['d_fp32_top1'][worst]} "
              f"scale-free {entry['scale_free'][worst]}")


if __name__ == "__main__":
    main()
