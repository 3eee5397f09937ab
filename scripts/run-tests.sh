#!/usr/bin/env bash
# `make test`: build and install the wheel into $VENV, lint (ruff check, from
# $VENV), then run pytest from the repository root against that installation.
# PYTEST_MARK=gpu runs only the GPU tests (make test-gpu); they need the
# end-to-end models (make e2e-models, built here when missing).
# WHEELHOUSE=<dir> installs from a `make wheelhouse` folder with pip
# --no-index instead of building (a GPU machine without a package index);
# WHEELHOUSE_NO_DEPS=1 installs the folder's wheels as they are, for a
# machine whose Python already has the rest (torch, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

# make test-gpu on a machine without a GPU: every test would skip itself and
# the run would pass. Stop instead: before the install where the venv has torch
# already, else right after it, before the models are built.
gpu_checked=
check_gpu() {
  local gpus
  gpus=$("$VENV/bin/python" -c \
    'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)') || exit 1
  if [ "$gpus" = 0 ]; then
    echo "error: no CUDA GPU found (torch.cuda.is_available() is False in $VENV); make test-gpu" \
         "needs one (the CPU suite is make test)" >&2
    exit 1
  fi
  gpu_checked=1
}
if [ "${PYTEST_MARK:-}" = gpu ] && [ -x "$VENV/bin/python" ] \
   && "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  check_gpu
fi

if [ -n "${WHEELHOUSE:-}" ]; then
  [ -d "$WHEELHOUSE" ] || { echo "error: WHEELHOUSE=$WHEELHOUSE is not a folder" >&2; exit 2; }
  version=$(python3 scripts/series.py version)
  ls "$WHEELHOUSE"/vllm-"$version"-*.whl >/dev/null 2>&1 || {
    echo "error: $WHEELHOUSE has no wheel of this series ($version); run make wheelhouse" >&2; exit 2; }
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  printf '\n==> install vllm %s from %s (no index)\n' "$version" "$WHEELHOUSE"
  if [ -n "${WHEELHOUSE_NO_DEPS:-}" ]; then
    "$VENV/bin/python" -m pip install -q --no-index --no-deps "$WHEELHOUSE"/*.whl
  else
    "$VENV/bin/python" -m pip install -q --no-index --find-links "$WHEELHOUSE" "vllm==$version" \
      -r tests/requirements.txt -r tests/requirements-gpu.txt
  fi
  export E2E_LLAMA_CPP=${E2E_LLAMA_CPP:-$WHEELHOUSE/llama.cpp-converter.tar.gz}
  export LLAMA_CPP_SRC=${LLAMA_CPP_SRC:-$WHEELHOUSE/llama.cpp-src.tar.gz}
else
  scripts/install-wheel.sh
  [ "${PYTEST_MARK:-}" = gpu ] && "$VENV/bin/python" -m pip install -q -r tests/requirements-gpu.txt
fi

if [ "${PYTEST_MARK:-}" = gpu ]; then
  [ -n "$gpu_checked" ] || check_gpu
  # a requirement missing from the Python would otherwise show only as every
  # engine failing at start
  printf '\n==> engine imports\n'
  "$VENV/bin/python" scripts/check_engine_imports.py
  export E2E_MODELS=${E2E_MODELS:-build/e2e}
  printf '\n==> end-to-end models (%s)\n' "$E2E_MODELS"
  # the folders it imports from besides its own, as pytest's pythonpath (pyproject.toml) has them
  PYTHONPATH="scripts:tests${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" tests/e2e/models.py \
    build "$E2E_MODELS"
fi

# make test lints too (CI runs make test); make test-gpu does not.
if [ "${PYTEST_MARK:-}" != gpu ]; then
  printf '\n==> ruff check\n'
  "$VENV/bin/python" -m ruff check .
  # the series' files under vLLM's own rules, in the vllm-src/ the wheel's build made
  printf '\n==> ruff in vllm-src/ (the series, vLLM rules)\n'
  if [ -d vllm-src/.git ]; then
    "$VENV/bin/python" scripts/series.py lint
  else
    echo "no vllm-src/ (the wheel came from WHEELHOUSE): not linted"
  fi
fi

printf '\n==> pytest\n'
# Under make test, GPU tests skip themselves, with the reason, where there is no GPU.
exec "$VENV/bin/python" -m pytest tests ${PYTEST_MARK:+-m "$PYTEST_MARK"} -ra "$@"
