"""Convert tiny HF checkpoints with llama.cpp's own converter.

run(llama_cpp_dir, jobs.json) runs this file as a script, in a process of
its own with the converter's llama.cpp dir and its bundled gguf-py first on
PYTHONPATH: the converter imports them by top-level name (``conversion``,
``gguf``), and its gguf-py must never meet the gguf package vLLM imports.
Each job is ``{"model", "outtype", "outfile"}`` plus optionally
``"split_max_tensors"`` and ``"legacy_kv_b"``; all jobs share one process to
pay the torch/transformers import once. Used by the CPU GGUF tests
(tests/gguf) and the end-to-end test models (tests/e2e/models.py).

Only the vocabulary step is replaced. The converter identifies a tokenizer
by hashing its encoding of a probe text against the pre-tokenizers of
published models; a random-weight test checkpoint has no such tokenizer,
and the vocabulary plays no part in how weights are named, laid out or
quantized. Everything else (tensor renaming, expert merging, the MLA
k_b/v_b split, NextN handling, type selection, quantization, splitting)
is the converter's own code.
"""

import json
import os
import subprocess
import sys
from pathlib import Path


def run(llama_cpp: Path, jobs: Path, **kwargs) -> subprocess.CompletedProcess:
    """The converter on jobs (a JSON file); kwargs go to subprocess.run."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(llama_cpp), str(llama_cpp / "gguf-py"), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, str(Path(__file__).resolve()), str(jobs)], env=env,
                          **kwargs)


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    import gguf
    import torch
    from conversion import (
        ModelBase,
        ModelType,
        TextModel,
        get_model_architecture,
        get_model_class,
    )

    ftypes = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }

    def converter_for(dir_model: Path, legacy_kv_b: bool) -> type:
        hparams = ModelBase.load_hparams(dir_model, False)
        base = get_model_class(get_model_architecture(hparams, ModelType.TEXT))

        class Converter(base):
            model_arch = base.model_arch

            def set_vocab(self) -> None:
                n = self.hparams["vocab_size"]
                self.gguf_writer.add_tokenizer_model("gpt2")
                self.gguf_writer.add_tokenizer_pre("default")
                self.gguf_writer.add_token_list([f"<t{i}>" for i in range(n)])
                self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * n)
                # llama.cpp refuses a gpt2 vocabulary without merges; one
                # placeholder merge lets it load the file (the llama.cpp oracle).
                self.gguf_writer.add_token_merges(["< t"])

            def modify_tensors(self, data_torch, name, bid):
                # Older converters wrote kv_b_proj unsplit as attn_kv_b.
                if legacy_kv_b and name.endswith("kv_b_proj.weight"):
                    yield from TextModel.modify_tensors(self, data_torch, name, bid)
                    return
                yield from super().modify_tensors(data_torch, name, bid)

        return Converter

    with torch.inference_mode():
        for job in jobs:
            cls = converter_for(Path(job["model"]), job.get("legacy_kv_b", False))
            model = cls(
                Path(job["model"]),
                ftypes[job["outtype"]],
                Path(job["outfile"]),
                split_max_tensors=job.get("split_max_tensors", 0),
            )
            model.write()


if __name__ == "__main__":
    main()
