"""The installed wheel is the patched tree, labelled with the series."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

from patchseries.pin import load_pin
from patchseries.tree import read_series, series_digest, series_files

VLLM_SRC = Path(__file__).resolve().parents[1] / "vllm-src"


@pytest.fixture(scope="module")
def installed() -> Path:
    dist = importlib.metadata.distribution("vllm")
    return Path(dist.locate_file("vllm"))


def test_import_reports_the_series_version(repo):
    pin = load_pin()
    digest = series_digest(read_series(repo / "patches"))[:8]
    # PEP 440: a local segment of digits alone is a number (no leading zeros)
    label = str(int(digest)) if digest.isdigit() else digest
    expected = f"{pin.version}+dsa.sm120.{label}"
    # A fresh interpreter, as a user would import it.
    out = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[-1] == expected
    assert importlib.metadata.version("vllm") == expected


def test_changed_files_are_installed_byte_identical(installed):
    assert (VLLM_SRC / ".git").exists(), "vllm-src/ is missing: run `make test`"
    changed = series_files("AM", "vllm/", VLLM_SRC)
    for name in changed:
        ours = (VLLM_SRC / name).read_bytes()
        theirs = installed.parent / name
        assert theirs.exists(), f"{name} is not in the installed package"
        assert theirs.read_bytes() == ours, f"{name} differs from vllm-src/"


def test_compiled_ops_come_from_the_pinned_wheel(installed):
    # The precompiled build ships upstream's ops (with sm_120 code); make sure
    # they are in the package users install.
    for so in ("_C.abi3.so", "_C_stable_libtorch.abi3.so", "_moe_C.abi3.so", "_flashmla_C.abi3.so"):
        assert (installed / so).stat().st_size > 1_000_000, so


def test_every_module_the_series_adds_imports_first():
    """Each module the series adds, and the GGUF op module whose imports
    they join, imported first in a fresh interpreter, as a script or a
    benchmark imports it: no import cycle (0027's top-level import of
    gguf_dispatch made `import ...quantization.gguf` fail so)."""
    from concurrent.futures import ThreadPoolExecutor

    assert (VLLM_SRC / ".git").exists(), "vllm-src/ is missing: run `make test`"
    added = series_files("A", "vllm/*.py", VLLM_SRC)
    modules = [p.removesuffix(".py").replace("/", ".") for p in added
               if not p.endswith("__init__.py")]
    modules.append("vllm.model_executor.layers.quantization.gguf")
    assert len(modules) > 5

    def first_import(module):
        run = subprocess.run([sys.executable, "-c", f"import {module}"],
                             capture_output=True, text=True)
        return module, run.returncode, run.stderr.strip().splitlines()[-1:]

    with ThreadPoolExecutor(2) as pool:
        failed = [r for r in pool.map(first_import, modules) if r[1] != 0]
    assert not failed, failed


# The compiled kernels the series' path launches on an SM120 GPU, by the op
# that launches them: a regular expression on the kernel's own name (its
# last identifier, e.g. moe_q4_K of moe_q4_K<c10::Half, false>).
SM120_PATH_KERNELS = {
    "ggml_dequantize": r"dequantize_block\w*",
    "ggml_mul_mat_vec_a8": r"mul_mat_vec_q",
    "ggml_mul_mat_a8": r"mul_mat_q\d_\w+",
    "ggml_moe_a8": r"moe_q\d_\w+",
    "ggml_moe_a8_vec": r"moe_vec_q",
    "ggml q8_1 activations": r"quantize_q8_1",
    "moe_wna16_marlin_gemm (0028)": r"Marlin",
    "gptq_marlin_repack (0028)": r"gptq_marlin_repack_kernel",
    "marlin_gemm (VLLM_GGUF_MARLIN_LINEARS)": r"Marlin",
    "top_k_per_row_decode": r"topKPerRowDecode",
    "top_k_per_row_prefill": r"topKPerRowPrefill",
    "cp_gather_indexer_k_quant_cache": r"cp_gather_indexer_k_quant_cache_kernel",
    "indexer_k_quant_and_cache (bf16)": r"indexer_k_quant_and_cache_kernel",
    "concat_and_cache_mla": r"concat_and_cache_mla_kernel",
    "concat_mla_q": r"ConcatMLAQKernel",
    "moe_sum": r"moe_sum_kernel",
    "moe_align_block_size": r"moe_align_block_size_kernel",
    "grouped_topk": r"grouped_topk_fused\w*",
    "rms_norm": r"rms_norm_kernel",
    "fused_add_rms_norm": r"fused_add_rms_norm_kernel",
    "silu_and_mul": r"act_and_mul_kernel",
    "rotary_embedding": r"rotary_embedding_kernel",
}
# Marlin's MoE kernels are marlin_moe_wna16::Marlin, the dense ones
# marlin::Marlin.
_NAMESPACE = {"moe_wna16_marlin_gemm (0028)": "marlin_moe_wna16",
              "marlin_gemm (VLLM_GGUF_MARLIN_LINEARS)": "marlin"}


def _kernel_names(mangled: str) -> list[str]:
    """The source identifiers in an Itanium-mangled name, in order
    (<length><identifier>; the length fixes where each ends)."""
    names, i = [], 0
    while i < len(mangled):
        m = re.compile(r"\d+").match(mangled, i)
        if not m:
            i += 1
            continue
        if re.fullmatch(r"L[a-z]", mangled[i - 2 : i]):  # a literal, L<type><value>E
            i = m.end()
            continue
        n, j = int(m.group()), m.end()
        word = mangled[j : j + n]
        if n and re.fullmatch(r"[A-Za-z_]\w*", word):
            names.append(word)
            i = j + n
        else:
            i = j
    return names


def _fatbin_kernels(cuobjdump: Path, so: Path) -> dict[str, set[tuple[str, str]]]:
    """{mangled kernel: {("sass"|"ptx", arch)}} of a compiled extension."""
    found: dict[str, set[tuple[str, str]]] = {}
    for kind, flag in (("sass", "-symbols"), ("ptx", "-ptx")):
        out = subprocess.run([str(cuobjdump), flag, str(so)], capture_output=True,
                             text=True, check=True).stdout
        arch = None
        for line in out.splitlines():
            if line.startswith("arch = "):
                arch = line.split()[-1]
            elif kind == "sass" and line.startswith("STT_FUNC"):
                found.setdefault(line.split()[-1], set()).add((kind, arch))
            elif kind == "ptx" and (m := re.match(r"\s*(?:\.\w+\s+)?\.entry\s+([\w$]+)", line)):
                found.setdefault(m.group(1), set()).add((kind, arch))
    return found


def _runs_on(code: set[tuple[str, str]], sm: int) -> bool:
    """Whether the driver can run a kernel compiled as `code` on an SM `sm`
    GPU (90, 120): SASS of that major version and no higher minor, or PTX of
    an arch no higher (arch-specific PTX, sm_90a, runs only on its own)."""
    for kind, arch in code:
        m = re.fullmatch(r"sm_(\d+)(\d)([a-z]?)", arch)
        major, minor, suffix = int(m[1]), int(m[2]), m[3]
        if kind == "sass" and major == sm // 10 and minor <= sm % 10:
            return True
        if kind == "ptx" and not suffix and major * 10 + minor <= sm:
            return True
    return False


@pytest.fixture(scope="module")
def fatbin_kernels(installed) -> list[tuple[str, list[str], set[tuple[str, str]]]]:
    """(extension:mangled name, its identifiers, its code) of every kernel
    in the installed compiled ops."""
    from concurrent.futures import ThreadPoolExecutor

    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    assert cuobjdump.is_file(), f"{cuobjdump}: triton's bundled cuobjdump is missing"
    sos = sorted(installed.glob("_*C*.abi3.so"))
    assert sos, f"no compiled ops in {installed}"
    with ThreadPoolExecutor(2) as pool:
        found = pool.map(lambda so: _fatbin_kernels(cuobjdump, so), sos)
    return [(f"{so.name}:{mangled}", _kernel_names(mangled)[:3], code)
            for so, kernels in zip(sos, found) for mangled, code in kernels.items()]


def test_kernel_names_and_where_code_runs():
    """The two readings the test below rests on, on names and code lists
    whose answers are known."""
    assert _kernel_names("_ZN16marlin_moe_wna166MarlinILl1125899906909952ELi256EEEvPK4int4")[:2] \
        == ["marlin_moe_wna16", "Marlin"]
    assert _kernel_names("_Z8moe_q4_KIN3c104HalfELb0EEvPKvS3_PT_PKiS7_S7_iiiiiii")[:3] \
        == ["moe_q4_K", "c10", "Half"]
    assert _kernel_names("_Z16dequantize_blockILi32ELi1EXadL_ZN45_INTERNAL_880c9d68_14_gguf_"
                         "kernel_cu_0362292215dequantize_q8_0EPKviiR7__half2EE")[:3] \
        == ["dequantize_block", "_INTERNAL_880c9d68_14_gguf_kernel_cu_03622922", "dequantize_q8_0"]
    assert _runs_on({("sass", "sm_120")}, 120) and not _runs_on({("sass", "sm_120")}, 90)
    assert _runs_on({("ptx", "sm_80")}, 120) and _runs_on({("ptx", "sm_80")}, 90)
    assert not _runs_on({("sass", "sm_90")}, 120) and not _runs_on({("sass", "sm_100")}, 120)
    assert not _runs_on({("sass", "sm_86"), ("ptx", "sm_90a")}, 120)
    assert _runs_on({("sass", "sm_90a")}, 90) and not _runs_on({("ptx", "sm_100")}, 90)


def _op_kernels(fatbin_kernels, op: str) -> dict[str, set[tuple[str, str]]]:
    pattern = re.compile(SM120_PATH_KERNELS[op])
    namespace = _NAMESPACE.get(op)
    kernels = {key: code for key, names, code in fatbin_kernels
               if any(pattern.fullmatch(n) for n in names)
               and (namespace is None or namespace in names[:2])}
    assert kernels, f"{op}: no kernel named {pattern.pattern} in the installed ops"
    return kernels


@pytest.mark.parametrize("op", sorted(SM120_PATH_KERNELS))
def test_compiled_kernels_of_the_sm120_path_run_on_sm120(fatbin_kernels, op):
    """The wheel's compiled kernels that the series' path launches on an
    RTX PRO 6000 / RTX 5090 run there: each is sm_120 code or PTX the driver
    compiles for it, at least wherever an H200 (SM 9.0) could run it. No
    SM120 GPU here: read from the installed extensions' fat binaries."""
    kernels = _op_kernels(fatbin_kernels, op)
    on_sm120 = [k for k, code in kernels.items() if _runs_on(code, 120)]
    assert on_sm120, f"{op}: none of its {len(kernels)} kernels runs on SM 12.0"
    missing = [k for k, code in kernels.items() if _runs_on(code, 90) and k not in on_sm120]
    assert not missing, f"{op}: runs on SM 9.0 but not on SM 12.0: {missing[:3]}"


# Ops of the SM120 path whose kernels vLLM 0.23 builds without sm_120 code
# ("7.5;8.0+PTX"): the driver compiles their PTX at first use there. The
# others, the GEMMs among them, carry sm_120 code: compiling Marlin's from
# PTX takes about a minute a kernel (as SM90 does).
SM120_FROM_PTX = {"gptq_marlin_repack (0028)"}


@pytest.mark.parametrize("op", sorted(SM120_PATH_KERNELS))
def test_which_kernels_of_the_sm120_path_compile_from_ptx_there(fatbin_kernels, op):
    """An RTX PRO 6000 / RTX 5090 runs the path's kernels from the wheel's
    sm_120 code, but for SM120_FROM_PTX's, compiled at their first call."""
    kernels = _op_kernels(fatbin_kernels, op)
    sass = {k for k, code in kernels.items()
            if _runs_on({c for c in code if c[0] == "sass"}, 120)}
    if op in SM120_FROM_PTX:
        assert not sass, f"{op}: now has sm_120 code ({sorted(sass)[:2]}): update SM120_FROM_PTX"
    else:
        ptx_only = [k for k, code in kernels.items() if _runs_on(code, 120) and k not in sass]
        assert not ptx_only, f"{op}: runs on SM 12.0 from PTX only: {ptx_only[:3]}"
