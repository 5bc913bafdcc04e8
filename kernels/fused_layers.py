"""A Llama model's decoder layers in one native call (``kernels/csrc/layers.cpp``).

Where every linear layer of the model runs on the dot-product kernel (bf16 on
AVX512-BF16 without AMX: ``Linear.dot``), the layer loop runs in C++: the
same ops in the same order on the same tensors, so the same results, bit for
bit, without a return to the interpreter between a layer's ten ops. That
return is serial work: on two threads the other one waits for it at the next
op, and the more threads the larger its share of a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stallfree.kernels.attention_meta import AttentionMeta
from stallfree.kernels.linear import Linear

_LANES = 16  # the native element-wise ops' vector width (kernels.cpu_ops)
_HEAD_DIMS = (32, 64, 128, 256)  # native RoPE (half a head in whole vectors) and attention


@dataclass(frozen=True, slots=True)
class FusedLayers:
    """Each layer's norms and packed weights, as ``stallfree::dot_layers`` takes them."""

    input_norms: list[torch.Tensor]
    post_norms: list[torch.Tensor]
    qkv: list[torch.Tensor]
    qkv_bias: list[torch.Tensor | None]
    o: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    heads: int
    kv_heads: int

    @staticmethod
    def over(
        input_norms: list[torch.Tensor],
        qkv: list[Linear],
        o: list[Linear],
        post_norms: list[torch.Tensor],
        gate_up: list[Linear],
        down: list[Linear],
        heads: int,
        kv_heads: int,
        head_dim: int,
    ) -> FusedLayers | None:
        """The layers as one native call, or None where the Python loop would
        take another path for any op: a layer off the dot kernel (float32,
        AMX, another CPU), a gate/up not packed gated, an output the loop
        rounds differently, or shapes the native RoPE or attention refuse."""
        hidden = input_norms[0].numel()
        dot = all(layer.dot is not None and layer.bias is None for layer in (*o, *gate_up, *down)) and all(
            layer.dot is not None for layer in qkv
        )
        rounding = all(g.gated for g in gate_up) and not any(q.float_out for q in qkv)
        rounding = rounding and all(layer.float_out for layer in (*o, *down))
        norms = all(n.dtype == torch.bfloat16 and n.is_contiguous() for n in (*input_norms, *post_norms))
        shapes = hidden % _LANES == 0 and head_dim in _HEAD_DIMS and heads % kv_heads == 0 and heads // kv_heads <= 16
        if not (dot and rounding and norms and shapes):
            return None
        return FusedLayers(
            input_norms,
            post_norms,
            [q.dot for q in qkv if q.dot is not None],
            [q.bias for q in qkv],
            [layer.dot for layer in o if layer.dot is not None],
            [layer.dot for layer in gate_up if layer.dot is not None],
            [layer.dot for layer in down if layer.dot is not None],
            heads,
            kv_heads,
        )

    def __call__(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMeta,
        scale: float,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, the residual stream) for the embedded
        tokens ``h`` (float32, updated in place as the residual), as the
        Python loop gives them; the step's K and V written to the caches."""
        out = torch.ops.stallfree.dot_layers(
            h,
            positions.contiguous(),
            cos_sin,
            self.input_norms,
            self.post_norms,
            self.qkv,
            self.qkv_bias,
            self.o,
            self.gate_up,
            self.down,
            k_cache,
            v_cache,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start,
            self.heads,
            self.kv_heads,
            scale,
            eps,
        )
        return out[0], out[1]
