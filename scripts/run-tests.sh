#!/usr/bin/env bash
# `make test`: build the wheel, install it into $VENV the way users install it,
# then run pytest from the repository root against that installation.
# PYTEST_MARK=gpu selects the GPU tests instead of the CPU ones.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

./build.sh

version=$(python3 scripts/series.py version)
wheel=$(ls dist/vllm-"$version"-*.whl)
printf '\n==> install %s into %s\n' "$wheel" "$VENV"
"$VENV/bin/python" -m pip install -q "$wheel" -r tests/requirements.txt

printf '\n==> pytest\n'
mark=${PYTEST_MARK:-not gpu}
exec "$VENV/bin/python" -m pytest tests -m "$mark" -ra "$@"
