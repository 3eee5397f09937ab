"""The engine profile (bench/engine/step_profile.py, `bench_engine.py profile`)
on CPU: kernel names to the issue's categories, a worker trace cut into
steps (made-up traces in the torch profiler's format), the scenario driver
against a fake server, and the rendered record."""

from __future__ import annotations

import gzip
import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchdata import BenchData, read
from engine import record
from engine import step_profile as profile


@pytest.mark.parametrize("kernel, expected", [
    ("_sparse_mla_fwd_kernel", "sparse attention"),
    ("_sparse_mla_merge_kernel", "sparse attention"),
    ("sparse_mla_sm90_split_kernel", "sparse attention"),
    ("void flash::flash_fwd_splitkv_mla_fp8_sparse_kernel<Traits>(Params)", "sparse attention"),
    ("void flash::flash_fwd_mla_combine_kernel<cutlass::bfloat16_t, 512, 8>(Params)",
     "sparse attention"),
    ("_indexer_k_quant_and_cache_kernel", "indexer: K cache write"),
    ("void vllm::indexer_k_quant_and_cache_kernel<c10::Half>(...)", "indexer: K cache write"),
    ("_fp8_paged_mqa_logits_kernel", "indexer: logits"),
    ("void deep_gemm::sm90_fp8_paged_mqa_logits<64u, 128u>(...)", "indexer: logits"),
    ("void vllm::topKPerRowDecode<1024>(...)", "indexer: top-k"),
    (("void vllm::persistent::persistent_topk_kernel<2048, 4u>(vllm::persistent::"
      "PersistentTopKParams)"), "indexer: top-k"),
    ("void vllm::concat_and_cache_mla_kernel<c10::Half, c10::Half>(...)", "MLA KV cache write"),
    ("void moe_q4_K<c10::Half, false>(void const*, ...)", "GGUF MoE"),
    ("void moe_vec_q<c10::Half, 256, 32, block_q4_K, 16, &vec_dot_q4_K_q8_1>(...)", "GGUF MoE"),
    ("fused_moe_kernel", "GGUF MoE"),
    ("_gguf_moe_gemm_kernel", "GGUF MoE"),
    ("_dequantize_kernel", "GGUF dequantize"),
    ("_dequantize_iq_kernel", "GGUF dequantize"),
    ("void dequantize_block<32, 2, &dequantize_q8_0, c10::Half>(...)", "GGUF dequantize"),
    ("void mul_mat_q4_K<c10::Half, false>(void const*, ...)", "GGUF linears"),
    ("void mul_mat_vec_q<c10::Half, 256, 8, block_q6_K, 1, &vec_dot_q6_K_q8_1>(...)",
     "GGUF linears"),
    ("void quantize_q8_1<c10::Half>(c10::Half const*, void*, int, int)", "GGUF linears"),
    ("void vllm::moe::grouped_topk_fused_kernel<float>(...)", "MoE routing"),
    ("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64", "dense GEMMs"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_TNN", "dense GEMMs"),
    ("void vllm::fused_add_rms_norm_kernel<c10::Half, 8>(...)",
     "norms, RoPE, quantization, elementwise"),
    ("triton_poi_fused_add_mul_0", "norms, RoPE, quantization, elementwise"),
    ("ncclDevKernel_AllReduce_Sum_f16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all-reduce"),
    ("some_new_kernel", "other"),
])
def test_kernel_categories(kernel, expected):
    assert profile.category(kernel) == expected


class _Trace:
    """A worker trace in the torch profiler's chrome format."""

    def __init__(self):
        self.events: list[dict] = []
        self.corr = 0

    def step(self, ts: float, dur: float, ctx: int, ctx_tokens: int, gen: int) -> None:
        name = f"execute_context_{ctx}({ctx_tokens})_generation_{gen}({gen})"
        self.events.append({"ph": "X", "cat": "user_annotation", "name": name, "ts": ts,
                            "dur": dur, "pid": 1, "tid": 1})
        # kineto mirrors annotations onto the GPU timeline: not steps
        self.events.append({"ph": "X", "cat": "gpu_user_annotation", "name": name, "ts": ts,
                            "dur": dur * 3, "pid": 0, "tid": 7})

    def scope(self, name: str, ts: float, dur: float) -> None:
        self.events.append({"ph": "X", "cat": "user_annotation", "name": name, "ts": ts,
                            "dur": dur, "pid": 1, "tid": 1})

    def launch(self, at: float, kernels: list[tuple[str, float, float]],
               api: tuple[str, str] = ("cuda_runtime", "cudaGraphLaunch")) -> None:
        """One launch on the CPU at ``at`` (a graph: several kernels), through
        ``api`` (category, name): Triton launches through the driver."""
        self.corr += 1
        self.events.append({"ph": "X", "cat": api[0], "name": api[1],
                            "ts": at, "dur": 5, "args": {"correlation": self.corr}})
        for name, ts, dur in kernels:
            self.events.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                                "args": {"correlation": self.corr}})

    def dict(self) -> dict:
        return {"traceEvents": self.events}


def _decode_trace() -> _Trace:
    """Six decode steps 1000 µs apart: a graph of attention (300 µs) and a
    GEMM overlapping it (200 µs, 100 of them alongside), then the sampler's
    argmax (50 µs) launched in its scope after the step's annotation; and a
    4096-token prefill step."""
    t = _Trace()
    for i in range(6):
        s = 10_000 + 1000 * i
        t.step(s, 400, 0, 0, 1)
        t.launch(s + 10, [("_sparse_mla_fwd_kernel", s + 100, 300),
                          ("nvjet_gemm", s + 300, 200)])
        # vLLM samples after the step's annotation ends (sample_tokens)
        t.scope(profile.SAMPLE_SCOPE, s + 450, 50)
        t.launch(s + 460, [("argmax_kernel", s + 600, 50)])
    # a kernel nobody launched inside a step (before the first): not counted
    t.launch(5_000, [("_sparse_mla_fwd_kernel", 5_100, 999)])
    p = 20_000
    t.step(p, 500, 1, 4096, 0)
    t.launch(p + 20, [("void mul_mat_q4_K<c10::Half, false>", p + 100, 2000),
                      ("void moe_q4_K<c10::Half, false>", p + 2100, 1000)])
    # a Triton kernel of the same step, launched through the driver API
    t.launch(p + 30, [("_dequantize_kernel", p + 3100, 400)],
             api=("cuda_driver", "cuLaunchKernelEx"))
    # a short request's prefill: not the long prompt's
    t.step(30_000, 100, 1, 16, 0)
    t.launch(30_010, [("nvjet_gemm", 30_050, 10)])
    return t


def test_summary_cuts_the_trace_into_steps():
    s = profile.summarize(_decode_trace().dict())
    d = s["decode"]
    # 6 decode steps, the first two skipped, and the last: the next step is
    # no decode step
    assert d["steps"] == 3
    assert d["batch"] == {"ctx_requests": 0, "ctx_tokens": 0, "gen_requests": 1}
    assert d["step_us"] == pytest.approx(1000)
    # busy: [100, 500) and [600, 650): 450 µs
    assert d["gpu_busy_us"] == pytest.approx(450)
    assert d["categories_us"] == {"sparse attention": 300, "dense GEMMs": 200, "sampler": 50}
    assert d["top_kernels"][0] == {"kernel": "_sparse_mla_fwd_kernel",
                                   "category": "sparse attention", "us": 300}
    p = s["prefill"]
    assert p["steps"] == 1 and p["batch"]["ctx_tokens"] == 4096
    assert p["step_us"] == pytest.approx(3500 - 0)  # start to the last kernel's end
    assert p["gpu_busy_us"] == pytest.approx(3400)
    assert p["categories_us"] == {"GGUF linears": 2000, "GGUF MoE": 1000,
                                  "GGUF dequantize": 400}
    # the driver-launched kernel ran outside any graph; the graphs' did not
    assert p["outside_graphs_us"] == {"GGUF dequantize": 400}
    assert d["outside_graphs_us"] == {}


def test_summary_refuses_a_trace_without_steps():
    with pytest.raises(ValueError, match="no engine steps"):
        profile.summarize({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k",
                                            "ts": 0, "dur": 1}]})


def test_load_trace_reads_gzip(tmp_path):
    path = tmp_path / "worker.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_decode_trace().dict(), f)
    assert profile.summarize(profile.load_trace(path))["decode"]["steps"] == 3


class _FakeServer(http.server.ThreadingHTTPServer):
    """/v1/completions (streamed: a chunk every 10 ms until the client goes;
    plain: one answer), /start_profile, /stop_profile (writes a trace into
    trace_dir a moment later, as the worker does)."""

    daemon_threads = True

    def __init__(self, trace_dir: Path):
        self.trace_dir, self.calls, self.stall = trace_dir, [], None
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802 - the stdlib's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        self.server.calls.append((self.path, body))
        if self.path == "/stop_profile":
            def write():
                out = self.server.trace_dir / "worker.pt.trace.json.gz"
                with gzip.open(out, "wt") as f:
                    json.dump(_decode_trace().dict(), f)
            threading.Timer(0.3, write).start()
        self.send_response(200)
        self.end_headers()
        if self.path == "/v1/completions" and body.get("stream"):
            if self.server.stall and len(body["prompt"]) == self.server.stall:
                threading.Event().wait(2)  # a prefill that does not finish in time
                return
            try:
                for _ in range(body["max_tokens"]):
                    self.wfile.write(b'data: {"choices": [{"text": "x"}]}\n\n')
                    self.wfile.flush()
                    threading.Event().wait(0.01)
            except (BrokenPipeError, ConnectionResetError):
                return
        else:
            self.wfile.write(b"{}")


@pytest.fixture
def fake_server(tmp_path):
    server = _FakeServer(tmp_path)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_drive_decode_profiles_once_every_stream_decodes(fake_server, tmp_path):
    server, base = fake_server
    s = profile.Scenario("t", "decode", 3, 64, "")
    trace = profile.drive(base, "bench", s, 2000, tmp_path, seconds=0.2)
    assert trace.name == "worker.pt.trace.json.gz"
    paths = [p for p, _ in server.calls]
    assert paths.count("/v1/completions") == 3
    first_profile = paths.index("/start_profile")
    assert paths[:first_profile].count("/v1/completions") == 3  # all started before
    assert paths[first_profile + 1] == "/stop_profile"
    prompts = [b["prompt"] for p, b in server.calls if p == "/v1/completions"]
    assert all(len(p) == 64 and all(1000 <= t < 2000 for t in p) for p in prompts)
    assert len({tuple(p) for p in prompts}) == 3  # each stream its own prompt


def test_drive_decode_gives_up_on_streams_that_do_not_start(fake_server, tmp_path):
    """A server that never answers some streams costs start_timeout, not the
    HTTP timeout per stream, and the profile never starts."""
    server, base = fake_server
    server.stall = 64
    s = profile.Scenario("t", "decode", 3, 64, "")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"t: 0 of 3 streams produced a token within 0 s"):
        profile.drive(base, "bench", s, 2000, tmp_path, seconds=0.2, start_timeout=0.3)
    assert time.monotonic() - t0 < 1.5
    assert "/start_profile" not in [p for p, _ in server.calls]


def test_drive_prefill_profiles_around_one_request(fake_server, tmp_path):
    server, base = fake_server
    s = profile.Scenario("t", "prefill", 1, 128, "")
    profile.drive(base, "bench", s, 2000, tmp_path)
    assert [p for p, _ in server.calls] == ["/start_profile", "/v1/completions",
                                            "/stop_profile"]
    assert server.calls[1][1]["max_tokens"] == 1 and len(server.calls[1][1]["prompt"]) == 128


def test_profiler_config_parses_as_vllms_command_line_does(tmp_path):
    pytest.importorskip("vllm")
    from pydantic import TypeAdapter
    from vllm.config.profiler import ProfilerConfig

    # --profiler-config's type (vllm.engine.arg_utils: a dataclass field's JSON)
    cfg = TypeAdapter(ProfilerConfig).validate_json(profile.profiler_config(tmp_path))
    assert cfg.profiler == "torch" and cfg.torch_profiler_dir == str(tmp_path)
    assert cfg.ignore_frontend and not cfg.torch_profiler_with_stack


def test_profile_record_renders(tmp_path):
    data = BenchData("engine_profile", {"date_utc": "2026-12-02 10:00", "card": "NVIDIA H200",
                                        "series": "0.23.0+dsa.sm120.test"})
    summary = profile.summarize(_decode_trace().dict())
    for kind, scenario in (("decode", "decode-1-32k"), ("prefill", "prefill-16k")):
        data.row("profile", {"checkpoint": "glm5-tp8", "type": "q4_k_m", "path": "triton-fp16",
                             "scenario": scenario}, **summary[kind], trace="worker.json.gz",
                 command="python3 -m vllm.entrypoints.cli.main serve x.gguf")
    folder = tmp_path / "nvidia-h200"
    data.write(folder)
    assert record.render(tmp_path) == []
    md = (folder / "engine_profile.md").read_text()
    assert "| glm5-tp8 q4_k_m | decode-1-32k | triton-fp16 | 3 | 1000.0 | 450.0 | 550.0 |" in md
    assert "| sparse attention | 300.0 | 30.0 % | 0.0 |" in md
    assert "| GGUF dequantize | 400.0 | 11.4 % | 400.0 |" in md
    assert "4096 prompt tokens" in md
    assert record.render(tmp_path, check=True) == []


def test_profile_names_a_missing_file(tmp_path):
    cli = Path(__file__).resolve().parents[1] / "bench" / "bench_engine.py"
    r = subprocess.run([sys.executable, str(cli), "profile", "--quick", "--models",
                        str(tmp_path / "models"), "--work", str(tmp_path / "work"),
                        "--results", str(tmp_path / "results")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "glm5-tp8/build.json: missing; build the files first" in r.stderr
    assert "Traceback" not in r.stderr


def _stale_record(tmp_path) -> Path:
    """An engine_profile.jsonl whose rows name a trace under tmp_path/traces
    and carry figures that are not that trace's."""
    traces = tmp_path / "traces" / "glm5-tp8-q4_k_m-triton-fp16"
    traces.mkdir(parents=True)
    with gzip.open(traces / "worker.pt.trace.json.gz", "wt") as f:
        json.dump(_decode_trace().dict(), f)
    data = BenchData("engine_profile", {"date_utc": "2026-12-02 10:00", "card": "NVIDIA H200"})
    for scenario in ("decode-1-32k", "prefill-16k"):
        data.row("profile", {"checkpoint": "glm5-tp8", "type": "q4_k_m", "path": "triton-fp16",
                             "scenario": scenario}, steps=1, step_us=1.0, gpu_busy_us=0.5,
                 not_gpu_us=0.5, categories_us={}, top_kernels=[],
                 trace="worker.pt.trace.json.gz", command="vllm serve x.gguf")
    return data.write(tmp_path / "results" / "nvidia-h200")


def test_recut_replaces_the_figures_from_the_traces(tmp_path):
    path = _stale_record(tmp_path)
    assert profile.recut(path, tmp_path / "traces", "cut again") == []
    run, rows = read(path)
    assert run["notes"][-1] == "cut again"
    expected = profile.summarize(_decode_trace().dict())
    for r, kind in zip(rows, ("decode", "prefill")):
        assert r["figures"]["gpu_busy_us"] == expected[kind]["gpu_busy_us"]
        assert r["figures"]["categories_us"] == expected[kind]["categories_us"]
        assert r["figures"]["trace"] == "worker.pt.trace.json.gz"  # kept
        assert r["figures"]["command"] == "vllm serve x.gguf"


def test_recut_names_a_missing_trace_and_keeps_the_file(tmp_path):
    path = _stale_record(tmp_path)
    before = path.read_text()
    problems = profile.recut(path, tmp_path / "elsewhere", "cut again")
    assert len(problems) == 2
    assert "trace 'worker.pt.trace.json.gz' not under" in problems[0]
    assert path.read_text() == before


def test_recut_profile_command(tmp_path):
    _stale_record(tmp_path)
    cli = Path(__file__).resolve().parents[1] / "bench" / "bench_engine.py"
    r = subprocess.run([sys.executable, str(cli), "recut-profile", "--traces",
                        str(tmp_path / "traces"), "--results", str(tmp_path / "results")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "results" / "nvidia-h200" / "engine_profile.md").read_text()
    assert "| glm5-tp8 q4_k_m | decode-1-32k | triton-fp16 | 3 | 1000.0 | 450.0 | 550.0 |" in md
    assert "Steps cut again from the run's traces by `" in md
    assert str(tmp_path) not in md  # where the traces lay is no part of the record
