#!/bin/bash
# Runs the TRITON_MLA_SPARSE backend tests (tests/backend, GPU ones
# included) and the backend timing on a GPU machine without vLLM, from the
# pieces scripts/gpu/prepare_backend_h200.sh packed. Results go to $OUT
# (default ./out).
#
#   scripts/gpu/backend_h200.sh [PACKDIR]     (default wip/b-h200)
#
# PYTEST_ARGS (default tests/backend) selects tests; BENCH=0 skips timing.
set -uo pipefail
PACK=${1:-wip/b-h200}
OUT=${OUT:-out}
SITE=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

tar -C "$SITE" -xJf "$PACK/vllm-tree.tar.xz" || exit 1
xz -dc "$PACK/C_stable.so.xz" >"$SITE/vllm/_C_stable_libtorch.abi3.so" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$SITE" "$PACK"/whl/*.whl || exit 1
# Newer kernel modules under wip/pkg (work in progress) win over the pack's.
for K in wip/pkg/vllm/v1/attention/ops/*.py; do
    [ -f "$K" ] && cp "$K" "$SITE/vllm/v1/attention/ops/"
done
# vllm._C (43 MB) registers ops none of these tests use; vllm.platforms.cuda
# only imports it, so an empty stand-in is enough here.
[ -e "$SITE/vllm/_C.abi3.so" ] || : >"$SITE/vllm/_C.py"
export PYTHONPATH=$SITE

{
    date -u +"date: %Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
    python3 -c 'from vllm.platforms import current_platform as p; print("platform", type(p).__name__, p.get_device_capability())'
    sha256sum "$SITE/vllm/v1/attention/ops/triton_sparse_mla.py" \
        "$SITE/vllm/v1/attention/ops/triton_sparse_mla_sm90.py" \
        "$SITE/vllm/v1/attention/backends/mla/triton_mla_sparse.py" \
        "$SITE/vllm/platforms/cuda.py"
} 2>&1 | tee "$OUT/env.txt"

python3 -m pytest -v -p no:cacheprovider ${PYTEST_ARGS:-tests/backend} 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
if [ "${BENCH:-1}" != 0 ]; then
    timeout 150 python3 scripts/gpu/bench_backend_h200.py 2>&1 | tee "$OUT/bench.md"
fi
exit $rc
