"""Architecture of a Llama-family model (Llama, SmolLM, Qwen2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stallfree.core.analysis.cost_model import ModelSpec


@dataclass(slots=True, frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # items of HF's rope_scaling dict

    @property
    def num_params(self) -> int:
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * f + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def spec(self, bytes_per_param: float, kv_bytes_per_value: float | None = None) -> ModelSpec:
        """The cost model's view. Decode reads every weight but the embedding
        table (only a few rows of it) once per iteration; with tied
        embeddings the LM head still reads it, so it counts. The KV cache
        holds values of the weights' size unless told otherwise."""
        return ModelSpec(
            self.name,
            float(self.num_params),
            bytes_per_param,
            self.num_layers,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            kv_bytes_per_value=bytes_per_param if kv_bytes_per_value is None else kv_bytes_per_value,
        )

    @staticmethod
    def tiny() -> ModelConfig:
        """A few random layers over the real vocabulary, for fast tests."""
        return ModelConfig(
            name="tiny-random",
            vocab_size=49152,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            max_position=4096,
            tie_embeddings=True,
        )
