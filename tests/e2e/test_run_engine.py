"""run_engine's process handling, on CPU: a test run stopped with SIGTERM
(`timeout`, a CI runner) ends the engines it launched, which run in
sessions of their own."""

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
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                          start_new_session=True)
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
        assert f"engine returncode {-signal.SIGKILL}" in out, out
        assert "later: not started, the test run is stopping" in out, out
        deadline = time.monotonic() + 10
        while _alive(engine) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(engine)
    finally:
        if _alive(engine):
            os.killpg(engine, signal.SIGKILL)
        run.kill()
