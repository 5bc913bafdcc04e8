#!/usr/bin/env bash
# OpenVINO GenAI for the side-by-side benchmark, in its own venv (bench/peers/openvino/.venv),
# with optimum-intel to export the model. Facts this follows (issue 49): a plain install pulls a
# CUDA torch through torchvision, so the CPU torch is pinned (pip takes torch==2.13.0 from local
# disk here); PyPI's torchvision is CUDA-linked and breaks `import transformers`: removed.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
test -x .venv/bin/python || "$PYTHON" -m venv .venv
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q "torch==2.13.0" "openvino==2026.4.1" "openvino-tokenizers==2026.4.1.0" \
  "openvino-genai==2026.4.1.0" "optimum-intel==2.2.0"
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
.venv/bin/python -c "import openvino_genai, transformers; print('openvino_genai', openvino_genai.__version__)"
