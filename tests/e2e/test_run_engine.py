"""run_engine's process handling, on CPU: a test run stopped with SIGTERM
(`timeout`, a CI runner) ends the engines it launched, which run in
sessions of their own; an engine past E2E_ENGINE_TIMEOUT ends with its
Python stacks in its log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from cases import HERE

# A stand-in for pytest: one engine in its own session, registered as
# launch() registers it, then waiting as pytest waits for the engines.
_RUN = r"""
import subprocess, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import run_engine

run_engine.stop_on_sigterm()
engine = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c",
                           "import time; time.sleep(300)"], start_new_session=True)
run_engine._RUNNING.add(engine.pid)
try:
    print(engine.pid, flush=True)  # in the try: the signal may come at once
    time.sleep(300)
except KeyboardInterrupt as e:
    print("interrupted:", e, flush=True)
engine.wait(30)
print("engine returncode", engine.returncode, flush=True)
print(run_engine.launch({"gguf": "x.gguf"}, Path(sys.argv[2]), "later", {}), flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_kills_the_running_engines_and_interrupts_the_run(tmp_path):
    run = subprocess.Popen([sys.executable, "-c", _RUN, str(HERE), str(tmp_path)],
                           stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    engine = int(run.stdout.readline())
    try:
        assert _alive(engine)
        run.send_signal(signal.SIGTERM)
        out, _ = run.communicate(timeout=60)
        assert "interrupted: signal 15" in out, out
        # SIGABRT first: faulthandler's stacks, then the end
        assert f"engine returncode {-signal.SIGABRT}" in out, out
        assert "later: not started, the test run is stopping" in out, out
        deadline = time.monotonic() + 10
        while _alive(engine) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(engine)
    finally:
        if _alive(engine):
            os.killpg(engine, signal.SIGKILL)
        run.kill()


def test_an_engine_past_its_timeout_ends_with_its_stacks_in_the_log(tmp_path, monkeypatch):
    """The engine that does not finish in E2E_ENGINE_TIMEOUT: its error
    names the limit, and its log where it was (faulthandler on SIGABRT)."""
    import run_engine

    monkeypatch.setenv("E2E_ENGINE_TIMEOUT", "1")
    # run_engine.py waits on its case file's engine; here it never gets past
    # Python's start (a case it cannot read would end it at once)
    monkeypatch.setattr(run_engine, "HERE", tmp_path)
    (tmp_path / "run_engine.py").write_text("import time\ntime.sleep(300)\n")
    result = run_engine.launch({"gguf": "x.gguf"}, tmp_path, "hung", dict(os.environ))
    assert "did not finish in 1 s (E2E_ENGINE_TIMEOUT)" in result["error"], result
    log = (tmp_path / "hung.log").read_text()
    assert "Fatal Python error: Aborted" in log and "run_engine.py" in log, log
