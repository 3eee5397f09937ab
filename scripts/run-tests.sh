#!/usr/bin/env bash
# `make test`: build and install the wheel into $VENV, then run pytest from
# the repository root against that installation.
# PYTEST_MARK=gpu runs only the GPU tests (make test-gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

scripts/install-wheel.sh

printf '\n==> pytest\n'
# GPU tests skip themselves, with the reason, where there is no GPU.
exec "$VENV/bin/python" -m pytest tests ${PYTEST_MARK:+-m "$PYTEST_MARK"} -ra "$@"
