"""Llama-family forward pass over a flattened ragged batch and a paged KV cache.

Plain tensors, no nn.Module: inference only. Q/K/V and gate/up projections
are fused into one matmul each (fewer, larger GEMMs). Hot ops go through
``kernels``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stallfree import kernels
from stallfree.core.model.model_config import ModelConfig


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: kernels.Linear  # [(heads + 2 * kv_heads) * head_dim, hidden] (+ bias for Qwen2)
    o: kernels.Linear
    post_norm: torch.Tensor
    gate_up: kernels.Linear  # [2 * ffn, hidden]
    down: kernels.Linear


def rope_cos_sin(config: ModelConfig, device: torch.device) -> torch.Tensor:
    """[max_position, head_dim]: cos of each frequency, then sin (float32)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = dict(config.rope_scaling or ())
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old / low) & (wavelen >= old / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r} (llama3, linear)")
    angles = torch.outer(torch.arange(config.max_position, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float().to(device)


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        quantized: dict[str, kernels.Quantized] | None = None,
        int8: bool = False,
    ) -> None:
        self.config = config
        self.dtype = dtype
        quantized = quantized or {}

        def w(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
            return weights[name].to(device=device, dtype=as_dtype).contiguous()

        def linear(
            *names: str,
            bias: torch.Tensor | None = None,
            as_dtype: torch.dtype = dtype,
            float_out: bool = False,
            body: bool = True,
            gated: bool = False,
        ) -> kernels.Linear:
            """One layer over the named weights stacked by rows (fused QKV, gate/up)."""
            weight = w(names[0], as_dtype) if len(names) == 1 else torch.cat([w(n, as_dtype) for n in names])
            blocks = [quantized.get(n) for n in names]
            kinds = {b.kind for b in blocks if b is not None}
            same = None not in blocks and len(kinds) == 1
            stacked = kernels.Quantized(kinds.pop(), torch.cat([b.blocks for b in blocks if b])) if same else None
            return kernels.Linear(weight, bias, stacked, float_out, int8=int8 and body, gated=gated)

        self.embed = w("model.embed_tokens.weight")
        # The head runs in float32 whatever the compute dtype: a greedy choice is
        # an argmax, and the embedded SmolLM2's top two first-token logits for
        # "What is the capital of France?" (25.325, 25.243) tie at bf16's 0.125
        # step. On CPU its compact copy (the GGUF's Q8_0 blocks) keeps decode's
        # cost; a chunk asks for only a few rows of logits.
        self.lm_head = linear(
            "model.embed_tokens.weight" if config.tie_embeddings else "lm_head.weight",
            as_dtype=torch.float32,
            body=False,
        )
        # rows that want only their argmax screen it at a bf16 GEMM's cost where that runs (AMX, AVX512-BF16)
        head = self.lm_head
        self.screen = kernels.ScreenedHead(head.weight) if kernels.ScreenedHead.available(head) else None
        self.final_norm = w("model.norm.weight", torch.float32)
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            bias = None
            if config.attention_bias:
                bias = torch.cat([weights[p + f"self_attn.{x}_proj.bias"] for x in "qkv"]).to(device, dtype)
            self.layers.append(
                LayerWeights(
                    input_norm=w(p + "input_layernorm.weight"),
                    qkv=linear(*(p + f"self_attn.{x}_proj.weight" for x in "qkv"), bias=bias),
                    # float32 outputs: they join the float32 residual stream unrounded
                    o=linear(p + "self_attn.o_proj.weight", float_out=True),
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", gated=True),
                    down=linear(p + "mlp.down_proj.weight", float_out=True),
                )
            )
        self._streamed_in_huge_pages()
        self.cos_sin = rope_cos_sin(config, device)
        self.scale = config.head_dim**-0.5
        layers = self.layers
        # the layers in one native call where every op of the loop below would run on the C++ kernels
        self.fused = kernels.FusedLayers.over(
            [x.input_norm for x in layers],
            [x.qkv for x in layers],
            [x.o for x in layers],
            [x.post_norm for x in layers],
            [x.gate_up for x in layers],
            [x.down for x in layers],
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )

    def _streamed_in_huge_pages(self) -> None:
        """The packed weights a decode step streams from memory, moved into huge
        pages (``kernels.huge_page_copies``): the layers' dot-kernel copies and
        the screen's. 32 decodes at 2 threads on the 2-core Zen 4: 1.035x
        (12 alternating pairs in one process)."""
        linears = [x for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        dots = [(x, x.dot) for x in linears if x.dot is not None]
        screen = [self.screen.packed] if self.screen is not None else []
        copies = kernels.huge_page_copies([dot for _, dot in dots] + screen)
        for (x, _), copy in zip(dots, copies, strict=False):
            x.dot = copy
        if self.screen is not None:
            self.screen.packed = copies[-1]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: kernels.AttentionMeta,
        k_cache: torch.Tensor,  # [layers, blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        logits_rows: torch.Tensor,  # rows whose next-token logits are wanted
        argmax_only: torch.Tensor | None = None,  # [len(logits_rows)] bool: the rows that want only their argmax
    ) -> torch.Tensor:
        """Logits (float32) for logits_rows; an ``argmax_only`` row's argmax is
        the float32 head's, its other values may be a screen's (``_head``)."""
        eps = self.config.rms_norm_eps
        h = self.embed[input_ids].float()
        if self.fused is not None and k_cache.dtype == self.dtype and kernels.native_in_use(h):
            h, residual = self.fused(h, positions, self.cos_sin, k_cache, v_cache, meta, self.scale, eps)
        else:
            h, residual = self._layers(h, positions, meta, k_cache, v_cache)
        last = (residual + h.float())[logits_rows]
        return self._head(kernels.rms_norm(last, self.final_norm, eps), argmax_only)

    def _layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        meta: kernels.AttentionMeta,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, the float32 residual stream) for the embedded tokens ``h``, op by op."""
        cfg = self.config
        t = h.shape[0]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        eps = cfg.rms_norm_eps
        residual = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual = h
                x = kernels.rms_norm(h, layer.input_norm, eps)
            else:
                x, residual = kernels.add_rms_norm(h, residual, layer.input_norm, eps)
            qkv = kernels.linear(layer.qkv, x)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q, k = kernels.rope(
                q.view(t, cfg.num_heads, cfg.head_dim),
                k.view(t, cfg.num_kv_heads, cfg.head_dim),
                positions,
                self.cos_sin,
            )
            v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
            if k_cache.dtype != q.dtype:  # a narrower KV cache (--kv-dtype): attention runs in its dtype
                q, k, v = q.to(k_cache.dtype), k.to(k_cache.dtype), v.to(k_cache.dtype)
            kernels.write_kv(k_cache[i], v_cache[i], k, v, meta.slot_mapping)
            attn = kernels.paged_attention(q, k_cache[i], v_cache[i], meta, self.scale).to(x.dtype)
            h = kernels.linear(layer.o, attn.view(t, q_size))
            x, residual = kernels.add_rms_norm(h, residual, layer.post_norm, eps)
            h = kernels.linear(layer.down, kernels.linear_silu_mul(layer.gate_up, x))
        assert residual is not None  # set by the first layer
        return h, residual

    def _head(self, x: torch.Tensor, argmax_only: torch.Tensor | None) -> torch.Tensor:
        """The float32 head; enough rows that want only their argmax take the
        screen where it runs (kernels.screened_head), the others the head whole."""
        screen = self.screen
        if screen is None or argmax_only is None or int(argmax_only.sum()) < screen.min_rows:
            return kernels.linear(self.lm_head, x).float()
        if bool(argmax_only.all()):
            return screen(x)
        logits = torch.empty(x.shape[0], self.lm_head.weight.shape[0], device=x.device)
        logits[argmax_only] = screen(x[argmax_only])
        logits[~argmax_only] = kernels.linear(self.lm_head, x[~argmax_only]).float()
        return logits
