#!/usr/bin/env bash
# The embedded SmolLM2 as an OpenVINO model (bench/peers/openvino/smollm2-ov), from the same
# Hugging Face directory vLLM serves (bench/peers/vllm/convert.sh writes it from the GGUF): the
# same weights for every engine. fp32 holds the bf16 weights exactly; the engine computes in bf16
# (engine.py sets INFERENCE_PRECISION_HINT and KV_CACHE_PRECISION).
set -euo pipefail
cd "$(dirname "$0")"
HF=../vllm/smollm2-hf
test -d "$HF" || bash ../vllm/convert.sh
HF_HUB_OFFLINE=1 .venv/bin/optimum-cli export openvino --model "$HF" \
  --task text-generation-with-past --weight-format fp32 smollm2-ov
