"""The engine benchmark (bench/engine/, `make bench-engine`) on CPU: what
can be checked without a GPU.

- The vocabulary: HF tokenizers and the GGUF carry the same tokens; word
  tokens decode and encode back exactly (the same prompt is the same token
  count on vLLM and llama-server).
- The checkpoints' geometry is the real models' (per TP rank), GLM-5.2's
  IndexShare schedule is the published one.
- The random router, balanced by its correction bias, spreads held-out
  tokens over all experts (grouped top-k too); a collapsed one is caught.
- The checkpoint's tensor names and shapes are what transformers loads.
- llama.cpp's converter and quantizer accept a tiny checkpoint: metadata,
  tensor shapes and the mixture's per-tensor types as specified (needs the
  llama_cpp package; skipped without it).
- The workload matrix, the --quick subset, every command line (exact
  arguments; `vllm bench serve`'s parsed by vLLM's own parser).
- Parsing: `vllm bench serve` results, vLLM's KV-cache log lines,
  llama-server's and llama-bench's output (captured samples).
- The JSONL record and engine.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchdata import BenchData, read
from engine import parse, record, vocab
from engine import spec as specs
from engine import workloads as wl

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"

FAKE_ENV = {
    "date_utc": "2026-12-02 10:00", "card": "NVIDIA H200", "sms": 132, "capability": "9.0",
    "driver": "580.1", "torch": "2.11.0", "triton": "3.6.0",
    "series": "0.23.0+dsa.sm120.abcdef12", "commit": "0123456789ab",
    "command": "bench/bench_engine.py run --quick", "quick": True,
}


# ---------------------------------------------------------------------------
# Vocabulary
# ---------------------------------------------------------------------------


def test_vocabulary_has_the_real_size_and_eos_last():
    tokens, merges = vocab.build(154880)
    assert len(tokens) == 154880 and len(set(tokens)) == 154880
    assert tokens[-1] == vocab.EOS
    assert tokens[:256] == tuple(vocab.byte_alphabet())
    # every word token is made by exactly one merge from its prefix
    assert len(merges) == 154880 - 256 - 1
    assert tokens[256] == "Ġa" and merges[0] == "Ġ a"


def test_hf_tokenizer_round_trips_word_tokens():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(json.dumps(vocab.tokenizer_json(2048)))
    assert tok.get_vocab_size() == 2048
    ids = list(range(300, 2047, 7))
    text = tok.decode(ids)
    assert tok.encode(text).ids == ids
    assert tok.token_to_id(vocab.EOS) == 2047


def test_gguf_vocabulary_is_the_tokenizers():
    g = vocab.gguf_vocab(2048)
    tj = vocab.tokenizer_json(2048)
    assert g["tokens"] == sorted(tj["model"]["vocab"], key=tj["model"]["vocab"].get)
    assert g["merges"] == tj["model"]["merges"]
    assert g["types"][-1] == 3 and set(g["types"][:-1]) == {1} and g["eos"] == 2047


# ---------------------------------------------------------------------------
# Geometry
# ---------------------------------------------------------------------------


def test_glm5_tp8_is_one_rank_of_the_real_model():
    s = specs.SPECS["glm5-tp8"]
    assert (s.hidden, s.heads, s.q_lora, s.kv_lora) == (6144, 8, 2048, 512)
    assert (s.qk_nope, s.qk_rope, s.v_head) == (192, 64, 256)
    assert (s.experts, s.experts_used, s.shared_experts) == (256, 8, 1)
    assert (s.moe_intermediate, s.intermediate) == (2048 // 8, 12288 // 8)
    assert (s.index_heads, s.index_dim, s.index_topk, s.vocab) == (32, 128, 2048, 154880)
    assert (s.dense_layers, s.moe_layers) == (3, 3)
    cfg = specs.hf_config(s)
    assert cfg["scoring_func"] == "sigmoid" and cfg["indexer_rope_interleave"] is True
    assert cfg["topk_method"] == "noaux_tc" and cfg["first_k_dense_replace"] == 3
    tp4 = specs.SPECS["glm5-tp4"]
    assert (tp4.heads, tp4.moe_intermediate) == (16, 512)
    full = specs.SPECS["glm5-full"]
    assert (full.heads, full.moe_intermediate, full.intermediate) == (64, 2048, 12288)
    d = specs.SPECS["dsv32-tp8"]
    assert (d.hidden, d.heads, d.qk_nope, d.v_head, d.index_heads) == (7168, 16, 128, 128, 64)
    assert (d.q_lora, d.n_group, d.topk_group, d.vocab) == (1536, 8, 4, 129280)


def test_glm52_schedule_is_the_published_one():
    s = specs.SPECS["glm52-tp8"]
    full78 = s.with_(moe_layers=75).indexer_types()
    assert len(full78) == 78 and full78.count("full") == 21
    assert [i for i, t in enumerate(full78) if t == "full"][:5] == [0, 1, 2, 6, 10]
    assert s.indexer_types() == ["full", "full", "full", "shared", "shared", "shared"]
    names = {t.name for t in specs.hf_tensors(s)}
    assert "model.layers.2.self_attn.indexer.wk.weight" in names
    assert "model.layers.3.self_attn.indexer.wk.weight" not in names
    assert "blk.3.indexer.attn_k.weight" not in specs.gguf_shapes(s)


def test_parameter_counts():
    # glm5-tp8: 3 MoE layers of 256 experts x 3 x 6144 x 256, plus the two
    # vocabulary tables (2 x 154,880 x 6144), plus attention and dense MLPs
    n = specs.parameter_count(specs.SPECS["glm5-tp8"])
    experts = 3 * 256 * 3 * 6144 * 256
    tables = 2 * 154880 * 6144
    assert experts + tables < n < experts + tables + 0.5e9


# ---------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["glm5-tp8", "dsv32-tp8"])
def test_random_router_spreads_tokens_over_all_experts(name):
    torch = pytest.importorskip("torch")  # noqa: F841
    from engine import weights

    s = specs.tiny(specs.SPECS[name])
    stats = weights.routing_check(s, tokens=4096)
    assert set(stats) == {str(i) for i in range(s.dense_layers, s.layers)}
    for layer, st in stats.items():
        assert st["problems"] == [], (layer, st)
        assert st["experts_used"] == 256 and st["max_over_mean"] < 1.6


def test_a_collapsed_router_is_caught():
    torch = pytest.importorskip("torch")
    from engine import weights

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4096, 64, generator=g)
    w = torch.randn(256, 64, generator=g) / 8
    bias = torch.zeros(256)
    bias[:16] = 1.0  # 16 experts win every token
    stats = weights.load_stats(weights.route(hidden, w, bias, 8), 256)
    problems = weights.balanced(stats)
    assert any("never chosen" in p for p in problems) and stats["max_over_mean"] > 10
    # the same router without that bias passes
    ok = weights.load_stats(weights.route(hidden, w, torch.zeros(256), 8), 256)
    assert ok["experts_used"] == 256


def test_grouped_routing_keeps_to_the_best_groups():
    torch = pytest.importorskip("torch")
    from engine import weights

    hidden = torch.zeros(1, 4)
    w = torch.zeros(16, 4)
    bias = torch.arange(16.0) / 100  # group 3 (experts 12-15) best, then group 2
    ids = weights.route(hidden, w, bias, top_k=4, n_group=4, topk_group=2)
    assert set(ids[0].tolist()) == {15, 14, 13, 12}
    ids = weights.route(hidden, w, -bias, top_k=6, n_group=4, topk_group=2)
    assert set(ids[0].tolist()) <= set(range(8))


def test_tensors_regenerate_by_rows():
    torch = pytest.importorskip("torch")
    from engine import weights

    s = specs.tiny(specs.SPECS["glm5-tp8"])
    emb = next(t for t in specs.hf_tensors(s) if t.name == "model.embed_tokens.weight")
    whole = weights.make(s, emb, torch.float32)
    assert whole.shape == (s.vocab, s.hidden)
    assert torch.equal(weights.make(s, emb, torch.float32, slice(5000, 5003)), whole[5000:5003])
    assert 0.9 < whole.std().item() < 1.1


# ---------------------------------------------------------------------------
# The checkpoint as transformers and llama.cpp read it
# ---------------------------------------------------------------------------


def micro(name: str) -> specs.Spec:
    """Smaller than tiny (16 experts): a file the converter writes in seconds."""
    return specs.tiny(specs.SPECS[name], experts=16, experts_used=4, vocab=2048,
                      n_group=min(specs.SPECS[name].n_group, 4),
                      topk_group=min(specs.SPECS[name].topk_group, 2))


@pytest.mark.parametrize("name", ["glm5-tp8", "glm52-tp8", "dsv32-tp8"])
def test_transformers_loads_the_checkpoint_exactly(tmp_path, name):
    """Our tensor list is the original checkpoint format: transformers
    builds the model from config.json and finds every tensor, no more."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from engine import build, weights

    s = micro(name)
    build.write_hf(s, tmp_path)
    save_file({t.name: weights.make(s, t) for t in specs.hf_tensors(s)},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    # In a process of its own, as a user of the checkpoint has it: vLLM,
    # once other tests imported it, registers its own config classes with
    # transformers for the whole process (deepseek_v32 -> DeepseekV3Config).
    check = f"""
import json, torch, transformers
arch = json.loads(open("{tmp_path}/config.json").read())["architectures"][0]
model, info = getattr(transformers, arch).from_pretrained(
    "{tmp_path}", output_loading_info=True, dtype=torch.float32)
assert not info["missing_keys"] and not info["unexpected_keys"], info
assert torch.isfinite(model(torch.arange(8, 40)[None]).logits).all()
tok = transformers.AutoTokenizer.from_pretrained("{tmp_path}")
assert tok.eos_token_id == {s.vocab - 1} and tok.num_special_tokens_to_add() == 0
ids = list(range(400, 460))
assert tok(tok.decode(ids), add_special_tokens=False).input_ids == ids
"""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]


def _llama_cpp_or_skip():
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError) as e:
        pytest.skip(f"llama_cpp (llama-cpp-python, tests/requirements-gpu.txt) not importable: {e}")


def test_a_quantized_file_without_the_quantizer_fails_before_building(tmp_path,
                                                                      monkeypatch):
    """Without llama-cpp-python the builder says so and names the types
    before it writes anything (the F16 file takes minutes at full width)."""
    import importlib.util

    from engine import build

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(SystemExit, match=r"q4_k_m, mix-iq2_xxs need llama.cpp's quantizer"):
        build.build(micro("glm5-tp8"), ["f16", "q4_k_m", "mix-iq2_xxs"], tmp_path, nthread=1)
    assert not any(tmp_path.rglob("*.gguf")) and not any(tmp_path.rglob("config.json"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """micro GLM-5 TP-8: F16 (converter), Q4_K_M and the IQ2_XXS mixture
    (quantizer)."""
    _llama_cpp_or_skip()
    from engine import build

    out = tmp_path_factory.mktemp("models")
    s = micro("glm5-tp8")
    info = build.build(s, ["f16", "q4_k_m", "mix-iq2_xxs"], out, nthread=2, routing_tokens=1024)
    return s, out, info


def test_converter_writes_the_specified_file(built):
    from gguf import GGUFReader

    s, out, info = built
    path = out / s.name / info["files"]["f16"]["file"]
    r = GGUFReader(path)
    md = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.tok")
          and k not in ("tokenizer.ggml.merges",)}
    for key, value in specs.gguf_metadata(s).items():
        assert md.get(key) == value, (key, md.get(key), value)
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
    assert shapes == specs.gguf_shapes(s)
    assert {t.tensor_type.name for t in r.tensors} == {"F16", "F32"}
    toks = r.fields["tokenizer.ggml.tokens"]
    assert len(toks.data) == s.vocab


def test_quantizer_applies_the_mixture(built):
    s, out, info = built
    q4 = info["files"]["q4_k_m"]
    assert "Q4_K" in q4["types"] and q4["bytes"] < info["files"]["f16"]["bytes"] / 2
    mix = info["files"]["mix-iq2_xxs"]
    gtype = specs.TYPES["mix-iq2_xxs"]
    checked = 0
    for name, t in mix["tensors"].items():
        want = specs.expected_type(gtype, name)
        if want and len(t["shape"]) >= 2 and "gate_inp" not in name:
            assert t["type"] == want, (name, t["type"], want)
            checked += 1
    assert checked >= 6
    assert mix["tensors"]["blk.1.ffn_gate_exps.weight"]["type"] == "IQ2_XXS"
    assert mix["tensors"]["blk.1.ffn_down_shexp.weight"]["type"] == "Q6_K"
    assert mix["tensors"]["blk.0.attn_q_a.weight"]["type"] == "Q8_0"
    # the builder keeps what it built, the F16 input since f16 was asked for
    assert (out / s.name / "hf" / "config.json").is_file()
    assert not info["routing"]["1"]["problems"]


def test_iq_types_need_the_importance_matrix(built, tmp_path):
    from engine import build

    s, out, info = built
    src = out / s.name / info["files"]["f16"]["file"]
    gtype = specs.TYPES["mix-iq2_xxs"]
    entries = dict(build.imatrix_entries(src, gtype))
    assert entries["blk.1.ffn_gate_exps.weight"] == s.hidden * s.experts
    assert entries["blk.1.ffn_down_exps.weight"] == s.moe_intermediate * s.experts
    assert not any("shexp" in n or "attn" in n for n in entries)


# ---------------------------------------------------------------------------
# Workloads and command lines
# ---------------------------------------------------------------------------


def test_workload_matrix():
    w = wl.WORKLOADS
    single = ("single-4k", "single-32k", "single-128k")
    assert [w[n].input_len for n in single] == [4096, 32768, 131072]
    assert all(w[n].concurrency == 1 for n in ("single-4k", "prefill-64k"))
    for n, c in (("concurrent-8", 8), ("concurrent-32", 32), ("concurrent-64", 64),
                 ("concurrent-128", 128), ("concurrent-256", 256)):
        assert (w[n].input_len, w[n].output_len, w[n].concurrency) == (2048, 512, c)
    # a workload added later goes last: the earlier ones' prompts stay
    assert wl.prompt_seed(w["prefill-64k"]) == 1016
    assert wl.prompt_seed(w["concurrent-128"]) == 1018
    prefill = ("prefill-4k", "prefill-16k", "prefill-64k")
    assert [w[n].input_len for n in prefill] == [4096, 16384, 65536]
    assert all(w[n].output_len == 1 for n in prefill)
    full = wl.plan(False)
    assert full["paths"] == ["triton-fp16", "triton-fp16-nomarlin", "triton-fp16-ggml",
                             "triton-fp16-fused", "auto-sm120", "flashmla-bf16", "llama.cpp"]
    # one variable at a time: the GGUF kernel choice is all that tells these apart
    ours = wl.PATHS["triton-fp16"]
    for name, choice in (("triton-fp16-nomarlin", "ggml"), ("triton-fp16-ggml", "upstream"),
                         ("triton-fp16-fused", "fused")):
        assert wl.PATHS[name].args == ours.args
        assert dict(ours.env, VLLM_GGUF_KERNELS=choice) == wl.PATHS[name].env
    no_marlin = wl.PATHS["triton-fp16-no-marlin-linears"]
    assert no_marlin.args == ours.args and "triton-fp16-no-marlin-linears" not in full["paths"]
    assert dict(ours.env, VLLM_GGUF_MARLIN_LINEARS="0") == no_marlin.env
    auto, auto_no_marlin = wl.PATHS["auto-sm120"], wl.PATHS["auto-sm120-no-marlin-linears"]
    assert (auto_no_marlin.args, auto_no_marlin.report_sm) == (auto.args, auto.report_sm)
    assert dict(auto.env, VLLM_GGUF_MARLIN_LINEARS="0") == auto_no_marlin.env
    assert "auto-sm120-no-marlin-linears" not in full["paths"]
    lm_head = wl.PATHS["triton-fp16-lm-head-gguf"]
    assert lm_head.args == ours.args and "triton-fp16-lm-head-gguf" not in full["paths"]
    assert dict(ours.env, VLLM_GGUF_LM_HEAD_FLOAT="0") == lm_head.env
    assert wl.max_model_len(full["workloads"]) == 132096


def test_quick_plan_is_the_subset():
    q = wl.plan(True)
    assert q["files"] == [("glm5-tp8", "q4_k_m")]
    assert q["paths"] == ["triton-fp16", "flashmla-bf16", "llama.cpp"]
    assert [w.name for w in q["workloads"]] == ["single-4k", "concurrent-32", "prefill-16k"]
    assert wl.max_model_len(q["workloads"]) == 17408
    with pytest.raises(ValueError, match="unknown path"):
        wl.plan(True, paths=["sglang"])


def test_a_path_may_run_a_subset_of_the_workloads():
    """``<path>:<w>+<w>``: that path measures only those, the others all;
    the max model length stays the run's (one variable at a time)."""
    q = wl.plan(True, paths=["triton-fp16", "flashmla-bf16:prefill-16k+single-4k"])
    assert q["paths"] == ["triton-fp16", "flashmla-bf16"]
    assert q["only"] == {"flashmla-bf16": ["prefill-16k", "single-4k"]}
    assert [w.name for w in wl.path_workloads(q, "triton-fp16")] == [
        "single-4k", "concurrent-32", "prefill-16k"]
    # in the run's order, whatever the order asked
    assert [w.name for w in wl.path_workloads(q, "flashmla-bf16")] == [
        "single-4k", "prefill-16k"]
    assert wl.max_model_len(q["workloads"]) == 17408
    with pytest.raises(ValueError, match="path flashmla-bf16: workload 'single-32k' is not "
                                         "one of the run's"):
        wl.plan(True, paths=["flashmla-bf16:single-32k"])
    with pytest.raises(ValueError, match="unknown path 'sglang'"):
        wl.plan(True, paths=["sglang:single-4k"])


GG, HF = Path("/m/glm5-tp8-q4_k_m.gguf"), Path("/m/hf")


def test_vllm_command_lines():
    common_tail = ["--max-model-len", "17408", "--host", "127.0.0.1", "--port", "8123",
                   "--seed", "0"]
    head = ["py", "-m", "vllm.entrypoints.cli.main", "serve", str(GG), "--hf-config-path",
            str(HF), "--tokenizer", str(HF), "--served-model-name", "bench"]
    ours = wl.PATHS["triton-fp16"]
    assert wl.vllm_serve(ours, GG, HF, 8123, 17408, "py") == [
        *head, "--attention-backend", "TRITON_MLA_SPARSE", "--dtype", "float16", *common_tail]
    assert ours.env == {"VLLM_DSA_INDEXER_TRITON": "1"}
    up = wl.PATHS["flashmla-bf16"]
    assert wl.vllm_serve(up, GG, HF, 8123, 17408, "py") == [
        *head, "--attention-backend", "FLASHMLA_SPARSE", "--dtype", "bfloat16", *common_tail]
    # upstream's path as vLLM 0.23 runs it, GGUF kernels included
    assert up.env == {"VLLM_GGUF_KERNELS": "upstream"}
    auto = wl.PATHS["auto-sm120"]
    assert wl.vllm_serve(auto, GG, HF, 8123, 17408, "py") == [*head, "--dtype", "float16",
                                                             *common_tail]
    env = wl.vllm_env(auto, {"PYTHONPATH": "x"}, Path("/r/tests/e2e/report_sm"))
    assert env == {"PYTHONPATH": "/r/tests/e2e/report_sm:x", "E2E_REPORT_SM": "12.0",
                   "VLLM_USE_FLASHINFER_MOE_FP16": "0"}
    assert (REPO / "tests" / "e2e" / "report_sm" / "sitecustomize.py").is_file()


def test_bench_serve_command_line():
    w = wl.WORKLOADS["concurrent-32"]
    cmd = wl.bench_serve(w, 8123, HF, Path("/res"), "x.json", python="py")
    assert cmd == [
        "py", "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
        "--base-url", "http://127.0.0.1:8123", "--endpoint", "/v1/completions",
        "--model", "bench", "--tokenizer", "/m/hf", "--dataset-name", "random",
        "--random-input-len", "2048", "--random-output-len", "512", "--random-range-ratio", "0",
        "--num-prompts", "64", "--max-concurrency", "32", "--request-rate", "inf",
        "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99", "--seed", "1008", "--num-warmups", "0",
        "--disable-tqdm", "--save-result", "--result-dir", "/res", "--result-filename", "x.json"]
    warm = wl.bench_serve(w, 8123, HF, Path("/res"), "w.json", warmup=True, python="py")
    assert warm[warm.index("--num-prompts") + 1] == "32"
    assert warm[warm.index("--random-output-len") + 1] == "16"


def _prompt_starts(seed: int, w: wl.Workload, prompts: int, vocab: int) -> set[int]:
    """Where the random dataset starts each prompt (vLLM's own sampling of
    lengths and offsets; generate_token_sequence starts prompt i at
    offset_i + i): equal starts are equal prompts up to the shorter one's
    length, which a server's prefix cache serves."""
    import numpy as np
    from vllm.benchmarks.datasets.utils import get_sampling_params

    class Tokenizer:
        vocab_size = vocab

        def num_special_tokens_to_add(self):
            return 0

    _, _, offsets = get_sampling_params(np.random.default_rng(seed), prompts, 0.0,
                                        w.input_len, w.output_len, Tokenizer())
    return {(int(o) + i) % vocab for i, o in enumerate(offsets)}


def test_no_workload_repeats_another_ones_prompts():
    """A server runs a run's workloads one after the other with prefix
    caching on. Under one seed every workload's prompt i started at the same
    token: a 16k prefill after a 32k single stream was served from the cache
    (12-06f). Each invocation now has its own prompts: over the whole
    matrix, warm-ups included, at most a stray start in common (GLM-5's
    vocabulary; the record's cache-hit column shows any)."""
    pytest.importorskip("vllm")
    invocations = [(w, warm) for w in wl.WORKLOADS.values() for warm in (True, False)]
    seeds = [wl.prompt_seed(w, warm) for w, warm in invocations]
    assert len(set(seeds)) == len(seeds)
    seen: dict[int, int] = {}
    for w, warm in invocations:
        n = w.warmup_prompts if warm else w.num_prompts
        for start in _prompt_starts(wl.prompt_seed(w, warm), w, n, 154_880):
            seen[start] = seen.get(start, 0) + 1
    assert sum(seen.values()) == sum(w.num_prompts + w.warmup_prompts
                                     for w in wl.WORKLOADS.values())
    assert sum(c - 1 for c in seen.values()) <= 2
    # what one seed for all did: every workload's first prompts start alike
    firsts = [min(_prompt_starts(0, w, 1, 154_880)) for w in wl.WORKLOADS.values()]
    assert len(set(firsts)) == 1


def test_bench_serve_arguments_parse_with_vllms_parser():
    pytest.importorskip("vllm")
    import argparse

    from vllm.benchmarks.serve import add_cli_args

    ap = argparse.ArgumentParser()
    add_cli_args(ap)
    for w in wl.WORKLOADS.values():
        args = ap.parse_args(wl.bench_serve(w, 8123, HF, Path("/res"), "x.json")[5:])
        assert args.dataset_name == "random" and args.random_input_len == w.input_len
        assert args.max_concurrency == w.concurrency and args.temperature == 0.0
        assert args.metric_percentiles == "50,90,99" and args.ignore_eos


def test_llama_cpp_command_lines():
    q = wl.plan(True)["workloads"]
    groups = wl.llama_server_groups(q)
    assert [[w.name for w in g] for g in groups] == [["single-4k", "prefill-16k"],
                                                     ["concurrent-32"]]
    assert wl.llama_server_slots(groups[0]) == (1, 16640)
    assert wl.llama_server_slots(groups[1]) == (32, 32 * 2560)
    assert wl.llama_server(Path("/b/llama-server"), GG, 8123, 32, 81920) == [
        "/b/llama-server", "-m", str(GG), "--alias", "bench", "--host", "127.0.0.1",
        "--port", "8123", "-ngl", "999", "-fa", "on", "-c", "81920", "-np", "32", "--seed", "0"]
    assert wl.llama_bench(Path("/b/llama-bench"), GG, q) == [
        ["/b/llama-bench", "-m", str(GG), "-ngl", "999", "-fa", "1", "-o", "json",
         "-p", "16384", "-n", "0", "-ub", "512,2048", "-r", "2"],
        ["/b/llama-bench", "-m", str(GG), "-ngl", "999", "-fa", "1", "-o", "json",
         "-p", "0", "-n", "128", "-d", "4096", "-r", "2"]]


def test_llama_cpp_build_command():
    from engine import llamacpp

    args = llamacpp.configure_args(Path("/s"), Path("/b"), "/cuda/bin/nvcc", "Ninja")
    assert "-DGGML_CUDA=ON" in args and "-DCMAKE_CUDA_ARCHITECTURES=native" in args
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in args  # nothing downloaded at build time
    assert "-DLLAMA_BUILD_SERVER=ON" in args and "-DLLAMA_BUILD_TOOLS=ON" in args
    assert args[-2:] == ["-G", "Ninja"]


# ---------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------

BENCH_RESULT = {
    "date": "20261202-100000", "backend": "openai", "model_id": "bench", "num_prompts": 64,
    "duration": 20.5, "completed": 64, "failed": 0, "total_input_tokens": 131072,
    "total_output_tokens": 32768, "request_throughput": 3.12, "output_throughput": 1598.4,
    "total_token_throughput": 7992.2, "max_output_tokens_per_s": 1800.0,
    "mean_ttft_ms": 310.0, "median_ttft_ms": 290.0, "std_ttft_ms": 40.0,
    "p50_ttft_ms": 290.0, "p90_ttft_ms": 380.0, "p99_ttft_ms": 420.5,
    "mean_tpot_ms": 19.5, "median_tpot_ms": 19.2, "p50_tpot_ms": 19.2, "p90_tpot_ms": 20.1,
    "p99_tpot_ms": 21.0, "mean_itl_ms": 19.4, "median_itl_ms": 18.9, "p50_itl_ms": 18.9,
    "p90_itl_ms": 22.0, "p99_itl_ms": 35.25, "mean_e2el_ms": 10100.0, "p50_e2el_ms": 10050.0,
    "p90_e2el_ms": 10300.0, "p99_e2el_ms": 10500.0,
}


def test_parse_bench_serve_result():
    f = parse.bench_serve(BENCH_RESULT, wl.WORKLOADS["concurrent-32"])
    assert f["output_tok_s"] == 1598.4 and f["total_tok_s"] == 7992.2
    assert (f["ttft_p50_ms"], f["ttft_p99_ms"]) == (290.0, 420.5)
    assert (f["itl_p50_ms"], f["itl_p99_ms"]) == (18.9, 35.25)
    assert f["mean_input_tokens"] == 2048 and f["mean_output_tokens"] == 512
    assert f["decode_tok_s_per_stream"] == pytest.approx(1000 / 19.2)
    assert "prefill_tok_s" not in f
    p = parse.bench_serve(dict(BENCH_RESULT, total_input_tokens=3 * 16384, completed=3,
                               total_output_tokens=3, p50_ttft_ms=2000.0),
                          wl.WORKLOADS["prefill-16k"])
    assert p["prefill_tok_s"] == pytest.approx(8192.0)


METRICS = """# HELP vllm:prefix_cache_queries_total Prefix cache queries, in queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="bench"} 135168.0
vllm:prefix_cache_queries_total{engine="1",model_name="bench"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="bench"} 1.7e+09
vllm:prefix_cache_hits_total{engine="0",model_name="bench"} 4096.0
vllm:prefix_cache_hits_total{engine="1",model_name="bench"} 24.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="bench"} 999.0
"""


def test_parse_prefix_cache_counters():
    assert parse.prefix_cache(METRICS) == {"queries": 136168.0, "hits": 4120.0}
    assert parse.prefix_cache("# llama-server\nllamacpp:prompt_tokens_total 10\n") is None


def test_each_workload_is_saved_as_it_ends(tmp_path, monkeypatch):
    """A run cut short after a workload (device time, a lost machine) keeps
    that workload's figures, not only those of servers that ended."""
    import argparse

    from engine import run

    real = subprocess.run

    def fake_bench_serve(cmd, **kw):
        if "--result-dir" not in cmd:  # git, nvidia-smi, series.py
            return real(cmd, **kw)
        out = Path(cmd[cmd.index("--result-dir") + 1]) / cmd[cmd.index("--result-filename") + 1]
        out.write_text(json.dumps(BENCH_RESULT))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(run.subprocess, "run", fake_bench_serve)
    # the server's counters: read before the measured invocation and after
    counters = iter([{"queries": 1000.0, "hits": 10.0}, {"queries": 132072.0, "hits": 2058.0},
                     None, None])
    monkeypatch.setattr(run, "prefix_cache", lambda port: next(counters))
    args = argparse.Namespace(work=str(tmp_path / "work"), results=str(tmp_path / "results"),
                              quick=True, budget_s=float("inf"))
    plan = wl.plan(True, None, ["triton-fp16"], ["concurrent-32"])
    runner = run.Runner(args, plan)
    for path in ("triton-fp16", "llama.cpp"):
        runner.bench(wl.WORKLOADS["concurrent-32"], 8000, tmp_path / "hf",
                     {"checkpoint": "glm5-tp8", "type": "q4_k_m", "path": path}, "tag")
        _, rows = read(runner.folder / "engine.jsonl")
        assert [r["inputs"]["workload"] for r in rows if r["table"] == "serve"] == \
            ["concurrent-32"] * len(rows)
    assert [r["figures"]["output_tok_s"] for r in rows] == [1598.4, 1598.4]
    assert (rows[0]["figures"]["prefix_cache_query_tokens"],
            rows[0]["figures"]["prefix_cache_hit_tokens"]) == (131072.0, 2048.0)
    assert "prefix_cache_hit_tokens" not in rows[1]["figures"]  # no counters: not measured
    md = (runner.folder / "engine.md").read_text()
    assert "| 0 |" in md and "| 1.6 | 0 |" in md
    assert "**Prefix-cache hits** in glm5-tp8 q4_k_m triton-fp16 concurrent-32:" in md
    assert "every workload and warm-up its own prompts" in md and "≤" not in md
    assert "llama.cpp concurrent-32:" not in md


def test_a_server_the_budget_cannot_wait_for_is_not_started(tmp_path):
    """Less budget left than this run's longest start of that server: the
    path is left out with a note that says so (a slow vLLM start does not
    keep llama-server, which starts in seconds, from starting); a start cut
    by the budget says the budget was the limit."""
    import argparse

    from engine import run

    args = argparse.Namespace(work=str(tmp_path / "work"), results=str(tmp_path / "results"),
                              quick=True, budget_s=700.0)
    runner = run.Runner(args, wl.plan(True, None, ["triton-fp16"], ["concurrent-32"]))
    assert not runner.skip("glm5-tp8 q4_k_m triton-fp16", runner.longest_start["vllm"])
    runner.t_start -= 600  # 100 s left
    for kind, took in (("vllm", 150.0), ("llama.cpp", 2.0)):
        # a server that answered after `took` seconds
        ready = SimpleNamespace(wait_ready=lambda timeout, limit, took=took: took)
        assert runner.started(ready, kind) == took
    assert runner.longest_start == {"vllm": 150.0, "llama.cpp": 2.0}
    assert runner.skip("glm5-tp8 q4_k_m triton-fp16-nomarlin", runner.longest_start["vllm"])
    assert runner.data.notes[-1] == (
        "Not run (--budget-s 700: 100 s left, a server start took 150 s in this run): "
        "glm5-tp8 q4_k_m triton-fp16-nomarlin.")
    assert not runner.skip("glm5-tp8 q4_k_m llama.cpp ['concurrent-32']",
                           runner.longest_start["llama.cpp"])
    timeout, limit = runner.start_limit()
    assert 99 <= timeout <= 100
    assert limit == "what --budget-s 700 left"
    # a server that never answers, waited for one second
    server = run.Server([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ),
                        tmp_path / "server.log", "http://127.0.0.1:9/health")
    try:
        with pytest.raises(RuntimeError, match=r"not ready in 1 s \(what --budget-s 700 left\)"):
            server.wait_ready(1, limit)
    finally:
        server.stop()
    assert server.proc.poll() is not None
    # where it waited, in its log: faulthandler's stack of the process
    log = (tmp_path / "server.log").read_text()
    assert "Fatal Python error: Aborted" in log and 'File "<string>", line 1' in log, log


VLLM_LOG = """\
INFO 12-02 10:00:01 [api_server.py:1000] vLLM API server version 0.23.0+dsa.sm120.abcdef12
(EngineCore_DP0 pid=4242) INFO 12-02 10:00:20 [cuda.py:320] Using AttentionBackendEnum.TRITON_MLA_SPARSE backend.
(EngineCore_DP0 pid=4242) INFO 12-02 10:00:21 [sparse_attn_indexer.py:88] DSA indexer: Triton kernels (fp16)
(EngineCore_DP0 pid=4242) INFO 12-02 10:00:45 [gpu_model_runner.py:5188] Model loading took 3.52 GiB memory and 21.304512 seconds
(EngineCore_DP0 pid=4242) INFO 12-02 10:01:10 [gpu_worker.py:481] Available KV cache memory: 118.75 GiB
(EngineCore_DP0 pid=4242) INFO 12-02 10:01:10 [kv_cache_utils.py:1744] GPU KV cache size: 16,550,912 tokens
(EngineCore_DP0 pid=4242) INFO 12-02 10:01:10 [kv_cache_utils.py:1746] Maximum concurrency for 17,408 tokens per request: 950.76x
(EngineCore_DP0 pid=4242) INFO 12-02 10:01:40 [gpu_model_runner.py:6586] Graph capturing finished in 18 secs, took 0.45 GiB
(EngineCore_DP0 pid=4242) INFO 12-02 10:01:41 [core.py:314] init engine (profile, create kv cache, warmup model) took 55.21 s
"""  # noqa: E501 (vLLM's log lines, verbatim)


def test_parse_vllm_startup_log():
    f = parse.vllm_log(VLLM_LOG)
    assert f["kv_cache_tokens"] == 16550912 and f["kv_cache_gib"] == 118.75
    assert (f["max_model_len"], f["max_concurrency"]) == (17408, 950.76)
    assert f["kv_bytes_per_token"] == pytest.approx(118.75 * 2**30 / 16550912, abs=0.1)
    assert f["seqs_32k"] == pytest.approx(16550912 / 32768, abs=0.01)
    assert (f["weights_gib"], f["load_s"]) == (3.52, 21.304512)
    assert (f["graph_capture_s"], f["graph_gib"], f["init_s"]) == (18.0, 0.45, 55.21)
    assert f["attention_backend"] == "TRITON_MLA_SPARSE" and f["indexer"] == "triton"
    up = parse.vllm_log(VLLM_LOG.replace("TRITON_MLA_SPARSE", "FLASHMLA_SPARSE")
                        .replace("DSA indexer: Triton kernels (fp16)", ""))
    assert up["attention_backend"] == "FLASHMLA_SPARSE" and up["indexer"] == "deepgemm"
    assert parse.vllm_log("nothing") == {"indexer": "deepgemm"}


LLAMA_SERVER_LOG = """\
llama_kv_cache:      CUDA0 KV buffer size =   864.00 MiB
llama_kv_cache: size =  864.00 MiB ( 16640 cells,   6 layers,  1/1 seqs), K (f16):  864.00 MiB, V (f16):    0.00 MiB
llama_kv_cache_dsa:      CUDA0 KV buffer size =    99.00 MiB
llama_kv_cache_dsa: size =   99.00 MiB ( 16640 cells,   6 layers,  1/1 seqs), K (f16):   99.00 MiB, V (f16):    0.00 MiB
"""  # noqa: E501 (llama-server's log lines, verbatim)


def test_parse_llama_server_and_bench():
    f = parse.llama_server_log(LLAMA_SERVER_LOG)
    assert (f["kv_cache_tokens"] == 16640
            and f["kv_cache_gib"] == pytest.approx(963 / 1024, abs=1e-3))
    assert f["kv_bytes_per_token"] == pytest.approx(963 * 2**20 / 16640, abs=0.1)
    out = ('main: some log line\n[\n  {"build_commit": "0c1e570", '
           '"model_type": "glm-dsa ?B Q4_K - Medium",'
           ' "n_gpu_layers": 999, "n_prompt": 16384, "n_gen": 0, "n_depth": 0, "avg_ns": 1,'
           ' "n_batch": 2048, "n_ubatch": 512, "stddev_ns": 1, "avg_ts": 5123.4,'
           ' "stddev_ts": 12.5},\n  {"n_prompt": 16384, "n_gen": 0, "n_depth": 0,'
           ' "n_ubatch": 2048, "avg_ts": 7001.0, "stddev_ts": 3.0},\n  {"n_prompt": 0,'
           ' "n_gen": 128, "n_depth": 4096, "n_ubatch": 512, "avg_ts": 88.1,'
           ' "stddev_ts": 0.4}\n]\n')
    rows = parse.llama_bench(out)
    assert rows[0]["tok_s"] == 5123.4 and rows[0]["n_prompt"] == 16384
    assert (rows[1]["n_ubatch"], rows[1]["tok_s"]) == (2048, 7001.0)
    assert (rows[2]["n_gen"], rows[2]["n_depth"], rows[2]["tok_s"]) == (128, 4096, 88.1)
    # llama-bench's names, the prompt tests' micro-batch named
    assert [parse.llama_bench_test(r) for r in rows] == [
        "pp16384 ub512", "pp16384 ub2048", "tg128 @ d4096"]
    assert parse.nvidia_smi_mib("12345\n") == 12345.0


# ---------------------------------------------------------------------------
# Record and document
# ---------------------------------------------------------------------------


def fake_engine(folder: Path) -> Path:
    data = BenchData("engine", FAKE_ENV)
    data.notes.append("Paths: `triton-fp16`: the series")
    inp = {"checkpoint": "glm5-tp8", "type": "q4_k_m"}
    data.row("files", inp, bytes=3_600_000_000, types={"Q4_K": 30, "F32": 40, "Q6_K": 5},
             parameters=5_900_000_000, routing_max_over_mean=1.31, build_s=140.0)
    for path, backend, tput in (("triton-fp16", "TRITON_MLA_SPARSE", 2000.0),
                                ("flashmla-bf16", "FLASHMLA_SPARSE", 1600.0),
                                ("llama.cpp", None, 800.0)):
        srv = {"kv_cache_tokens": 16550912, "kv_cache_gib": 118.75, "kv_bytes_per_token": 7704.0,
               "seqs_32k": 505.09, "gpu_mib_ready": 130000.0, "start_s": 95.0,
               "command": f"vllm serve ... {path}"}
        if backend:
            srv.update(attention_backend=backend, weights_gib=3.52,
                       indexer="triton" if path == "triton-fp16" else "deepgemm")
        data.row("servers", dict(inp, path=path), **srv)
        w = wl.WORKLOADS["concurrent-32"]
        data.row("serve", dict(inp, path=path, workload=w.name, kind=w.kind, input_len=2048,
                               output_len=512, concurrency=32, num_prompts=64),
                 **dict(parse.bench_serve(dict(BENCH_RESULT, output_throughput=tput), w),
                        command=f"vllm bench serve ... {path}"))
    data.row("llama_bench", dict(inp, path="llama.cpp", test="pp16384"), tok_s=5123.4,
             tok_s_stddev=12.5, command="llama-bench ...")
    return data.write(folder / "nvidia-h200")


def test_record_reads_back_and_renders(tmp_path):
    path = fake_engine(tmp_path)
    run, rows = read(path)
    assert run["bench"] == "engine" and run["env"]["series"] == FAKE_ENV["series"]
    assert {r["table"] for r in rows} == {"files", "servers", "serve", "llama_bench"}
    assert record.render(tmp_path) == []
    md = (path.parent / "engine.md").read_text()
    assert "Series 0.23.0+dsa.sm120.abcdef12, repo commit 0123456789ab." in md
    assert "Command: `bench/bench_engine.py run --quick`." in md and "**Quick run**" in md
    assert ("| glm5-tp8 | q4_k_m | 3.60 | 5,900,000,000 | F32 40, Q4_K 30, Q6_K 5 | 1.31 | "
            "140 |") in md
    assert ("| glm5-tp8 q4_k_m | triton-fp16 | TRITON_MLA_SPARSE | triton | 3.52 | 118.75 | "
            "16,550,912 | 7704 | 505.1 | 130000 | 95 |") in md
    assert ("| glm5-tp8 q4_k_m | concurrent-32 | triton-fp16 | 2000.0 | 7992.2 | 1.25 | 290.0 | "
            "420.5 | 18.90 | 35.25 | 52.1 |  |  | 0 |") in md
    assert "Prefix-cache hits" not in md  # not measured: no claim
    assert "| glm5-tp8 q4_k_m | concurrent-32 | flashmla-bf16 | 1600.0 | 7992.2 |  |" in md
    assert "| glm5-tp8 q4_k_m | concurrent-32 | llama.cpp | 800.0 | 7992.2 | 0.50 |" in md
    assert "| glm5-tp8 q4_k_m | pp16384 | 5123.4 | 12.5 |" in md
    assert "vllm bench serve ... triton-fp16" in md
    # deterministic: the check passes, a changed figure is caught
    assert record.render(tmp_path, check=True) == []
    lines = path.read_text().splitlines()
    row = json.loads(lines[-2])
    row["figures"]["output_tok_s"] = 1.0
    lines[-2] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")
    assert record.render(tmp_path, check=True)


def test_older_runs_show_what_shared_prompts_could_serve():
    """Records of runs with one seed for all workloads: the share of a
    workload's prompt tokens that earlier workloads of the same server had
    computed, marked as not measured; none for a server's first workload, a
    workload with its own seed, or llama.cpp."""
    def row(path, name, seed, rnd=None):
        w = wl.WORKLOADS[name]
        i = {"checkpoint": "glm5-tp8", "type": "q4_k_m", "path": path, "workload": name,
             "kind": w.kind, "input_len": w.input_len, "num_prompts": w.num_prompts}
        if rnd:
            i["round"] = rnd
        return i, {"command": f"vllm bench serve --random-input-len {w.input_len} "
                              f"--seed {seed} --num-warmups 0"}

    serve = [row("triton-fp16", "prefill-16k", 0), row("triton-fp16", "concurrent-32", 0),
             row("triton-fp16", "single-4k", 0), row("flashmla-bf16", "single-4k", 0),
             row("triton-fp16", "single-32k", 1010), row("llama.cpp", "prefill-16k", 0),
             row("llama.cpp", "single-4k", 0), row("triton-fp16", "single-4k", 0, rnd=2)]
    shares = record.shared_prompts(serve)
    # 3 of 64 prompts began as the 16k ones (2048 tokens each, less the last
    # block); the three 4k prompts are the 16k ones' beginnings
    assert shares == {1: pytest.approx(100 * 3 * 1984 / (64 * 2048)),
                      2: pytest.approx(100 * 4032 / 4096)}
    md = record.engine_md({"env": FAKE_ENV}, [
        {"table": "serve", "inputs": dict(i, output_len=1, concurrency=1), "figures": f}
        for i, f in serve[:3]])
    assert "prompts drawn with one seed" in md and "| ≤ 98.4 |" in md
    assert "every workload and warm-up its own prompts" not in md


def _built_q4_k_m(tmp_path: Path) -> Path:
    """A models folder as build-models leaves it, GLM-5 TP-8 Q4_K_M (no file)."""
    models = tmp_path / "models"
    (models / "glm5-tp8").mkdir(parents=True)
    (models / "glm5-tp8" / "build.json").write_text(json.dumps(
        {"files": {"q4_k_m": {"file": "f.gguf", "bytes": 1, "types": {"Q4_K": 1}}},
         "seconds": {"convert_f16": 1.0}, "spec": {}}))
    return models


def test_rounds_interleave_the_paths(tmp_path, monkeypatch):
    """--rounds 2: every vLLM path's server twice, the paths in turn (A B A
    B), each tagged with its round; llama.cpp's server once."""
    import argparse

    from engine import run

    models = _built_q4_k_m(tmp_path)
    args = argparse.Namespace(work=str(tmp_path / "work"), results=str(tmp_path / "results"),
                              quick=False, budget_s=float("inf"), models=str(models), rounds=2)
    plan = wl.plan(False, [("glm5-tp8", "q4_k_m")],
                   ["triton-fp16-no-marlin-linears", "triton-fp16", "llama.cpp"], ["single-4k"])
    runner = run.Runner(args, plan)
    started = []
    monkeypatch.setattr(runner, "vllm", lambda path, *a: started.append((path, a[-1])))
    monkeypatch.setattr(runner, "llama", lambda *a: started.append(("llama.cpp", None)))
    assert runner.run() == 0
    assert started == [("triton-fp16-no-marlin-linears", 1), ("triton-fp16", 1),
                       ("llama.cpp", None), ("triton-fp16-no-marlin-linears", 2),
                       ("triton-fp16", 2)]
    assert runner.data.env["rounds"] == 2
    # one round: no round anywhere, as before
    args.rounds = 1
    runner, started[:] = run.Runner(args, plan), []
    monkeypatch.setattr(runner, "vllm", lambda path, *a: started.append((path, a[-1])))
    monkeypatch.setattr(runner, "llama", lambda *a: started.append(("llama.cpp", None)))
    runner.run()
    assert [r for _, r in started] == [None] * 3 and "rounds" not in runner.data.env


def test_start_together_starts_a_files_servers_at_once(tmp_path, monkeypatch):
    """--start-together 8: both vLLM servers of the file start before the
    first is measured, each with an 8 GiB KV cache and vLLM's start check at
    5 %; each is measured in turn and stopped, the GPU's memory awaited
    after the last only; llama.cpp after them, alone, or before them where
    --paths names it first; the record says how the servers ran and holds
    no GPU memory figure."""
    import argparse

    from engine import run

    events, fails = [], set()

    class FakeServer:
        def __init__(self, cmd, env, log, health):
            self.cmd, self.backend = cmd, cmd[cmd.index("--attention-backend") + 1]
            events.append(("start", self.backend))

        def wait_ready(self, timeout, limit):
            events.append(("ready", self.backend))
            if self.backend in fails:
                raise RuntimeError("server exited (1):\nout of memory")
            return {"TRITON_MLA_SPARSE": 210.0, "FLASHMLA_SPARSE": 190.0}[self.backend]

        def text(self):
            return VLLM_LOG

        def stop(self, wait_gpu=True):
            events.append(("stop", self.backend, wait_gpu))

    monkeypatch.setattr(run, "Server", FakeServer)
    monkeypatch.setattr(run, "gpu_mib", lambda: pytest.fail("GPU memory read with servers up"))
    models = _built_q4_k_m(tmp_path)
    args = argparse.Namespace(work=str(tmp_path / "work"), results=str(tmp_path / "results"),
                              quick=False, budget_s=float("inf"), models=str(models), rounds=1,
                              start_together=8.0)
    plan = wl.plan(False, [("glm5-tp8", "q4_k_m")], ["triton-fp16", "flashmla-bf16", "llama.cpp"],
                   ["single-4k", "concurrent-8"])
    runner = run.Runner(args, plan)
    monkeypatch.setattr(runner, "bench", lambda w, port, hf, inputs, tag:
                        events.append(("bench", inputs["path"], w.name)))
    monkeypatch.setattr(runner, "llama", lambda *a: events.append(("llama.cpp",)))
    assert runner.run() == 0
    # both waited for, side by side, before anything is measured
    assert sorted(events[:4]) == [("ready", "FLASHMLA_SPARSE"), ("ready", "TRITON_MLA_SPARSE"),
                                  ("start", "FLASHMLA_SPARSE"), ("start", "TRITON_MLA_SPARSE")]
    assert events[:2] == [("start", "TRITON_MLA_SPARSE"), ("start", "FLASHMLA_SPARSE")]
    assert events[4:] == [
        ("bench", "triton-fp16", "single-4k"), ("bench", "triton-fp16", "concurrent-8"),
        ("stop", "TRITON_MLA_SPARSE", False),
        ("bench", "flashmla-bf16", "single-4k"), ("bench", "flashmla-bf16", "concurrent-8"),
        ("stop", "FLASHMLA_SPARSE", True), ("llama.cpp",)]
    servers = [r for r in runner.data.rows if r["table"] == "servers"]
    assert [r["inputs"]["path"] for r in servers] == ["triton-fp16", "flashmla-bf16"]
    # each server's own start, not the wait behind the other's workloads
    assert [r["figures"]["start_s"] for r in servers] == [210.0, 190.0]
    for r in servers:
        assert "--kv-cache-memory-bytes 8589934592 --gpu-memory-utilization 0.05" in (
            r["figures"]["command"])
        assert r["figures"]["gpu_mib_ready"] is None and r["figures"]["gpu_mib_peak"] is None
    assert runner.data.env["start_together_kv_cache_gib"] == 8.0
    assert any(n.startswith("Started together (--start-together 8)") for n in runner.data.notes)
    # a server that does not start: noted, the other measured, both stopped
    fails.add("TRITON_MLA_SPARSE")
    events[:] = []
    runner = run.Runner(args, plan)
    monkeypatch.setattr(runner, "bench", lambda w, port, hf, inputs, tag:
                        events.append(("bench", inputs["path"], w.name)))
    monkeypatch.setattr(runner, "llama", lambda *a: None)
    assert runner.run() == 1
    assert [e for e in events if e[0] in ("bench", "stop")] == [
        ("stop", "TRITON_MLA_SPARSE", False), ("bench", "flashmla-bf16", "single-4k"),
        ("bench", "flashmla-bf16", "concurrent-8"), ("stop", "FLASHMLA_SPARSE", True)]
    assert any(n.startswith("glm5-tp8 q4_k_m triton-fp16: RuntimeError: server exited (1)")
               for n in runner.data.notes)
    # llama.cpp named first runs first (its server starts in seconds), the
    # vLLM servers together where the first of them stands
    fails.clear()
    events[:] = []
    plan = wl.plan(False, [("glm5-tp8", "q4_k_m")], ["llama.cpp", "triton-fp16", "flashmla-bf16"],
                   ["single-4k"])
    runner = run.Runner(args, plan)
    monkeypatch.setattr(runner, "bench", lambda w, port, hf, inputs, tag:
                        events.append(("bench", inputs["path"], w.name)))
    monkeypatch.setattr(runner, "llama", lambda *a: events.append(("llama.cpp",)))
    assert runner.run() == 0
    assert events[0] == ("llama.cpp",)
    assert sorted(events[1:5]) == [("ready", "FLASHMLA_SPARSE"), ("ready", "TRITON_MLA_SPARSE"),
                                   ("start", "FLASHMLA_SPARSE"), ("start", "TRITON_MLA_SPARSE")]
    assert [e for e in events if e[0] == "bench"] == [("bench", "triton-fp16", "single-4k"),
                                                      ("bench", "flashmla-bf16", "single-4k")]
    # alone (the default): vLLM's own memory share, no such flags
    alone = wl.vllm_serve(wl.PATHS["triton-fp16"], Path("f.gguf"), Path("hf"), 8000, 5120)
    assert "--kv-cache-memory-bytes" not in alone and "--gpu-memory-utilization" not in alone


@pytest.mark.parametrize("value", ["0", "-1", "x", "nan"])
def test_start_together_needs_a_kv_cache_size(value):
    r = subprocess.run([sys.executable, str(BENCH / "bench_engine.py"), "run",
                        "--start-together", value],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--start-together" in r.stderr


def test_rounds_render_their_medians_and_ranges(tmp_path):
    """Each round's rows tagged #round; × upstream against the same round's
    peer; Across rounds: the median and the range of each figure."""
    env = dict(FAKE_ENV, rounds=3)
    data = BenchData("engine", env)
    inp = {"checkpoint": "glm5-tp8", "type": "q4_k_m"}
    w = wl.WORKLOADS["concurrent-8"]
    for r, (ours, peer, itl) in enumerate(((2000.0, 1000.0, 2.0), (2600.0, 1300.0, 2.6),
                                          (1900.0, 1000.0, 2.3)), start=1):
        for path, tput in (("triton-fp16", ours), ("flashmla-bf16", peer)):
            i = dict(inp, path=path, round=r)
            data.row("servers", i, start_s=90.0 + r, command=f"serve {path}")
            data.row("serve", dict(i, workload=w.name, kind=w.kind),
                     **dict(parse.bench_serve(dict(BENCH_RESULT, output_throughput=tput,
                                                   p50_itl_ms=itl), w), command="bench"))
    path = data.write(tmp_path / "nvidia-h200")
    assert record.render(tmp_path) == []
    md = (path.parent / "engine.md").read_text()
    assert "Rounds: 3: each vLLM path's server started 3 times" in md
    assert "| glm5-tp8 q4_k_m | triton-fp16 #2 |" in md
    # round 2's ratio is against round 2's peer: 2600 / 1300
    assert "| glm5-tp8 q4_k_m | concurrent-8 | triton-fp16 #2 | 2600.0 |" in md
    row = next(line for line in md.splitlines()
               if line.startswith("| glm5-tp8 q4_k_m | concurrent-8 | triton-fp16 #2 |"))
    assert row.split("|")[6].strip() == "2.00"
    assert ("| glm5-tp8 q4_k_m | concurrent-8 | triton-fp16 | 3 | 2000.0 (1900.0–2600.0 ±18 %) |"
            in md)
    assert "| 2.30 (2.00–2.60 ±13 %) |" in md
    assert ("| glm5-tp8 q4_k_m | concurrent-8 | flashmla-bf16 | 3 | "
            "1000.0 (1000.0–1300.0 ±15 %)") in md


def test_render_machinery_shape():
    """engine.md, engine_profile.md and engine_estimate.md plug into
    bench/render.py's RENDERERS as they are (bench/render.py's renderers())."""
    from engine import estimate

    expected = {"engine": {"engine.md": record.engine_md},
                "engine_profile": {"engine_profile.md": record.profile_md,
                                   "engine_estimate.md": estimate.estimate_md}}
    assert expected == record.RENDERERS


# ---------------------------------------------------------------------------
# Command line and make target
# ---------------------------------------------------------------------------


def test_cli_help_and_plan():
    cli = [sys.executable, str(BENCH / "bench_engine.py")]
    r = subprocess.run([*cli, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "build-models" in r.stdout
    r = subprocess.run([*cli, "plan", "--quick"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert ("VLLM_DSA_INDEXER_TRITON=1" in r.stdout
            and "--attention-backend FLASHMLA_SPARSE" in r.stdout)
    assert "llama-server" in r.stdout and "--random-input-len 16384" in r.stdout
    r = subprocess.run([*cli, "plan", "--files", "glm5-tp8:q5_k_s"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "expected <checkpoint>:<type>" in r.stderr
    r = subprocess.run([*cli, "run", "--rounds", "0"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "--rounds: 0: a count of 1 or more" in r.stderr


def test_run_script_and_make_target():
    script = REPO / "scripts" / "run-bench-engine.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    r = subprocess.run([str(script), "--bogus"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown argument" in r.stderr
    r = subprocess.run(["make", "-n", "bench-engine"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0
    assert "scripts/supervise.py scripts/run-bench-engine.sh ${BENCH_ENGINE_ARGS:-}" in r.stdout
    help_lines = (REPO / "Makefile").read_text()
    assert "## bench-engine:" in help_lines


def test_recorded_commands_name_no_machine_path():
    from engine.run import _shown

    cmd = ["/some/env/bin/python3.12", "-m", "vllm.entrypoints.cli.main", "bench", "serve",
           "--endpoint", "/v1/completions", "--tokenizer", "/some/where/models/m/hf",
           "--result-dir", "/some/where/results"]
    assert _shown(cmd) == ("python3 -m vllm.entrypoints.cli.main bench serve "
                           "--endpoint /v1/completions --tokenizer '…/m/hf' "
                           "--result-dir '<results>'")


@pytest.mark.parametrize("extra, shown", [
    ([], "--paths triton-fp16,flashmla-bf16"),
    (["--", "--paths", "triton-fp16"], "--paths triton-fp16"),
    (["--", "--paths=flashmla-bf16"], "--paths=flashmla-bf16"),
])
def test_run_script_passes_one_paths_argument(tmp_path, extra, shown):
    """The record's command names the paths that ran: the caller's --paths
    replaces the script's default, it is not added beside it."""
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "python"
    fake.write_text('#!/bin/sh\necho "ARGS $*"\n')
    fake.chmod(0o755)
    r = subprocess.run([str(REPO / "scripts" / "run-bench-engine.sh"), "--quick", "--stage",
                        "run", "--no-install", "--no-llama-cpp", *extra],
                       env={**os.environ, "VENV": str(tmp_path)}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    run = next(line for line in r.stdout.splitlines()
               if line.startswith("ARGS") and " run " in line)
    assert run.count("--paths") == 1 and shown in run, run


class _FakeCompletions:
    """An OpenAI completions endpoint over a made-up model: the token after
    a prefix is a function of the prefix, its logprob another. ``offset``
    shifts the logprobs of decoded tokens after the first, ``wrong`` makes
    them the token after the right one: a decode path off by that much."""

    def __init__(self, vocab: int, offset: float = 0.0, wrong: bool = False):
        self.vocab, self.offset, self.wrong = vocab, offset, wrong
        self.batches: list[int] = []

    def next_token(self, prefix: list[int]) -> int:
        return (sum(prefix) * 7 + len(prefix)) % self.vocab

    @staticmethod
    def logprob(prefix: list[int], token: int) -> float:
        return -((sum(prefix) + token) % 13) / 10

    def complete(self, body: dict) -> dict:
        assert body["model"] == wl.SERVED_NAME and body["temperature"] == 0
        assert body["return_tokens_as_token_ids"] and body["logprobs"] == 1
        prompt = list(body["prompt"])
        if body.get("echo"):
            assert body["max_tokens"] == 1
            tokens = [f"token_id:{t}" for t in prompt]
            lps = [None] + [self.logprob(prompt[:i], prompt[i]) for i in range(1, len(prompt))]
            tops = [None] + [{f"token_id:{self.next_token(prompt[:i])}": -0.01,
                              f"token_id:{(self.next_token(prompt[:i]) + 1) % self.vocab}":
                              -5.0} for i in range(1, len(prompt))]
            return {"choices": [{"logprobs": {"tokens": tokens, "token_logprobs": lps,
                                              "top_logprobs": tops}}]}
        assert body["ignore_eos"]
        seq, ids, lps = list(prompt), [], []
        for k in range(body["max_tokens"]):
            t = self.next_token(seq)
            if k and self.wrong:
                t = (t + 1) % self.vocab
            lps.append(self.logprob(seq, t) + (self.offset if k else 0.0))
            ids.append(t)
            seq.append(t)
        return {"choices": [{"logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                                          "token_logprobs": lps}}]}

    def serve(self):
        import http.server
        import threading

        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                assert self.path == "/v1/completions"
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                data = json.dumps(fake.complete(body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


@pytest.mark.parametrize("offset,wrong,dlogprob,agree", [
    (0.0, False, 0.0, 1.0),  # decode and prefill agree
    (0.25, False, 0.25, 1.0),  # the decode step's logprobs off
    # the decode step picks other tokens (each scored alike by both)
    (0.0, True, 0.0, 0.0),
], ids=["same", "logprobs-off", "tokens-off"])
def test_consistency_holds_decode_to_prefill(offset, wrong, dlogprob, agree):
    """consistency.check against a server: every continuation token after
    the first compared, at the prefill's positions of that token; a decode
    path that computes other logprobs or picks other tokens shows."""
    from engine import consistency

    fake = _FakeCompletions(vocab=5000, offset=offset, wrong=wrong)
    server = fake.serve()
    try:
        w = wl.Workload("consistency-6", "consistency", 10, 5, 6, 6, warmup_prompts=0)
        figures = consistency.check(f"http://127.0.0.1:{server.server_port}", w, 5000, 0)
    finally:
        server.shutdown()
    assert figures["compared"] == 6 * 4
    assert figures["top1_agree"] == agree
    for key in ("dlogprob_p50", "dlogprob_p99", "dlogprob_max", "dlogprob_mean"):
        assert figures[key] == pytest.approx(dlogprob, abs=1e-9), key


def test_consistency_refuses_what_it_cannot_compare():
    from engine import consistency

    with pytest.raises(ValueError, match="3 tokens decoded, 2 prefilled"):
        consistency.compare([([1, 2, 3], [0.0] * 3)], [([0.0] * 2, [1, 2])])
    with pytest.raises(ValueError, match="output_len must be 2 or more"):
        consistency.compare([([1], [0.0])], [([0.0], [1])])
    w = wl.consistency(256)
    prompts = consistency.prompts(w, 154_880, 0)
    assert len(prompts) == 256 and {len(p) for p in prompts} == {64}
    assert min(min(p) for p in prompts) >= 1000 and max(max(p) for p in prompts) < 154_880
    assert prompts == consistency.prompts(w, 154_880, 0) != consistency.prompts(w, 154_880, 1)


def test_a_run_checks_each_vllm_server_after_its_workloads(tmp_path, monkeypatch):
    """--consistency N: after a vLLM server's workloads, N prompts at once
    against it; the record's table "consistency" and engine.md's section
    hold the figures; 0 runs none; llama.cpp is not checked."""
    import argparse

    from engine import run

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"vocab_size": 5000}))
    fake = _FakeCompletions(vocab=5000, offset=0.5)
    server = fake.serve()
    events = []
    try:
        for n in (8, 0):
            args = argparse.Namespace(work=str(tmp_path / f"work{n}"),
                                      results=str(tmp_path / f"results{n}"), quick=True,
                                      budget_s=float("inf"), consistency=n)
            plan = wl.plan(True, None, ["triton-fp16"], ["concurrent-32"])
            runner = run.Runner(args, plan)
            monkeypatch.setattr(runner, "bench", lambda w, port, hf, inputs, tag:
                                events.append(("bench", w.name)))
            monkeypatch.setattr(runner, "started", lambda server, kind="vllm": 100.0)

            class Idle:
                def text(self):
                    return VLLM_LOG

                def stop(self, wait_gpu=True):
                    events.append(("stop",))

            monkeypatch.setattr(run, "gpu_mib", lambda: None)
            one = {"path": wl.PATHS["triton-fp16"], "server": Idle(),
                   "port": server.server_port, "hf": hf, "cmd": ["vllm", "serve"],
                   "tag": "t", "log": tmp_path / "log", "what": "glm5-tp8 q4_k_m triton-fp16",
                   "inputs": {"checkpoint": "glm5-tp8", "type": "q4_k_m",
                              "path": "triton-fp16"}}
            runner.measure(one)
            checks = [r for r in runner.data.rows if r["table"] == "consistency"]
            if n == 0:
                assert not checks
                continue
            assert events == [("bench", "concurrent-32"), ("stop",)]
            (row,) = checks
            assert row["inputs"]["workload"] == "consistency-8"
            assert row["inputs"]["concurrency"] == 8
            assert row["figures"]["compared"] == 8 * 23
            assert row["figures"]["dlogprob_p50"] == pytest.approx(0.5)
            assert row["figures"]["top1_agree"] == 1.0
            md = (runner.folder / "engine.md").read_text()
            assert "## Decode against prefill" in md
            assert "| glm5-tp8 q4_k_m | triton-fp16 | 8 | 184 | 0.5000 |" in md
    finally:
        server.shutdown()
