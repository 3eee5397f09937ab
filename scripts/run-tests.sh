#!/usr/bin/env bash
# `make test`: build the wheel, install it into $VENV the way users install it,
# then run pytest from the repository root against that installation.
# PYTEST_MARK=gpu runs only the GPU tests (make test-gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

./build.sh

version=$(python3 scripts/series.py version)
wheel=$(ls dist/vllm-"$version"-*.whl)
printf '\n==> install %s into %s\n' "$wheel" "$VENV"
"$VENV/bin/python" -m pip install -q "$wheel"
# Separately: transformers 5 is outside what one of vLLM's requirements
# (xgrammar) declares, which pip reports as a warning here, not a failure.
"$VENV/bin/python" -m pip install -q -r tests/requirements.txt

printf '\n==> pytest\n'
# GPU tests skip themselves, with the reason, where there is no GPU.
exec "$VENV/bin/python" -m pytest tests ${PYTEST_MARK:+-m "$PYTEST_MARK"} -ra "$@"
