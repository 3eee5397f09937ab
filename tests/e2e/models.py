"""Tiny, well-conditioned DSA checkpoints and their GGUF files, for the
end-to-end engine tests (tests/e2e/test_engine.py, test_serve.py).

    python tests/e2e/models.py build DIR          # `make e2e-models`
    python tests/e2e/models.py llama-cpp-wheel DIR  # for `make wheelhouse`
    python tests/e2e/models.py converter FILE.tar.gz

builds, in DIR (cached: a model whose recipe is unchanged and whose files are
what manifest.json says is not rebuilt; a model's folder appears only once
it is complete):

- one Hugging Face directory per model (config, safetensors, a word-level
  tokenizer with a chat template): the engine's --hf-config-path and
  --tokenizer, and the transformers oracle's starting point;
- its GGUF files, written by llama.cpp's own converter (F32, F16, BF16,
  Q8_0) and quantized by llama.cpp's own quantizer (llama_model_quantize,
  the code behind llama-quantize) from the F32 file (Q4_K_M, Q5_K_M, Q6_K);
- manifest.json: models, files and their tensor types.

llama.cpp's converter comes from the pinned llama-cpp-python sdist (fetched
and cached like the other downloads) or, on a machine without a package
index, from E2E_LLAMA_CPP (the converter archive `make wheelhouse` writes);
the quantizer is the llama_cpp package built from that same sdist.

Why "well-conditioned": random initialisation at the usual 0.02 gives flat
logits and sub-layers that barely move the residual stream, so any rounding
flips greedy tokens and the tests measure noise. Here every projection has
unit gain (std 1/sqrt(fan_in)), the router's scores are spread out (few
expert-choice ties), and the output head gives logits several nats apart.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONVERTER = REPO / "tests" / "gguf" / "llama_cpp_convert.py"
if str(REPO / "tests") not in sys.path:  # run as a script: the test support package
    sys.path.insert(0, str(REPO / "tests"))

from support.llama_cpp_sdist import extract_converter, sdist  # noqa: E402

# Types written by the converter, then types made by llama.cpp's quantizer.
CONVERTED = ("f32", "f16", "bf16", "q8_0")
QUANTIZED = ("q4_k_m", "q5_k_m", "q6_k")

VOCAB = 512
BOS, EOS = 0, 1
# Reserved tokens of the chat template (never in random prompts).
CHAT_TOKENS = {"user": 2, "assistant": 3, "end": 4}
FIRST_TEXT_TOKEN = 8

# Bump when the recipe below changes, so cached models are rebuilt.
RECIPE = 7

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    # 512: each of two tensor-parallel ranks still holds whole 256-wide K-quant
    # blocks of the experts' down projection (real models: 2048 and more).
    moe_intermediate_size=512,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    q_lora_rank=256,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    first_k_dense_replace=1,
    max_position_embeddings=2048,
    topk_method="noaux_tc",
    routed_scaling_factor=1.0,
    bos_token_id=BOS,
    eos_token_id=EOS,
    tie_word_embeddings=False,
    # GLM-5's indexer geometry (DeepGEMM's logits kernels need 32/64 heads);
    # top-k 128 (vLLM's FLASHMLA_SPARSE path needs a multiple of 128), far
    # below the long prompt's length.
    index_n_heads=32,
    index_head_dim=128,
    index_topk=128,
)


# Keys the published GLM-5.x config.json files carry and transformers'
# GlmMoeDsaConfig does not write (its modelling hard-codes them); vLLM reads
# them, so the test checkpoints carry them like the real ones.
_GLM_KEYS = dict(scoring_func="sigmoid", rope_interleave=True, indexer_rope_interleave=True)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config_class: str
    architecture: str
    layers: int
    mtp_layers: int = 0
    extra: dict = field(default_factory=dict)
    seed: int = 0


MODELS = {
    # GLM-5: every layer runs its own indexer; NextN block for MTP.
    "glm5": ModelSpec(
        "glm5", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", layers=3, mtp_layers=1,
        extra=dict(qk_nope_head_dim=192, v_head_dim=256, **_GLM_KEYS), seed=11,
    ),
    # GLM-5.2: shared layers reuse the previous full layer's top-k and carry
    # no indexer tensors.
    "glm52": ModelSpec(
        "glm52", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", layers=4,
        extra=dict(qk_nope_head_dim=192, v_head_dim=256, **_GLM_KEYS,
                   indexer_types=["full", "shared", "full", "shared"]),
        seed=12,
    ),
    # DeepSeek-V3.2 (llama.cpp arch deepseek32): qk_nope 128, v_head 128.
    "dsv32": ModelSpec(
        "dsv32", "DeepseekV32Config", "DeepseekV32ForCausalLM", layers=3,
        extra=dict(qk_nope_head_dim=128, v_head_dim=128, scoring_func="sigmoid"), seed=13,
    ),
}


def _recipe_hash(spec: ModelSpec) -> str:
    blob = json.dumps([RECIPE, asdict(spec), _COMMON], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _condition(model, spec: ModelSpec) -> None:
    """Unit-gain weights (see the module docstring)."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    n_layers = spec.layers + spec.mtp_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("lm_head.weight"):
                # Logits a few nats apart: a peaked, not flat, distribution.
                p.copy_(torch.randn(p.shape, generator=gen) * 4.0 / p.shape[1] ** 0.5)
            elif p.ndim == 1:
                # Norm weights and biases: every value counts.
                base = 0.0 if ("bias" in name) else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                gain = 1.0
                if name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")):
                    gain = (2 * n_layers) ** -0.5  # residual branches add up
                if name.endswith("mlp.gate.weight"):
                    gain = 3.0  # router scores spread out: few ties
                p.copy_(torch.randn(p.shape, generator=gen) * gain / fan_in**0.5)


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"<t{i}>": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t5>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    user, assistant, end = (f"<t{CHAT_TOKENS[k]}>" for k in ("user", "assistant", "end"))
    template = (
        "{% for m in messages %}"
        f"{{% if m['role'] == 'user' %}}{user} {{% else %}}{assistant} {{% endif %}}"
        f"{{{{ m['content'] }}}} {end} "
        "{% endfor %}"
        f"{{% if add_generation_prompt %}}{assistant} {{% endif %}}"
    )
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": f"<t{BOS}>",
        "eos_token": f"<t{EOS}>",
        "unk_token": "<t5>",
        "add_bos_token": False,
        "chat_template": template,
        "model_max_length": _COMMON["max_position_embeddings"],
    }, indent=1))


def build_checkpoint(spec: ModelSpec, path: Path) -> None:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    config_cls = getattr(transformers, spec.config_class)
    geometry = dict(_COMMON, **spec.extra)
    total = spec.layers + spec.mtp_layers
    if "indexer_types" in geometry:
        geometry["indexer_types"] = geometry["indexer_types"][:total]
    torch.manual_seed(spec.seed)
    # The MTP block is an ordinary decoder layer plus the NextN projections;
    # transformers does not model it, so build it as one more layer and add
    # the NextN tensors, as GLM-5 checkpoints store them.
    model = transformers.AutoModelForCausalLM.from_config(
        config_cls(num_hidden_layers=total, **geometry)
    )
    _condition(model, spec)
    model.save_pretrained(path)
    if "indexer_types" in geometry:
        geometry["indexer_types"] = geometry["indexer_types"][: spec.layers]
    config = config_cls(
        num_hidden_layers=spec.layers, num_nextn_predict_layers=spec.mtp_layers, **geometry
    )
    config.architectures = [spec.architecture]
    config.save_pretrained(path)
    if spec.mtp_layers:
        gen = torch.Generator().manual_seed(spec.seed + 1000)
        state = load_file(path / "model.safetensors")
        hidden = geometry["hidden_size"]
        for layer in range(spec.layers, total):
            prefix = f"model.layers.{layer}."
            # A random NextN block proposes tokens the target never takes: no
            # draft is accepted, and the path that keeps accepted tokens is not
            # run. This one passes the next token's embedding through (and a
            # little of the target's hidden state), so the block predicts from
            # the next token much as the target does: in fp32 about a third of
            # its drafts are the target's greedy tokens.
            eh_proj = torch.cat([torch.eye(hidden), 0.1 * torch.randn(
                hidden, hidden, generator=gen) / hidden**0.5], dim=1)
            state[prefix + "eh_proj.weight"] = eh_proj
            for norm in ("enorm", "hnorm", "shared_head.norm"):
                state[prefix + norm + ".weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    _tokenizer(path)


def quantize(src: Path, dst: Path, qtype: str) -> None:
    """llama.cpp's quantizer (llama_model_quantize: llama-quantize's code)."""
    import ctypes

    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype.upper()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    tmp = dst.with_suffix(".gguf.tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"llama_model_quantize {src.name} -> {qtype} failed (rc {rc})")
    tmp.rename(dst)


def tensor_types(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


def converter_dir(work: Path) -> Path:
    """llama.cpp's converter: E2E_LLAMA_CPP (an archive of it) or the sdist."""
    archive = os.environ.get("E2E_LLAMA_CPP")
    if archive:
        if not Path(archive).is_file():
            raise SystemExit(f"E2E_LLAMA_CPP={archive}: no such file")
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
        return work / "llama.cpp"
    return extract_converter(sdist(), work)


def write_converter_archive(dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = extract_converter(sdist(), Path(tmp))
        with tarfile.open(dest, "w:gz") as tar:
            tar.add(root, arcname="llama.cpp")


def build_llama_cpp_wheel(dest: Path) -> None:
    """The llama-cpp-python wheel from the pinned sdist, CPU only and portable
    (no -march=native), for the oracle and the quantizer on another machine."""
    env = dict(os.environ, CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_CUDA=OFF -DLLAMA_CURL=OFF "
               "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(dest),
                    str(sdist())], env=env, check=True)


def _mismatch(entry: dict | None, mdir: Path, recipe: str, types: tuple[str, ...]) -> str:
    """Why a model folder is not what `build` would make ("" when it is): its
    manifest entry is checked against the files it names."""
    if not entry or entry.get("recipe") != recipe:
        return "new recipe"
    if missing := sorted(set(types) - set(entry["gguf"])):
        return f"no {', '.join(missing)} file"
    if not (mdir / entry["hf"] / "config.json").is_file():
        return f"{entry['hf']}/config.json is missing"
    for t, name in entry["gguf"].items():
        if name != f"{mdir.name}-{t}.gguf":
            return f"{t} names {name}"
        if not (mdir / name).is_file():
            return f"{name} is missing"
        if sorted(set(tensor_types(mdir / name).values())) != entry["types"].get(t):
            return f"{name} holds other tensor types than the manifest says"
    return ""


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def build(out: Path, types: tuple[str, ...] = CONVERTED + QUANTIZED) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    old = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    manifest: dict = {"models": {}}
    with tempfile.TemporaryDirectory() as work:
        converter = None
        for spec in MODELS.values():
            recipe = _recipe_hash(spec)
            mdir = out / spec.name
            entry = old.get("models", {}).get(spec.name)
            if not (why := _mismatch(entry, mdir, recipe, types)):
                print(f"[e2e-models] {spec.name}: up to date", flush=True)
                manifest["models"][spec.name] = entry
                continue
            if entry:
                print(f"[e2e-models] {spec.name}: rebuilt ({why})", flush=True)
            if converter is None:
                converter = converter_dir(Path(work))
            manifest["models"][spec.name] = _build_model(spec, recipe, mdir, converter, types)
            _write_json(manifest_path, manifest)
    _write_json(manifest_path, manifest)
    return manifest


def _build_model(spec: ModelSpec, recipe: str, mdir: Path, converter: Path,
                 types: tuple[str, ...]) -> dict:
    """Build one model in <mdir>.partial and put it in mdir's place once
    complete: a failed or interrupted build leaves no half-written model.
    Returns its manifest entry."""
    tmp = mdir.with_name(f"{mdir.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        print(f"[e2e-models] {spec.name}: checkpoint", flush=True)
        hf = tmp / "hf"
        hf.mkdir(parents=True)
        build_checkpoint(spec, hf)
        # F32 is the quantizer's input.
        needs_f32 = bool(set(types) & set(QUANTIZED))
        converted = [t for t in CONVERTED if t in types or (t == "f32" and needs_f32)]
        jobs = [{"model": str(hf), "outtype": t, "outfile": str(tmp / f"{spec.name}-{t}.gguf")}
                for t in converted]
        (tmp / "jobs.json").write_text(json.dumps(jobs))
        print(f"[e2e-models] {spec.name}: llama.cpp converter ({', '.join(converted)})",
              flush=True)
        subprocess.run([sys.executable, str(CONVERTER), str(converter), str(tmp / "jobs.json")],
                       check=True)
        files = {t: f"{spec.name}-{t}.gguf" for t in converted}
        for q in (t for t in QUANTIZED if t in types):
            print(f"[e2e-models] {spec.name}: llama.cpp quantizer -> {q}", flush=True)
            quantize(tmp / files["f32"], tmp / f"{spec.name}-{q}.gguf", q)
            files[q] = f"{spec.name}-{q}.gguf"
        entry = {
            "recipe": recipe,
            "layers": spec.layers,
            "mtp_layers": spec.mtp_layers,
            "hf": "hf",
            "gguf": files,
            "types": {t: sorted(set(tensor_types(tmp / f).values())) for t, f in files.items()},
        }
        shutil.rmtree(mdir, ignore_errors=True)
        os.rename(tmp, mdir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return entry


def main() -> None:
    commands = {
        "build": lambda arg: build(Path(arg)),
        "llama-cpp-wheel": lambda arg: build_llama_cpp_wheel(Path(arg)),
        "converter": lambda arg: write_converter_archive(Path(arg)),
    }
    if len(sys.argv) != 3 or sys.argv[1] not in commands:
        raise SystemExit(__doc__)
    commands[sys.argv[1]](sys.argv[2])


if __name__ == "__main__":
    main()
