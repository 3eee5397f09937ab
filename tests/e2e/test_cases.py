"""cases.py, the matrix of the end-to-end tests, on CPU."""

from __future__ import annotations

import os
import subprocess
import sys

from cases import HERE


def test_e2e_groups_naming_no_group_is_an_error():
    """E2E_GROUPS with a group cases.GROUPS lacks fails at import, naming it:
    left out without a word, it would read as a group that passed."""
    code = "import cases; print(len(cases.CASES))"
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**env, "E2E_GROUPS": "dsv32:q4_k_m,glm5:q4_k_s"})
    assert r.returncode != 0 and "glm5:q4_k_s" in r.stderr and "dsv32" not in r.stderr
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**env, "E2E_GROUPS": "dsv32:q4_k_m"})
    assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr
