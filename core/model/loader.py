"""Find and load a model: the embedded SmolLM2 GGUF, any GGUF, a Hugging Face
directory, or the tiny random model for tests.

Weights come back under Hugging Face names, with Q/K in Hugging Face
(rotate-half RoPE) order: llama.cpp stores them permuted for interleaved RoPE,
so GGUF Q/K rows are un-permuted here and the model has one RoPE layout.
Every failure names the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stallfree.core.model.embedded import TINY, ModelLoadError, embedded_model_path, load_tokenizer
from stallfree.core.model.gguf import GGUFError, GGUFFile
from stallfree.core.model.model_config import ModelConfig
from stallfree.core.model.tokenizer import Tokenizer
from stallfree.kernels.compact import Quantized


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face names, float32 or the file's float dtype
    tokenizer: Tokenizer
    source: str
    # a GGUF file's quantized blocks of the same weights (exactly what `weights` dequantizes)
    quantized: dict[str, Quantized] = field(default_factory=dict)


def load_model(path: str | None = None) -> LoadedModel:
    """``None``: the embedded SmolLM2-135M-Instruct; ``"tiny"``: random test model."""
    if path == TINY:
        return load_tiny()
    target = embedded_model_path() if path is None else Path(path)
    if not target.exists():
        raise ModelLoadError(f"model not found: {target}")
    try:
        if target.is_dir():
            return load_hf_dir(target)
        return load_gguf(target)
    except (GGUFError, ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"cannot load model {target}: {exc}") from None


# -- GGUF --------------------------------------------------------------------
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved -> rotate-half RoPE order);
    rows are output rows, of values or of quantized blocks."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_config(g: GGUFFile) -> ModelConfig:
    """The architecture from a GGUF file's metadata and tensor names."""
    meta = g.metadata
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unsupported architecture {arch!r} (llama, qwen2)")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"missing metadata {arch}.{name}")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens", [])
    return ModelConfig(
        name=str(meta.get("general.name", g.path.stem)),
        vocab_size=int(key("vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("rope.dimension_count", hidden // heads)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position=int(key("context_length")),
        tie_embeddings="output.weight" not in g.tensors,
        attention_bias="blk.0.attn_q.bias" in g.tensors,
    )


def load_gguf(path: Path) -> LoadedModel:
    g = GGUFFile(path)
    config = gguf_config(g)
    arch = g.metadata["general.architecture"]
    heads, kv_heads = config.num_heads, config.num_kv_heads
    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, Quantized] = {}
    for name in g.tensors:
        w = torch.from_numpy(g.array(name))
        ggml_type = g.type_name(name)
        blocks = torch.from_numpy(g.blocks(name).copy()) if ggml_type in Quantized.KINDS else None
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, layer, part, kind = name.split(".")
            if part not in _GGUF_LAYER_NAMES:
                continue
            hf = f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"
            if arch == "llama" and part in ("attn_q", "attn_k"):
                w = _unpermute(w, heads if part == "attn_q" else kv_heads)
                blocks = None if blocks is None else _unpermute(blocks, heads if part == "attn_q" else kv_heads)
        else:
            continue
        weights[hf] = w
        if blocks is not None:
            quantized[hf] = Quantized(ggml_type, blocks)
    _check_complete(weights, config, path)
    return LoadedModel(config, weights, Tokenizer.from_gguf_metadata(g.metadata), str(path), quantized)


# -- Hugging Face directory ---------------------------------------------------
def load_hf_dir(path: Path) -> LoadedModel:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config_path = path / "config.json"
    if not config_path.exists():
        raise ValueError(f"{config_path} not found (a Hugging Face model directory needs config.json)")
    cfg = json.loads(config_path.read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    if cfg.get("model_type") not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"unsupported model_type {cfg.get('model_type')!r} ({arch}); Llama/Qwen2 family only")
    heads = cfg["num_attention_heads"]
    scaling = cfg.get("rope_scaling")
    config = ModelConfig(
        name=path.name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=cfg.get("max_position_embeddings", 4096),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
        rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
    )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{f}: cannot read safetensors ({exc})") from None
    _check_complete(weights, config, path)
    return LoadedModel(config, weights, Tokenizer.from_hf_dir(path), str(path))


def _check_complete(weights: dict[str, torch.Tensor], config: ModelConfig, path: Path) -> None:
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_embeddings:
        needed.append("lm_head.weight")
    for i in range(config.num_layers):
        needed += [f"model.layers.{i}.{part}.weight" for part in _GGUF_LAYER_NAMES.values()]
    missing = [n for n in needed if n not in weights]
    if missing:
        raise ValueError(f"{path}: missing weights {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")


# -- tiny random model ----------------------------------------------------------
def load_tiny(seed: int = 0, config: ModelConfig | None = None) -> LoadedModel:
    """Random weights over the embedded model's tokenizer (fixed seed), in
    ``ModelConfig.tiny()``'s shapes or ``config``'s (q/k/v biases where it has them)."""
    config = config or ModelConfig.tiny()
    gen = torch.Generator().manual_seed(seed)
    h, f, d = config.hidden_size, config.intermediate_size, config.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.08

    weights = {"model.embed_tokens.weight": rand(config.vocab_size, h), "model.norm.weight": torch.ones(h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": 1 + rand(h),
            p + "self_attn.q_proj.weight": rand(config.num_heads * d, h),
            p + "self_attn.k_proj.weight": rand(config.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": rand(config.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": rand(h, config.num_heads * d),
            p + "post_attention_layernorm.weight": 1 + rand(h),
            p + "mlp.gate_proj.weight": rand(f, h),
            p + "mlp.up_proj.weight": rand(f, h),
            p + "mlp.down_proj.weight": rand(h, f),
        }
        if config.attention_bias:
            heads = {"q": config.num_heads, "k": config.num_kv_heads, "v": config.num_kv_heads}
            weights |= {p + f"self_attn.{x}_proj.bias": rand(n * d) for x, n in heads.items()}
    tokenizer = load_tokenizer()
    return LoadedModel(config, weights, tokenizer, TINY)
