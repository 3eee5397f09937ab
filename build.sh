#!/usr/bin/env bash
# Build dist/vllm-<release>+dsa.sm120.<series>-*.whl from the pinned vLLM
# release plus patches/series.
#
#   BUILD_MODE=precompiled (default)  compiled ops come from the pinned upstream
#                                     wheel (sm_75 ... sm_120); no CUDA compile.
#   BUILD_MODE=source                 full CUDA build; TORCH_CUDA_ARCH_LIST
#                                     (default 12.0), MAX_JOBS and NVCC_THREADS
#                                     (vLLM's meaning: MAX_JOBS // NVCC_THREADS
#                                     jobs; default from cores and memory, see
#                                     scripts/patchseries/jobs.py).
#   VENV=<dir>        build environment (default .venv; made if missing)
#   VLLM_SRC=<dir>    use a clean vLLM git checkout at the pinned commit
#                     instead of the sdist
#   FORCE=1           rebuild even if the wheel for this series exists
#
# A wheel reaches dist/ only once it is built: a failed or interrupted build
# (Ctrl-C, SIGTERM) stops pip and all it started and leaves dist/ as it was.
set -euo pipefail
cd "$(dirname "$0")"

BUILD_MODE=${BUILD_MODE:-precompiled}
VENV=${VENV:-.venv}
case "$BUILD_MODE" in precompiled|source) ;;
  *) echo "error: BUILD_MODE must be precompiled or source, not '$BUILD_MODE'" >&2; exit 2;;
esac

step() { printf '\n==> %s\n' "$*"; }
series() { python3 scripts/series.py "$@"; }

# Checked first, so that a missing nvcc or a bad MAX_JOBS costs no torch install.
if [ "$BUILD_MODE" = source ]; then
  command -v nvcc >/dev/null || { echo "error: BUILD_MODE=source needs nvcc (CUDA toolkit) on PATH" >&2; exit 1; }
  parallelism=$(series jobs)  # MAX_JOBS NVCC_THREADS jobs; fails on a bad MAX_JOBS/NVCC_THREADS
  read -r max_jobs nvcc_threads jobs <<<"$parallelism"
fi

step "build environment ($VENV)"
TORCH_VERSION=$(series pin torch)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
build_deps=("torch==$TORCH_VERSION" "setuptools>=77.0.3,<81" "setuptools-scm>=8"
            "setuptools-rust>=1.9" "packaging>=24.2" "wheel" "jinja2>=3.1.6" "regex")
[ "$BUILD_MODE" = source ] && build_deps+=("cmake>=3.26.1" "ninja")
"$VENV/bin/python" -m pip install -q "${build_deps[@]}"

step "patched source (vllm-src/)"
series apply

VERSION=$(series version)
ARCHS=${TORCH_CUDA_ARCH_LIST:-12.0}
STAMP=precompiled
[ "$BUILD_MODE" = source ] && STAMP="source arch=$ARCHS"
mkdir -p dist build
existing=$(ls dist/vllm-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [ -n "$existing" ] && [ -z "${FORCE:-}" ] && [ "$(cat "$existing.mode" 2>/dev/null)" = "$STAMP" ]; then
  step "up to date: $existing ($STAMP); FORCE=1 rebuilds"
  exit 0
fi

# Build from a fresh copy of the committed tree so build products never
# dirty vllm-src/ (where patches are edited).
step "copy vllm-src/ to build/vllm"
rm -rf build/vllm && mkdir -p build/vllm
git -C vllm-src archive --format=tar HEAD | tar -x -C build/vllm

env_args=(VLLM_VERSION_OVERRIDE="$VERSION" VLLM_TARGET_DEVICE=cuda)
if [ "$BUILD_MODE" = precompiled ]; then
  step "pinned upstream wheel (compiled ops)"
  WHEEL=$(series fetch wheel)
  env_args+=(VLLM_USE_PRECOMPILED=1 VLLM_PRECOMPILED_WHEEL_LOCATION="$WHEEL")
else
  # vLLM's setup.py runs MAX_JOBS // NVCC_THREADS jobs (scripts/patchseries/jobs.py).
  env_args+=(TORCH_CUDA_ARCH_LIST="$ARCHS" MAX_JOBS="$max_jobs" NVCC_THREADS="$nvcc_threads")
  echo "TORCH_CUDA_ARCH_LIST=$ARCHS MAX_JOBS=$max_jobs NVCC_THREADS=$nvcc_threads:" \
       "$jobs nvcc jobs x $nvcc_threads threads"
fi

step "build wheel $VERSION ($BUILD_MODE); full log: build/wheel.log"
# pip writes the wheel (and its temporary files) into build/wheel.tmp; the
# wheel moves into dist/ only once it is built, so an interrupted or failed
# build leaves dist/ as it was. A killed run's leftovers go here.
out=build/wheel.tmp
rm -rf "$out" && mkdir -p "$out/tmp"
pip_pid=
stop_build() {  # stop pip and everything it started (its process group), drop its output
  if [ -n "$pip_pid" ]; then
    kill -TERM -- "-$pip_pid" 2>/dev/null || true
    wait "$pip_pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 -- "-$pip_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pip_pid" 2>/dev/null || true
    pip_pid=
  fi
  rm -rf "$out"
}
on_signal() {  # $1 signal, $2 what happened; then die of that signal, as make expects
  echo "build.sh: $2: the wheel build is stopped, dist/ is unchanged" >&2
  stop_build
  trap - EXIT "$1"
  kill -"$1" $$
}
trap stop_build EXIT
trap 'on_signal INT interrupted' INT
trap 'on_signal TERM terminated' TERM
trap 'on_signal HUP "hang-up"' HUP
start=$SECONDS
# The compiled ops are abi3: tag the wheel cp38-abi3 like upstream's, so it
# installs on every Python that vLLM supports, not only the one that built it.
# `set -m` gives pip a process group of its own, which stop_build ends; without
# it a backgrounded pip ignores Ctrl-C and outlives this script.
set -m
env TMPDIR="$PWD/$out/tmp" "${env_args[@]}" "$VENV/bin/python" -m pip wheel -v \
  --no-build-isolation --no-deps --config-settings=--build-option=--py-limited-api=cp38 \
  -w "$out" build/vllm >build/wheel.log 2>&1 </dev/null &
pip_pid=$!
set +m
# Progress: the build is quiet for minutes, so report what it is doing every
# 20 s; poll every second so that a signal is acted on at once.
ticks=0
while kill -0 "$pip_pid" 2>/dev/null; do
  sleep 1
  ticks=$((ticks + 1))
  [ $((ticks % 20)) -eq 0 ] || continue
  last=$(grep -E '^ *(\[extract\]|copying|running|adding|Building|\[[0-9]+/[0-9]+\])' build/wheel.log | tail -n1 || true)
  printf '  %4ss  %s\n' $((SECONDS - start)) "${last:0:110}"
done
if ! wait "$pip_pid"; then
  pip_pid=
  echo "error: wheel build failed (dist/ is unchanged); last lines of build/wheel.log:" >&2
  tail -n 40 build/wheel.log >&2
  exit 1
fi
pip_pid=
built=$(ls "$out"/vllm-"$VERSION"-*.whl)
name=${built##*/}
# The .mode stamp goes last: a wheel without one is rebuilt, never trusted.
rm -f "dist/$name.mode"
mv -f "$built" "dist/$name"
for old in dist/vllm-"$VERSION"-*.whl; do
  [ "$old" = "dist/$name" ] || rm -f "$old" "$old.mode"
done
echo "$STAMP" > "dist/$name.mode"
step "built dist/$name in $((SECONDS - start)) s"
