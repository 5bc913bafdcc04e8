#!/usr/bin/env bash
# vLLM cannot load GGUF on CPU: write the embedded SmolLM2 GGUF as a Hugging Face
# directory (bf16 safetensors, tokenizer.json, chat template) with stallfree's own
# loader. Both engines then serve this same directory, so the weights are identical.
set -euo pipefail
cd "$(dirname "$0")"
../../../.venv/bin/stallfree export "${1:-smollm2-hf}"
