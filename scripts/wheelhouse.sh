#!/usr/bin/env bash
# `make wheelhouse`: every wheel the series' vLLM and its GPU tests need at
# run time, for one target Python and platform, in one folder, so a GPU
# machine without a package index (an air-gapped server) can install with
# `make test-gpu WHEELHOUSE=<folder>` (pip --no-index). Run it where the
# package index pip is configured with is reachable.
#
#   WHEELHOUSE=<dir>          output (default dist/wheelhouse)
#   WHEELHOUSE_PYTHON=3.12    the target's Python version
#   WHEELHOUSE_PLATFORM=x86_64 | aarch64
#   WHEELHOUSE_SKIP="torch torchvision torchaudio triton nvidia-*"
#                             requirements the target Python already has (names or
#                             globs as pip writes them): not downloaded, listed with
#                             their versions in SKIPPED.txt (the target must have
#                             each; scripts/patchseries/wheelhouse.py)
#
# Contents: the series' wheel (make build-wheel), its requirements and
# tests/requirements.txt resolved by pip for the target, the llama-cpp-python
# wheel (tests/requirements-gpu.txt) built from the sdist of llama-cpp-pin.txt
# (CPU build: the tests' llama.cpp oracle and quantizer), llama.cpp's converter
# (llama.cpp-converter.tar.gz) and its source (llama.cpp-src.tar.gz: `make
# e2e-models` builds llama-imatrix, llama-quantize and llama-gguf-split from
# it). Copy the folder in as many parts as you like; nothing in it is
# machine-specific but the platform.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${WHEELHOUSE:-dist/wheelhouse}
OUT=${OUT%/}
PY_VERSION=${WHEELHOUSE_PYTHON:-3.12}
ARCH=${WHEELHOUSE_PLATFORM:-x86_64}
step() { printf '\n==> %s\n' "$*"; }

# A complete wheelhouse is replaced; any other folder is not ours to delete.
if [ -e "$OUT" ] && [ ! -f "$OUT/MANIFEST.txt" ] && [ -n "$(ls -A "$OUT" 2>/dev/null || echo x)" ]; then
  echo "error: WHEELHOUSE=$OUT exists and is no complete wheelhouse (no MANIFEST.txt);" \
       "remove it or choose another folder" >&2
  exit 2
fi

./build.sh
version=$(python3 scripts/series.py version)
wheel=$(ls dist/vllm-"$version"-*.whl)
# Filled beside the output and moved into its place once complete: a failed
# or interrupted run (index unreachable, Ctrl-C) leaves $OUT as it was.
tmp="$OUT.partial"
rm -rf "$tmp"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp"
cp "$wheel" "$tmp/"

# Every manylinux tag a current distribution can run (pip matches tags exactly).
platforms=()
for n in $(seq 5 39); do platforms+=(--platform "manylinux_2_${n}_$ARCH"); done
# linux_*: the series wheel itself (built here, tagged like a local build).
platforms+=(--platform "manylinux1_$ARCH" --platform "manylinux2010_$ARCH" --platform "manylinux2014_$ARCH"
           --platform "linux_$ARCH")
target=(--only-binary=:all: --python-version "$PY_VERSION" --implementation cp "${platforms[@]}")
if [ -z "${WHEELHOUSE_SKIP:-}" ]; then
  step "requirements for Python $PY_VERSION on $ARCH -> $OUT"
  python3 -m pip download "${target[@]}" -d "$tmp" "$wheel" -r tests/requirements.txt
else
  step "requirements for Python $PY_VERSION on $ARCH -> $OUT, but $WHEELHOUSE_SKIP"
  # pip resolves for the target without downloading (metadata only where the
  # index serves it), then only the rest is downloaded, pinned as resolved
  python3 -m pip install -q --dry-run --ignore-installed "${target[@]}" \
    --target "$tmp/.resolve" --report "$tmp/.report.json" "$wheel" -r tests/requirements.txt
  python3 scripts/series.py wheelhouse-split "$tmp/.report.json" "$WHEELHOUSE_SKIP" \
    "$tmp/.download.txt" "$tmp/SKIPPED.txt"
  python3 -m pip download --no-deps "${target[@]}" -d "$tmp" -r "$tmp/.download.txt"
  rm -rf "$tmp/.resolve" "$tmp/.report.json" "$tmp/.download.txt"
fi

step "llama-cpp-python from the pinned sdist (CPU build, portable)"
python3 scripts/series.py llama-cpp wheel "$tmp"
python3 scripts/series.py llama-cpp converter "$tmp/llama.cpp-converter.tar.gz"
python3 scripts/series.py llama-cpp source "$tmp/llama.cpp-src.tar.gz"
( cd "$tmp" && ls -1 > MANIFEST.txt )
rm -rf "$OUT"
mv "$tmp" "$OUT"
trap - EXIT
du -sh "$OUT"
