#!/usr/bin/env bash
# Build the wheel and install it into $VENV the way users install it, plus
# what the tests and benchmarks need (tests/requirements.txt).
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
