#!/usr/bin/env bash
# `make bench`: time the series' kernels against their peers in the same run
# (FlashMLA sparse and DeepGEMM from the pinned wheel) on this machine's GPU,
# using the installed wheel. Writes bench/results/*_<card>.md (+ PNG plot).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"

scripts/install-wheel.sh
if ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  echo "error: make bench needs a CUDA GPU, and torch in $VENV sees none" >&2
  exit 1
fi
"$PY" -m pip install -q matplotlib
card=$("$PY" -c 'import torch; print(torch.cuda.get_device_name().split()[-1].lower())')
out=bench/results

printf '\n==> sparse MLA (bench/bench_sparse_mla.py)\n'
"$PY" bench/bench_sparse_mla.py --out "$out/sparse_mla_$card.md" \
  --accuracy-out "$out/sparse_mla_accuracy_$card.md"
"$PY" bench/plot_sparse_mla.py "$out/sparse_mla_$card.md"

printf '\n==> DSA indexer (bench/bench_dsa_indexer.py)\n'
# DeepGEMM as the pinned wheel ships it: vllm/third_party/deep_gemm.
third_party=$("$PY" -c 'import os, vllm; print(os.path.join(os.path.dirname(vllm.__file__), "third_party"))')
"$PY" bench/bench_dsa_indexer.py --deep-gemm "$third_party" --out "$out/dsa_indexer_$card"

printf '\nresults: %s/*_%s* (series %s, repo commit %s)\n' "$out" "$card" \
  "$(python3 scripts/series.py version)" "$(git rev-parse --short HEAD)"
