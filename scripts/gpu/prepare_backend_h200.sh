#!/bin/bash
# Packs what scripts/gpu/backend_h200.sh needs to import the patched vLLM on
# a GPU machine whose image has torch + triton but no vLLM and no package
# index (the lent H200): the wheel's Python tree with the patched files laid
# over it, the one compiled extension the backend uses, and wheels of the
# pure dependencies the image lacks.
#
#   scripts/gpu/prepare_backend_h200.sh WHEEL SRC [OUTDIR]
#
# WHEEL: the pinned vllm-0.23.0 wheel; SRC: a patched vLLM source tree (e.g.
# vllm-src/); OUTDIR (default wip/b-h200, git-ignored) is what the device
# call carries. Needs pip with access to the package index, xz, unzip.
set -euo pipefail
WHEEL=$(realpath "$1")
SRC=$(realpath "$2")
OUTDIR=${3:-wip/b-h200}
mkdir -p "$OUTDIR/whl"
OUTDIR=$(realpath "$OUTDIR")
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

unzip -q "$WHEEL" 'vllm/*' 'vllm-*.dist-info/*' -d "$TMP"
# Platform detection reads the dist-info; keep it, drop the big binaries.
xz -T0 -6 -c "$TMP/vllm/_C_stable_libtorch.abi3.so" >"$OUTDIR/C_stable.so.xz"
find "$TMP/vllm" -name '*.so' -delete
rm -rf "$TMP/vllm/vllm-rs" "$TMP/vllm/third_party/deep_gemm/include"
(cd "$SRC" && find vllm -name '*.py') | while read -r f; do
    mkdir -p "$TMP/$(dirname "$f")"
    cp "$SRC/$f" "$TMP/$f"
done
tar -C "$TMP" -cJf "$OUTDIR/vllm-tree.tar.xz" vllm $(cd "$TMP" && ls -d vllm-*.dist-info)

# vLLM requirements missing on the H200 image that importing the attention
# backends and VllmConfig needs (found by importing with only the image's
# packages present).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$OUTDIR/whl" \
    annotated-types==0.8.0 cachetools==8.0.2 cbor2==6.3.0 gguf==0.19.0 \
    httpx2==2.16.2 msgspec==0.22.0 openai-harmony==0.0.8 openai==3.57.0 \
    pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 pyzmq==27.3.0 \
    sniffio==1.3.1 typing-inspection==0.4.5
du -sh "$OUTDIR"
