#!/usr/bin/env bash
# `make bench-engine`: the engine as users run it — `vllm serve` on GGUF
# files of the real models' width, driven by `vllm bench serve` — for the
# series' path, upstream's (FLASHMLA_SPARSE + DeepGEMM, bf16) and llama.cpp
# (llama-server, llama-bench) on the same files, in the same run. Data:
# <results>/<card>/engine.jsonl, rendered to engine.md next to it.
#
#   scripts/run-bench-engine.sh [--quick] [--stage prepare|run|all] [--results DIR]
#                               [--no-install] [--no-llama-cpp] [-- bench_engine.py run arguments]
#     --quick         GLM-5 TP-8 Q4_K_M; single stream 4k, 32 concurrent 2k/512, prefill 16k;
#                     ours vs upstream vs llama.cpp (~11 min of one H200 for `--stage run`: each vLLM server
#                     takes ~3 min to start, measured 2026-12-02)
#     --stage         prepare: install, llama.cpp (CUDA) and the GGUF files, in parallel;
#                     run: the benchmark and engine.md; all (default): both
#     --results DIR   results root instead of bench/results
#     --no-install    use $VENV as it is
#     --no-llama-cpp  leave the llama.cpp peer out (no CUDA build)
#     after --:       more `bench/bench_engine.py run` arguments (--files, --paths,
#                     --workloads, --budget-s, --rounds, --start-together)
#
# Environment: WHEELHOUSE=<dir> (install from `make wheelhouse` output with pip --no-index,
# as make test-gpu does; WHEELHOUSE_NO_DEPS=1 likewise), LLAMA_CPP_SRC=<dir or archive of
# `PYTHONPATH=scripts bench/bench_engine.py pack-llama-src`> (else the pinned sdist),
# E2E_LLAMA_CPP=<converter
# archive> (else from the sdist; defaults to the wheelhouse's), BENCH_ENGINE_MODELS (default
# build/bench-engine/models).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
CLI=bench/bench_engine.py
# The prepare stage's commands take the pinned llama.cpp from scripts/ (patchseries).
PREPARE_PATH="scripts${PYTHONPATH:+:$PYTHONPATH}"
MODELS=${BENCH_ENGINE_MODELS:-build/bench-engine/models}

quick=0 install=1 llama=1 stage=all results=bench/results
run_args=()
while [ $# -gt 0 ]; do
  case $1 in
    --quick) quick=1 ;;
    --no-install) install=0 ;;
    --no-llama-cpp) llama=0 ;;
    --stage) stage=${2:?--stage needs prepare, run or all}; shift ;;
    --results) results=${2:?--results needs a folder}; shift ;;
    --) shift; run_args=("$@"); break ;;
    *) echo "error: run-bench-engine.sh: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
case $stage in prepare|run|all) ;; *) echo "error: --stage $stage: prepare, run or all" >&2; exit 2 ;; esac
sel=()
[ "$quick" = 1 ] && sel=(--quick)
# --files after -- picks the files of both stages
for ((i = 0; i < ${#run_args[@]}; i++)); do
  case ${run_args[i]} in
    --files) sel+=(--files "${run_args[i+1]:-}") ;;
    --files=*) sel+=("${run_args[i]}") ;;
  esac
done
step() { printf '\n==> %s\n' "$*"; }

if [ "$stage" != run ] && [ "$install" = 1 ]; then
  if [ -n "${WHEELHOUSE:-}" ]; then
    [ -d "$WHEELHOUSE" ] || { echo "error: WHEELHOUSE=$WHEELHOUSE is not a folder" >&2; exit 2; }
    version=$(python3 scripts/series.py version)
    [ -x "$PY" ] || python3 -m venv "$VENV"
    step "install vllm $version from $WHEELHOUSE (no index)"
    if [ -n "${WHEELHOUSE_NO_DEPS:-}" ]; then
      "$PY" -m pip install -q --no-index --no-deps "$WHEELHOUSE"/*.whl
    else
      "$PY" -m pip install -q --no-index --find-links "$WHEELHOUSE" "vllm==$version" \
        -r tests/requirements.txt -r tests/requirements-gpu.txt
    fi
  else
    scripts/install-wheel.sh
    "$PY" -m pip install -q -r tests/requirements-gpu.txt
  fi
fi
if [ -n "${WHEELHOUSE:-}" ] && [ -z "${E2E_LLAMA_CPP:-}" ] && [ -f "$WHEELHOUSE/llama.cpp-converter.tar.gz" ]; then
  export E2E_LLAMA_CPP=$WHEELHOUSE/llama.cpp-converter.tar.gz
fi

if ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  echo "error: make bench-engine needs a CUDA GPU, and torch in $VENV sees none" >&2
  exit 1
fi
export PYTHONUNBUFFERED=1

if [ "$stage" != run ]; then
  what="GGUF files ($MODELS)"
  [ "$llama" = 1 ] && what="$what and llama.cpp with CUDA, in parallel"
  step "prepare: $what"
  t0=$SECONDS
  pids=()
  mkdir -p build
  if [ "$llama" = 1 ]; then
    # the GGUF builder gets most cores; nvcc jobs are memory-bound, not core-bound
    PYTHONPATH=$PREPARE_PATH "$PY" "$CLI" build-llama-cpp > build/bench-engine-llama-cpp.log 2>&1 &
    pids+=($!)
  fi
  PYTHONPATH=$PREPARE_PATH "$PY" "$CLI" build-models "${sel[@]}" --out "$MODELS" &
  models_pid=$!
  rc=0
  wait "$models_pid" || rc=$?
  for pid in "${pids[@]}"; do
    wait "$pid" || { echo "error: llama.cpp build failed (build/bench-engine-llama-cpp.log):" >&2
                     tail -30 build/bench-engine-llama-cpp.log >&2; rc=1; }
  done
  [ "$rc" = 0 ] || exit "$rc"
  echo "prepare: $((SECONDS - t0)) s"
fi

if [ "$stage" != prepare ]; then
  paths=()
  given=0  # the caller's own --paths (after --) is the only one the record names
  for a in "${run_args[@]}"; do case "$a" in --paths|--paths=*) given=1 ;; esac; done
  if [ "$llama" = 0 ] && [ "$given" = 0 ]; then
    if [ "$quick" = 1 ]; then paths=(--paths triton-fp16,flashmla-bf16)
    else paths=(--paths triton-fp16,auto-sm120,flashmla-bf16); fi
  fi
  step "run (bench/bench_engine.py run)"
  rc=0
  quick_arg=()
  [ "$quick" = 1 ] && quick_arg=(--quick)
  "$PY" "$CLI" run "${quick_arg[@]}" --models "$MODELS" --results "$results" "${paths[@]}" \
    "${run_args[@]}" || rc=$?
  step "render"
  "$PY" "$CLI" render --results "$results"
  exit "$rc"
fi
