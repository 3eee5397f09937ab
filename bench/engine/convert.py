#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""llama.cpp's own converter on a benchmark checkpoint, its tensors streamed.

    PYTHONPATH=<llama.cpp dir>:<llama.cpp dir>/gguf-py:bench \
        python bench/engine/convert.py <job.json>      # build.convert() runs it

job.json: {"hf": HF dir (config.json), "spec": spec fields, "outtype":
"f16"|"bf16"|"f32"|"q8_0", "outfile": path}.

Run as its own process so that the converter's bundled gguf-py never meets
the gguf package vLLM imports (as tests/support/llama_cpp_convert.py does);
the converter's folders come first on its path, before the installed gguf.
Two steps of the converter are replaced, nothing else: where tensors come
from (the seeded random tensors of engine.weights, handed over lazily, one
at a time, instead of safetensors files: a full-width file never exists in
HF form on disk) and the vocabulary (engine.vocab, instead of hashing a
published tokenizer). Tensor renaming, expert merging, the MLA k_b/v_b
split, type selection and writing are the converter's own code.
"""

import json
import sys
import time
from pathlib import Path


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    import gguf
    import torch
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class
    from conversion.base import LazyTorchTensor

    from engine import spec as specs
    from engine import vocab, weights

    spec = specs.Spec(**job["spec"])
    tensors = specs.hf_tensors(spec)
    ftypes = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }

    def index_tensors(self, remote_hf_model_id=None):
        out = {}
        for t in tensors:
            def gen(t=t):
                meta = LazyTorchTensor.meta_with_dtype_and_shape(torch.bfloat16, t.shape)
                return LazyTorchTensor(meta=meta, args=(t,),
                                       func=lambda t: weights.make(spec, t))
            if titem := self.filter_tensors((t.name, gen)):
                out[titem[0]] = titem[1]
        return out

    ModelBase.index_tensors = index_tensors
    hf = Path(job["hf"])
    hparams = ModelBase.load_hparams(hf, False)
    base = get_model_class(get_model_architecture(hparams, ModelType.TEXT))

    class Converter(base):
        model_arch = base.model_arch

        def set_vocab(self) -> None:
            v = vocab.gguf_vocab(self.hparams["vocab_size"])
            w = self.gguf_writer
            w.add_tokenizer_model(v["model"])
            w.add_tokenizer_pre(v["pre"])
            w.add_token_list(v["tokens"])
            w.add_token_types(v["types"])
            w.add_token_merges(v["merges"])
            w.add_eos_token_id(v["eos"])
            w.add_pad_token_id(v["eos"])
            w.add_add_bos_token(False)

    start = time.monotonic()
    with torch.inference_mode():
        model = Converter(hf, ftypes[job["outtype"]], Path(job["outfile"]))
        model.write()
    print(f"[convert] {Path(job['outfile']).name}: {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
