"""CPU checks of the end-to-end tests' own instruments: the transformers
oracle rebuilds exactly the checkpoint's model from an F32 GGUF written by
llama.cpp's converter (every tensor mapped, the MLA k_b/v_b factors and the
merged experts put back), and the test models are well-conditioned."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from cases import models, prompts
from oracles import (
    transformers_class,
    transformers_logprobs,
    transformers_model,
    transformers_mtp_drafts,
)


@pytest.fixture(scope="module")
def f32_models(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    return out, models.build(out, types=("f32",))


@pytest.mark.parametrize("name", ["glm5", "glm52", "dsv32"])
def test_transformers_oracle_rebuilds_the_checkpoint(f32_models, name):
    out, manifest = f32_models
    entry = manifest["models"][name]
    hf, gguf = out / name / entry["hf"], out / name / entry["gguf"]["f32"]
    reference = transformers_class(hf).from_pretrained(
        hf, dtype=torch.float32, attn_implementation="eager").eval()
    oracle = transformers_model(hf, gguf)
    for (n, a), (_, b) in zip(sorted(reference.state_dict().items()),
                              sorted(oracle.state_dict().items()), strict=True):
        assert torch.equal(a, b), f"{name}: {n} differs from the checkpoint"
    tokens = prompts()[0]
    with torch.no_grad():
        ref = torch.log_softmax(reference(torch.tensor([tokens])).logits[0], -1)
    assert torch.equal(transformers_logprobs(oracle, tokens), ref)


def test_models_are_well_conditioned(f32_models):
    """Peaked next-token distributions and few near-ties: rounding alone must
    not flip greedy tokens (a flat random model does)."""
    out, manifest = f32_models
    entry = manifest["models"]["glm5"]
    oracle = transformers_model(out / "glm5" / entry["hf"], out / "glm5" / entry["gguf"]["f32"])
    lp = transformers_logprobs(oracle, prompts()[0])
    top2 = lp.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    assert lp.max(-1).values.exp().mean() > 0.3, "flat logits"
    assert margin.median() > 0.4, f"top-1/top-2 margin median {margin.median():.2f} nats"


def test_mtp_block_drafts_the_targets_tokens(f32_models):
    """The GLM-5 model's NextN block guesses the target's next-but-one greedy
    token often enough that an MTP run accepts drafts (a random block never
    does, and the path that keeps accepted tokens would go untested): a
    quarter at least in fp32 (test_engine.MIN_ACCEPTANCE asks 0.15 of the
    engine)."""
    out, manifest = f32_models
    hf = out / "glm5" / manifest["models"]["glm5"]["hf"]
    target = transformers_class(hf).from_pretrained(
        hf, dtype=torch.float32, attn_implementation="eager").eval()
    hits = total = 0
    for prompt in prompts():
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(24):
                seq.append(target(torch.tensor([seq]), use_cache=False).logits[0, -1]
                           .argmax().item())
        drafts = transformers_mtp_drafts(hf, seq)
        # the drafts made while generating: from positions len(prompt) - 1 on
        hits += sum(drafts[i] == seq[i + 2] for i in range(len(prompt) - 2, len(seq) - 2))
        total += len(seq) - len(prompt)
    assert hits / total >= 0.25, f"{hits} of {total} drafts are the target's greedy tokens"


@pytest.fixture
def fake_tools(tmp_path, monkeypatch):
    """models.build with stand-ins for transformers, llama.cpp's converter and
    quantizer: each GGUF file holds its type's name, which is also its one
    tensor type. FAIL_CONVERT=<model> makes the converter fail for it."""
    built = []

    def checkpoint(spec, path):
        built.append(spec.name)
        (path / "config.json").write_text("{}")

    converter = tmp_path / "convert.py"
    converter.write_text(
        "import json, os, sys\n"
        "fail = os.environ.get('FAIL_CONVERT')\n"
        "for job in json.load(open(sys.argv[2])):\n"
        "    open(job['outfile'], 'w').write(job['outtype'])\n"
        "    if fail and fail in os.path.basename(job['outfile']):\n"
        "        sys.exit('converter failed')\n")
    monkeypatch.setattr(models, "CONVERTER", converter)
    monkeypatch.setattr(models, "build_checkpoint", checkpoint)
    monkeypatch.setattr(models, "converter_dir", lambda work: work)
    monkeypatch.setattr(models, "quantize", lambda src, dst, q: dst.write_text(q))
    monkeypatch.setattr(models, "tensor_types", lambda path: {"t": path.read_text().upper()})
    return built


def test_failed_model_build_leaves_no_half_written_model(fake_tools, tmp_path, monkeypatch):
    out = tmp_path / "e2e"
    monkeypatch.setenv("FAIL_CONVERT", "glm52-")
    with pytest.raises(subprocess.CalledProcessError):
        models.build(out, types=("f32", "q8_0"))
    # glm5 was complete and stays; nothing of glm52 is left to be taken as built.
    assert sorted(p.name for p in out.iterdir()) == ["glm5", "manifest.json"]
    assert list(json.loads((out / "manifest.json").read_text())["models"]) == ["glm5"]
    monkeypatch.delenv("FAIL_CONVERT")
    fake_tools.clear()
    models.build(out, types=("f32", "q8_0"))
    assert fake_tools == ["glm52", "dsv32"]


def test_manifest_is_checked_against_the_files_it_names(fake_tools, tmp_path):
    """A manifest that points every type at one file, or names a file of
    other tensor types, is not taken as up to date."""
    out = tmp_path / "e2e"
    manifest = models.build(out, types=("f32", "f16"))
    assert fake_tools == ["glm5", "glm52", "dsv32"]
    fake_tools.clear()
    assert models.build(out, types=("f32", "f16")) == manifest and fake_tools == []
    broken = json.loads(json.dumps(manifest))
    broken["models"]["glm5"]["gguf"] = {t: "glm5-f32.gguf" for t in ("f32", "f16")}
    (out / "glm52" / "glm52-f16.gguf").write_text("q8_0")
    (out / "manifest.json").write_text(json.dumps(broken))
    assert models.build(out, types=("f32", "f16")) == manifest
    assert fake_tools == ["glm5", "glm52"]
