"""Write a loaded model as a Hugging Face directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json), so another engine
(vLLM) can serve exactly the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from stallfree.core.model.loader import LoadedModel


def export_hf_dir(loaded: LoadedModel, out: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    c = loaded.config
    tok = loaded.tokenizer
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in loaded.weights.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    eos = sorted(tok.eos_token_ids)
    config = {
        "architectures": ["Qwen2ForCausalLM" if c.attention_bias else "LlamaForCausalLM"],
        "model_type": "qwen2" if c.attention_bias else "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_bias": c.attention_bias,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "tokenizer.json").write_text(tok.to_hf_json())
    tok_config = {
        "chat_template": tok.chat_template,
        "eos_token": tok.eos_token,
        "bos_token": tok.bos_token,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": c.max_position,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2))
