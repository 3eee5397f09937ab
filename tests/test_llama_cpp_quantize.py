"""How the test models' files are made with llama.cpp's tools
(tests/support/llama_cpp_quantize.py), with stand-ins for the tools: the
command lines, the quantizer's fallback tensors read from its output (and
an output they cannot be read from refused), the importance matrix run on
a copy whose tokens llama.cpp reads back from text, a split set's shards.
tests/e2e/test_low_bit_files.py runs the real tools where they are built."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from support import llama_cpp_quantize

# What the pinned llama-quantize prints for a tensor whose rows do not fit.
_FALLBACK_LINES = """\
warning: blk.0.attn_k_b.weight                - ncols    192 not divisible by 256 \
(required for type    q4_K) -> falling back to    q5_0
[   4/  94] blk.0.attn_k_b.weight - [   192,    512,      4,      1], type =    f32, \
converting to q5_0 .. size =     1.50 MiB ->     0.26 MiB
warning: blk.1.attn_k_b.weight                - ncols    192 not divisible by 256 \
(required for type iq2_xxs) -> falling back to  iq4_nl
llama_model_quantize_impl: WARNING: {n} of 94 tensor(s) required fallback quantization
"""


def _tool(tools: Path, name: str, body: str) -> None:
    """A stand-in for one of llama.cpp's tools: a Python script that records
    its arguments in <tools>/<name>.json, then runs `body` (argv in `args`)."""
    tools.mkdir(exist_ok=True)
    script = tools / name
    script.write_text(f"#!{sys.executable}\nimport json, sys\nfrom pathlib import Path\n"
                      f"args = sys.argv[1:]\n"
                      f"Path({str(tools / (name + '.json'))!r}).write_text(json.dumps(args))\n"
                      + body)
    script.chmod(0o755)


def _args(tools: Path, name: str) -> list[str]:
    return json.loads((tools / f"{name}.json").read_text())


@pytest.mark.parametrize("said", [2, 3])
def test_quantize_reads_the_fallback_tensors(tmp_path, said):
    tools = tmp_path / "tools"
    _tool(tools, "llama-quantize",
          f"print({_FALLBACK_LINES.format(n=said)!r})\nPath(args[-3]).write_text('q')\n")
    dst = tmp_path / "m-iq2_xxs.gguf"
    kwargs = dict(imatrix=tmp_path / "m.imatrix", tensor_types=[(r"ffn_down_exps", "IQ3_XXS")],
                  token_embedding_type="Q4_K", output_tensor_type="Q6_K")
    if said == 3:  # one the quantizer counts but its lines do not show
        with pytest.raises(RuntimeError, match="read 2 fallback tensors .* it says 3 of 94"):
            llama_cpp_quantize.quantize(tools, tmp_path / "m.gguf", dst, "IQ2_XXS", 4, **kwargs)
        assert not dst.exists() and not list(tmp_path.glob(".*.tmp"))
        return
    fallback = llama_cpp_quantize.quantize(tools, tmp_path / "m.gguf", dst, "IQ2_XXS", 4,
                                           **kwargs)
    assert fallback == {
        "blk.0.attn_k_b.weight": {"wanted": "Q4_K", "got": "Q5_0", "columns": 192, "block": 256},
        "blk.1.attn_k_b.weight": {"wanted": "IQ2_XXS", "got": "IQ4_NL", "columns": 192,
                                  "block": 256},
    }
    assert dst.read_text() == "q"
    assert _args(tools, "llama-quantize") == [
        "--imatrix", str(tmp_path / "m.imatrix"), "--tensor-type", "ffn_down_exps=IQ3_XXS",
        "--token-embedding-type", "Q4_K", "--output-tensor-type", "Q6_K",
        str(tmp_path / "m.gguf"), str(tmp_path / ".m-iq2_xxs.gguf.tmp"), "IQ2_XXS", "4"]


def test_failed_tool_is_named_with_its_output(tmp_path):
    tools = tmp_path / "tools"
    _tool(tools, "llama-quantize", "print('this quantization requires an imatrix!')\n"
                                   "sys.exit(1)\n")
    with pytest.raises(RuntimeError, match=r"(?s)llama-quantize m.gguf -> IQ1_M failed "
                                           r"\(exit status 1\).*requires an imatrix"):
        llama_cpp_quantize.quantize(tools, tmp_path / "m.gguf", tmp_path / "o.gguf", "IQ1_M", 1)
    assert not (tmp_path / "o.gguf").exists()


def test_imatrix_runs_on_a_copy_whose_tokens_read_back(tmp_path):
    """llama-imatrix gets a copy of the model with USER_DEFINED tokens (the
    model itself is left as it is) and the text of the tokens."""
    import gguf
    import numpy as np

    model = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(model, "llama")
    writer.add_token_list([f"<t{i}>" for i in range(8)])
    writer.add_token_types([gguf.TokenType.NORMAL] * 8)
    writer.add_tensor("output.weight", np.ones((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tools = tmp_path / "tools"
    # the stand-in reads the copy's token types and the text while they exist
    _tool(tools, "llama-imatrix",
          "import gguf\n"
          "m = gguf.GGUFReader(args[args.index('-m') + 1])\n"
          "f = m.fields['tokenizer.ggml.token_type']\n"
          "types = [int(f.parts[i][0]) for i in f.data]\n"
          "text = Path(args[args.index('-f') + 1]).read_text()\n"
          "Path(args[args.index('-o') + 1]).write_text(json.dumps([types, text]))\n")
    out = tmp_path / "m-imatrix.gguf"
    llama_cpp_quantize.imatrix(tools, model, llama_cpp_quantize.token_text([3, 7, 3]), out,
                               ctx=384, threads=4)
    types, text = json.loads(out.read_text())
    assert types == [gguf.TokenType.USER_DEFINED] * 8 and text == "<t3><t7><t3>"
    args = _args(tools, "llama-imatrix")
    assert args[args.index("-c") + 1] == "384" and args[args.index("-t") + 1] == "4"
    assert "--no-ppl" in args
    field = gguf.GGUFReader(model).fields["tokenizer.ggml.token_type"]
    assert [int(field.parts[i][0]) for i in field.data] == [gguf.TokenType.NORMAL] * 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m-imatrix.gguf", "m.gguf", "tools"]


def test_split_returns_the_shards_in_order(tmp_path):
    tools = tmp_path / "tools"
    _tool(tools, "llama-gguf-split",
          "for i in (3, 1, 2):\n"
          "    Path(f'{args[-1]}-{i:05d}-of-00003.gguf').write_text(str(i))\n")
    prefix = tmp_path / "m-q4_k_m-split"
    (tmp_path / "m-q4_k_m-split-00001-of-00004.gguf").write_text("old")
    made = llama_cpp_quantize.split(tools, tmp_path / "m.gguf", prefix, 31)
    assert [p.name for p in made] == [f"m-q4_k_m-split-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert _args(tools, "llama-gguf-split") == [
        "--split", "--split-max-tensors", "31", str(tmp_path / "m.gguf"), str(prefix)]
