"""Compact weight copies for decode-sized float32 GEMMs on CPU.

A decode step reads every weight of the model once, so on a CPU without
bf16 arithmetic its time is the bytes of the float32 weights. Where those
weights are exactly a narrower format (a GGUF file's Q4_1 or Q8_0 blocks, or
values that are all bf16), the C++ kernels read that format and widen it in
registers to the very same float32 values (``kernels/csrc/gemm.cpp``); only
the order of the sums differs. The layouts are made here once, at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

QK = 32  # GGUF quantization block along the input dimension


@dataclass(frozen=True, slots=True)
class Quantized:
    """A weight's rows as stored in a GGUF file: ``kind`` (``Q4_1`` or
    ``Q8_0``) and ``blocks`` (uint8, one row of blocks per output row)."""

    KINDS: ClassVar[tuple[str, ...]] = ("Q4_1", "Q8_0")

    kind: str
    blocks: torch.Tensor  # [N, K / 32 * block bytes]


@dataclass(frozen=True, slots=True)
class CompactWeight:
    """One weight packed for ``torch.ops.stallfree.gemm_<kind>`` (layouts in gemm.cpp)."""

    kind: str  # bf16 | q8_0 | q4_1
    tensors: tuple[torch.Tensor, ...]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return getattr(torch.ops.stallfree, f"gemm_{self.kind}")(x, *self.tensors, bias)


def compact_weight(weight: torch.Tensor, quantized: Quantized | None) -> CompactWeight | None:
    """The narrowest exact copy of a float32 ``weight`` [N, K], or None when
    there is none (or its shape does not suit the kernel)."""
    width = torch.ops.stallfree.simd_width()
    n, k = weight.shape
    if n % (2 * width) or k % QK:
        return None
    if quantized is not None and quantized.kind == "Q4_1":
        return _q4_1(quantized.blocks, n, k, width)
    if quantized is not None and quantized.kind == "Q8_0":
        return _q8_0(quantized.blocks, n, k, width)
    narrow = weight.to(torch.bfloat16)
    if torch.equal(narrow.float(), weight):
        cols = narrow.view(n // (2 * width), 2 * width, k)
        return CompactWeight("bf16", (cols.transpose(1, 2).contiguous(),))
    return None


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """A float16 field at byte ``at`` of each block, as float32 [N, K/32]."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _by_column_block(x: torch.Tensor, width: int) -> torch.Tensor:
    """[N, K/32, ...] -> [N / 2W, K/32, ..., 2W]: each block's 2W output columns innermost."""
    n = x.shape[0]
    x = x.reshape(n // (2 * width), 2 * width, *x.shape[1:])
    return x.movedim(1, -1).contiguous()


def _q8_0(raw: torch.Tensor, n: int, k: int, width: int) -> CompactWeight:
    blocks = raw.reshape(n, k // QK, 2 + QK)
    q = blocks[..., 2:].contiguous().view(torch.int8)
    return CompactWeight("q8_0", (_by_column_block(_half(blocks, 0), width), _by_column_block(q, width)))


def _q4_1(raw: torch.Tensor, n: int, k: int, width: int) -> CompactWeight:
    blocks = raw.reshape(n, k // QK, 4 + QK // 2)
    nibbles = blocks[..., 4:]
    q = _by_column_block(torch.cat([nibbles & 15, nibbles >> 4], dim=-1), width)  # [N/2W, K/32, 32, 2W]
    packed = q[..., :width] | (q[..., width:] << 4)
    d, m = (_by_column_block(_half(blocks, at), width) for at in (0, 2))
    return CompactWeight("q4_1", (d, m, packed.contiguous()))
