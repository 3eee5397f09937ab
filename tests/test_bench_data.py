"""Benchmark results as data (bench/benchdata.py) and the documents
rendered from them (bench/render.py), on CPU.

- The committed data re-render to the committed tables and plot, byte for
  byte, and a changed figure is caught.
- The card slug comes from the whole device name.
- What the bench scripts write (fake measurements) reads back and renders.
- Every bench script imports and parses its command line on CPU; a script
  is run, a helper module imported, never both.
"""

from __future__ import annotations

import ast
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import benchdata
from benchdata import BenchData, card_slug, read, results_dir

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
# How scripts/run-bench.sh runs the bench scripts: the test support package on the path.
BENCH_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    p for p in (str(REPO / "tests"), os.environ.get("PYTHONPATH")) if p))

RENDER = [sys.executable, str(BENCH / "render.py")]


def render(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*RENDER, *args], capture_output=True, text=True, timeout=300)


FAKE_ENV = {
    "date_utc": "2026-01-02 03:04",
    "card": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
    "sms": 188,
    "capability": "12.0",
    "driver": "999.1",
    "torch": "2.11.0",
    "triton": "3.6.0",
    "series": "0.23.0+dsa.sm120.test",
    "commit": "abc123",
    "command": "bench/x.py --fake",
}


# ---------------------------------------------------------------------------
# Card slug
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,slug",
    [
        ("NVIDIA H200", "nvidia-h200"),
        (
            "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
            "nvidia-rtx-pro-6000-blackwell-workstation-edition",
        ),
        (
            "NVIDIA RTX PRO 6000 Blackwell Server Edition",
            "nvidia-rtx-pro-6000-blackwell-server-edition",
        ),
        ("NVIDIA GeForce RTX 5090", "nvidia-geforce-rtx-5090"),
        ("  NVIDIA  B200 (MIG 1g.23gb) ", "nvidia-b200-mig-1g-23gb"),
    ],
)
def test_card_slug_is_the_whole_device_name(name, slug):
    assert card_slug(name) == slug


def test_card_slug_keeps_the_editions_apart():
    ws = card_slug("NVIDIA RTX PRO 6000 Blackwell Workstation Edition")
    server = card_slug("NVIDIA RTX PRO 6000 Blackwell Server Edition")
    assert ws != server


def test_card_slug_refuses_an_empty_name():
    with pytest.raises(ValueError, match="empty card slug"):
        card_slug(" -- ")


def test_results_dir_is_per_card(tmp_path):
    assert results_dir("NVIDIA H200") == REPO / "bench" / "results" / "nvidia-h200"
    assert results_dir("NVIDIA H200", tmp_path) == tmp_path / "nvidia-h200"


def test_command_line_keeps_no_machine_paths():
    venv = Path(sys.prefix)
    argv = [
        str(BENCH / "bench_dsa_indexer.py"),
        "--deep-gemm",
        str(venv / "lib" / "site-packages" / "vllm" / "third_party"),
        "--flashmla-so=/somewhere/deep/inside/_flashmla_C.abi3.so",
        "--results",
        "bench/results",
    ]
    assert benchdata.command_line(argv) == (
        "bench/bench_dsa_indexer.py --deep-gemm <venv>/lib/site-packages/vllm/third_party "
        "--flashmla-so=…/inside/_flashmla_C.abi3.so --results bench/results"
    )


# ---------------------------------------------------------------------------
# Committed data -> committed documents
# ---------------------------------------------------------------------------


def test_committed_tables_rerender_byte_for_byte():
    r = render("--check", "--no-png")
    assert r.returncode == 0, r.stdout + r.stderr


def test_committed_plot_rerenders_byte_for_byte():
    matplotlib = pytest.importorskip(
        "matplotlib", reason="matplotlib not installed (tests/requirements.txt pins it)"
    )
    r = render("--check")
    assert r.returncode == 0, (
        f"matplotlib {matplotlib.__version__} (pinned in tests/requirements.txt): "
        + r.stdout
        + r.stderr
    )


def test_check_catches_a_changed_figure(tmp_path):
    card = tmp_path / "nvidia-h200"
    shutil.copytree(benchdata.RESULTS / "nvidia-h200", card)
    path = card / "sparse_mla.jsonl"
    lines = path.read_text().splitlines()
    row = json.loads(lines[-1])
    row["figures"]["us"] += 1.0
    lines[-1] = json.dumps(row, ensure_ascii=False)
    path.write_text("\n".join(lines) + "\n")
    r = render("--check", "--no-png", "--results", str(tmp_path))
    assert r.returncode == 1
    assert "sparse_mla.md: differs" in r.stderr
    # Rendering writes only the generated files, and then they agree.
    before = {p.name: p.read_bytes() for p in card.iterdir()}
    assert render("--no-png", "--results", str(tmp_path)).returncode == 0
    changed = {p.name for p in card.iterdir() if p.read_bytes() != before.get(p.name)}
    assert changed == {"sparse_mla.md"}
    assert render("--check", "--no-png", "--results", str(tmp_path)).returncode == 0


def test_every_results_file_is_data_or_rendered_from_it():
    """bench/results/<card>/ holds only data and what render.py makes of it
    (backend_h200.md, printed by bench/bench_backend.py, sits outside)."""
    rendered = {
        "sparse_mla": {"sparse_mla.md", "sparse_mla_accuracy.md", "sparse_mla.png"},
        "sparse_mla_paths": {"sparse_mla_paths.md"},
        "sparse_mla_decode_bounds": {"sparse_mla_decode_bounds.md"},
        "dsa_indexer": {"dsa_indexer.md"},
        "gguf_gemm": {"gguf_gemm.md"},
        "engine": {"engine.md"},
        "engine_profile": {"engine_profile.md", "engine_estimate.md"},
    }
    for card in (p for p in benchdata.RESULTS.iterdir() if p.is_dir()):
        data = {p.stem for p in card.glob("*.jsonl")}
        allowed = {f"{b}.jsonl" for b in data} | set().union(
            *(rendered[b] for b in data)
        )
        assert {p.name for p in card.iterdir()} <= allowed, card


# ---------------------------------------------------------------------------
# What the scripts write, with fake measurements
# ---------------------------------------------------------------------------


def fake_sparse_mla(tmp_path: Path) -> Path:
    data = BenchData("sparse_mla", FAKE_ENV)
    data.figures.update(copy_tbps=1.5, matmul_tflops=400.0, empty_row_probe="probe text",
                        kv_pool_rows=32768)
    for h_q in (8, 64):
        for s_q in (1, 64):
            for kernel in ("triton", "flashmla"):
                data.row(
                    "timings",
                    {"dtype": "bf16", "h_q": h_q, "s_q": s_q, "kernel": kernel},
                    us=10.0 * s_q + h_q,
                    tflops=1.25,
                    gathered_tbps=0.5 * math.log2(2 * s_q),
                    x_roofline=0.333,
                    x_flashmla=None if kernel == "flashmla" else 1.5,
                )
    data.row(
        "accuracy",
        {"dtype": "fp16", "h_q": 8, "s_q": 1, "path": "auto"},
        rel_err=2.345e-4,
        lse_max_abs_err=1.5e-6,
        flashmla_rel_err=None,
    )
    data.row("sweep", {"case": "decode h8 s_q1", "config": [16, 32, 4, 3, True, False],
                       "num_splits": 4}, us=9.87)
    data.row("sweep", {"case": "decode h8 s_q1", "config": "auto", "num_splits": "auto"}, us=9.5)
    data.row(
        "pick_check",
        {"pick": "sm12x bucket 16", "config": [16, 64, 4, 2, False, False], "dtype": "bf16",
         "h_q": 8},
        rel_err=1.9e-3,
        ok=True,
    )
    return data.write(results_dir(FAKE_ENV["card"], tmp_path))


def test_written_data_reads_back(tmp_path):
    path = fake_sparse_mla(tmp_path)
    card = "nvidia-rtx-pro-6000-blackwell-workstation-edition"
    assert path == tmp_path / card / "sparse_mla.jsonl"
    assert not list(path.parent.glob("*.tmp"))
    run, rows = read(path)
    assert run["bench"] == "sparse_mla" and run["env"] == FAKE_ENV
    assert run["figures"]["copy_tbps"] == 1.5
    assert len(rows) == 12
    first = rows[0]
    assert first["inputs"] == {"dtype": "bf16", "h_q": 8, "s_q": 1, "kernel": "triton"}
    assert first["figures"]["us"] == 18.0 and first["figures"]["x_flashmla"] == 1.5


def test_a_killed_run_keeps_its_rows_beside_the_previous_file(tmp_path):
    previous = BenchData("gguf_gemm", FAKE_ENV)
    previous.row("dense", {"tokens": 1}, gguf_ms=9.0)
    path = previous.write(tmp_path)
    before = path.read_bytes()
    data = BenchData("gguf_gemm", FAKE_ENV)
    data.row("dense", {"tokens": 1}, gguf_ms=1.0)  # recorded before keep_partial
    partial = data.keep_partial(tmp_path)
    assert partial == tmp_path / "gguf_gemm.jsonl.partial"
    data.row("dense", {"tokens": 8}, gguf_ms=2.0)
    # killed here: the previous file as it was, every measured row in the partial
    assert path.read_bytes() == before
    run, rows = read(partial)
    assert run["bench"] == "gguf_gemm" and run["env"] == FAKE_ENV
    assert [r["figures"]["gguf_ms"] for r in rows] == [1.0, 2.0]
    assert list(tmp_path.glob("*.jsonl")) == [path]  # render reads *.jsonl only
    data.figures["seconds"] = 3.0
    assert data.write(tmp_path) == path
    assert not partial.exists()
    run, rows = read(path)
    assert run["figures"] == {"seconds": 3.0} and len(rows) == 2


def test_read_names_file_and_line_of_bad_data(tmp_path):
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"record": "run", "bench": "x", "env": {}}\n{not json\n')
    with pytest.raises(ValueError, match=r"x\.jsonl:2: not JSON"):
        read(bad)
    bad.write_text('{"record": "row", "table": "t", "inputs": {}, "figures": {}}\n')
    with pytest.raises(ValueError, match="run record first"):
        read(bad)


def test_fake_sparse_mla_renders(tmp_path):
    path = fake_sparse_mla(tmp_path)
    assert render("--no-png", "--results", str(tmp_path)).returncode == 0
    md = (path.parent / "sparse_mla.md").read_text()
    assert "| bf16 | 64 | 64 | triton | 704.0 | 1.2 | 3.50 | 0.33 | 1.50 |" in md
    assert "| bf16 | 64 | 64 | flashmla | 704.0 | 1.2 | 3.50 | 0.33 |  |" in md
    assert ("Card: NVIDIA RTX PRO 6000 Blackwell Workstation Edition (188 SMs, capability 12.0)"
            in md)
    assert "Series 0.23.0+dsa.sm120.test, repo commit abc123." in md
    assert "copy 1.50 TB/s (read+write), bf16 matmul 400 TFLOP/s" in md
    assert "kv pool 32,768 rows" in md  # the run's --kv-rows (committed runs: 262,144)
    assert "| decode h8 s_q1 | (16, 32, 4, 3, True, False) | 4 | 9.9 |" in md
    assert "| decode h8 s_q1 | auto | auto | 9.5 |" in md
    assert "| sm12x bucket 16 (16, 64, 4, 2, False, False) | bf16 h8 | 1.90e-03 | ok |" in md
    acc = (path.parent / "sparse_mla_accuracy.md").read_text()
    assert "| fp16 | 8 | 1 | auto | 2.35e-04 | 1.5e-06 |  |" in acc
    assert "\nprobe text\n" in acc


def test_fake_sparse_mla_plot_renders(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed")
    path = fake_sparse_mla(tmp_path)
    assert render("--results", str(tmp_path)).returncode == 0
    png = (path.parent / "sparse_mla.png").read_bytes()
    assert png.startswith(b"\x89PNG") and b"Software" not in png


def test_fake_paths_and_bounds_render(tmp_path):
    folder = results_dir(FAKE_ENV["card"], tmp_path)
    paths = BenchData("sparse_mla_paths", FAKE_ENV)
    paths.row("paths", {"mode": "sm12", "h_q": 8, "s_q": 4}, choice="decode/32", choice_us=12.44,
              fastest="decode/16", fastest_us=12.0, ratio=1.0367,
              times_us={"decode/32": 12.44, "decode/16": 12.0})  # fmt: skip
    paths.row("modes", {"mode": "sm12", "tables": "12.0", "sms": 188, "shared_per_sm": 102400},
              geo_mean=1.0367, worst=1.0367, within_5pct=1, cases=1)  # fmt: skip
    paths.write(folder)
    bounds = BenchData("sparse_mla_decode_bounds", FAKE_ENV)
    bounds.figures["copy_tbps"] = 1.5
    bounds.row("bounds", {"tables": "SM12x", "h_q": 8, "s_q": 1, "config": [16, 32, 4, 3],
                          "hoist": True, "gluon": False, "splits": 64},
               call_us=9.3, main_us=6.04, merge_us=3.26, l2_us=5.0,
               floor_us=4.7, floor_splits=64, copy_us=0.6, x_floor=1.98)  # fmt: skip
    bounds.row("sass", {"target": "sm_120", "path": "decode", "config": [16, 32, 4, 3],
                        "hoist": True},
               shared_bytes=93184, registers=191, instructions=659,
               counts={"HMMA": 68, "BAR": 21})  # fmt: skip
    bounds.write(folder)
    assert render("--no-png", "--results", str(tmp_path)).returncode == 0
    md = (folder / "sparse_mla_paths.md").read_text()
    assert "**sm12** (12.0 tables, 188 SMs, 102400 B of shared memory per SM" in md
    assert "| 8 | 4 | decode/32 | 12.4 | decode/16 | 12.0 | 1.04 |" in md
    assert ("sm12: choice / fastest option, geometric mean 1.037, worst 1.04, "
            "within 5 % in 1 of 1 cases.") in md
    md = (folder / "sparse_mla_decode_bounds.md").read_text()
    assert ("| SM12x | 8 | 1 | (16, 32, 4, 3) hoist × 64 | 9.3 | 6.0 | 3.3 | 5.0 | 4.7 (64) | "
            "0.6 | 1.98 |") in md
    assert "| HMMA | BAR |" in md
    assert "| sm_120 | decode (16, 32, 4, 3) hoist | 93184 | 191 | 659 | 68 | 21 |" in md


def test_dsa_indexer_smoke_writes_data_that_renders(tmp_path):
    """The indexer bench end to end on CPU (Triton interpreter, tiny
    shapes): its checks and its timing rows (no timings on CPU: NaN)."""
    env = dict(BENCH_ENV, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, str(BENCH / "bench_dsa_indexer.py"), "--smoke",
         "--skip", "sweep,decode_checks", "--results", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run, rows = read(tmp_path / "cpu-triton-interpreter" / "dsa_indexer.jsonl")
    assert run["env"]["smoke"] is True and run["env"]["commit"]
    tables = {r["table"] for r in rows}
    assert tables == {"checks", "timings"}
    assert all(r["figures"]["ok"] for r in rows if r["table"] == "checks")
    kinds = {r["inputs"]["kind"] for r in rows if r["table"] == "timings"}
    assert kinds == {"prefill", "decode"}
    assert render("--no-png", "--results", str(tmp_path)).returncode == 0
    md = (tmp_path / "cpu-triton-interpreter" / "dsa_indexer.md").read_text()
    assert "| prefill T=24 S=200 reqs=2 | nan |" in md
    assert "## Checks (" in md


# ---------------------------------------------------------------------------
# The scripts themselves
# ---------------------------------------------------------------------------


def _is_script(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(
        isinstance(n, ast.If)
        and isinstance(n.test, ast.Compare)
        and getattr(n.test.left, "id", None) == "__name__"
        for n in tree.body
    )


SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if _is_script(p))


def test_a_bench_file_is_a_script_or_a_module_not_both():
    modules = {p.stem for p in BENCH.glob("*.py")} - {Path(s).stem for s in SCRIPTS}
    assert {"benchdata", "harness"} <= modules
    for path in BENCH.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert f"{name}.py" not in SCRIPTS, f"{path.name} imports the script {name}.py"
        if path.name in SCRIPTS:
            assert os.access(path, os.X_OK), f"{path.name}: a script, not executable"


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_parses_its_command_line_on_cpu(script):
    r = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"],
        capture_output=True, text=True, timeout=300, env=BENCH_ENV,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "usage:" in r.stdout


def test_render_names_records_of_another_series():
    """A table's figures describe the series they were measured on: the
    renderer says so when that is not the checked-out one."""
    import render

    run = {"env": {"series": "0.23.0+dsa.sm120.aaaa"}}
    note = render.other_series(run, "0.23.0+dsa.sm120.bbbb")
    assert note and "0.23.0+dsa.sm120.aaaa" in note and "0.23.0+dsa.sm120.bbbb" in note
    assert render.other_series(run, "0.23.0+dsa.sm120.aaaa") is None


@pytest.mark.parametrize(
    "installed, expected",
    [
        (None, {"series": "0.23.0+dsa.sm120.bbbb"}),
        ("0.23.0+dsa.sm120.bbbb", {"series": "0.23.0+dsa.sm120.bbbb"}),
        ("0.23.0+dsa.sm120.aaaa",
         {"series": "0.23.0+dsa.sm120.aaaa", "series_checked_out": "0.23.0+dsa.sm120.bbbb"}),
    ],
)
def test_a_run_records_the_series_of_the_vllm_that_ran(monkeypatch, installed, expected):
    """A run measures the installed wheel, which need not be the checked-out
    tree's series (a branch checked out beside main's wheel); the header
    names both when they differ."""
    from importlib import metadata

    import render

    def version(name):
        if name != "vllm" or installed is None:
            raise metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(metadata, "version", version)
    assert benchdata.measured_series("0.23.0+dsa.sm120.bbbb") == expected
    head = render.header({"env": expected})[0]
    assert f"Series {expected['series']}" in head
    assert ("checked-out tree: 0.23.0+dsa.sm120.bbbb" in head) == ("series_checked_out" in expected)
