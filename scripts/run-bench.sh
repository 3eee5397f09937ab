#!/usr/bin/env bash
# `make bench`: time the series' kernels against their peers in the same run
# (FlashMLA sparse and DeepGEMM from the pinned wheel; ggml's GGUF kernels
# against dequantize + the float kernels) on this machine's GPU,
# using the installed wheel. Each bench writes its data,
# <results>/<card>/<bench>.jsonl; bench/render.py then renders the tables and
# the plot next to them. Nothing else is written (analysis lives in
# docs/performance.md).
#
#   scripts/run-bench.sh [--quick] [--results DIR] [--no-install]
#     --quick        a few cases of each bench (a smoke test, minutes)
#     --results DIR  results root instead of bench/results (e.g. for --quick)
#     --no-install   use $VENV as it is (no wheel build/install)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"

quick=0 install=1 results=bench/results
while [ $# -gt 0 ]; do
  case $1 in
    --quick) quick=1 ;;
    --no-install) install=0 ;;
    --results) results=${2:?--results needs a folder}; shift ;;
    *) echo "error: run-bench.sh: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done

if [ "$install" = 1 ]; then scripts/install-wheel.sh; fi
if ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  echo "error: make bench needs a CUDA GPU, and torch in $VENV sees none" >&2
  exit 1
fi

# The benches use the test support package (tests/support: references, peer loaders).
export PYTHONPATH="tests${PYTHONPATH:+:$PYTHONPATH}"

mla_args=() dsa_args=() gguf_args=()
if [ "$quick" = 1 ]; then
  mla_args=(--dtypes bf16 --heads 8 64 --sq 1 64)
  dsa_args=(--skip sweep --rep 20)
  gguf_args=(--quick --shapes glm5-tp8)
fi

printf '\n==> sparse MLA (bench/bench_sparse_mla.py)\n'
"$PY" bench/bench_sparse_mla.py --results "$results" "${mla_args[@]}"

printf '\n==> DSA indexer (bench/bench_dsa_indexer.py)\n'
# DeepGEMM as the pinned wheel ships it: vllm/third_party/deep_gemm.
third_party=$("$PY" -c 'import os, vllm; print(os.path.join(os.path.dirname(vllm.__file__), "third_party"))')
dsa_rc=0
"$PY" bench/bench_dsa_indexer.py --deep-gemm "$third_party" --results "$results" "${dsa_args[@]}" \
  || dsa_rc=$?

printf '\n==> GGUF kernels (bench/bench_gguf_gemm.py)\n'
"$PY" bench/bench_gguf_gemm.py --results "$results" "${gguf_args[@]}"

printf '\n==> render (bench/render.py)\n'
"$PY" bench/render.py --results "$results"
if [ "$dsa_rc" != 0 ]; then
  echo "error: the DSA indexer bench failed checks or sections (exit $dsa_rc; see above and its data)" >&2
  exit "$dsa_rc"
fi
