#!/usr/bin/env bash
# Ferry on one NVIDIA GPU, on a fresh machine without internet that has torch and triton (issues 38 and 41):
#   bash scripts/gpu_check.sh OUT_DIR [--budget-s SECONDS] [--smoke]
# Installs the wheels in .whl/ if any (scripts/gpu_wheels.sh made them; FERRY_GPU_WHEELS names another folder),
# generates the gRPC stubs, then runs benchmarks/gpu/check.py, which writes OUT_DIR/summary.json and the steps'
# logs as OUT_DIR/logs.tgz. --smoke: the same steps at tiny shapes on the CPU (tests/deploy/test_gpu_check.py).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR [--budget-s SECONDS]}
shift
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WHEELS=${FERRY_GPU_WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE=${FERRY_GPU_SITE:-/tmp/ferry-site}
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
    || { echo "[gpu_check] installing .whl failed" >&2; exit 2; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c "from setup import generate_grpc_stubs; generate_grpc_stubs()" || { echo "[gpu_check] protoc failed" >&2; exit 2; }
"$PY" -m benchmarks gpu-check "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -r "$OUT/logs"   # one file: the device tool returns few
exit "$status"
