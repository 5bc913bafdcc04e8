"""The C++ CPU kernels (``kernels/csrc``) behind the reference's signatures.

Each op falls back to ``kernels.reference`` for shapes the extension does not
cover (a width that is not a multiple of the SIMD width, an unsupported head
size or dtype), so callers never need to know which one ran. The native ops
may update their inputs in place where the reference returns new tensors
(the residual of ``add_rms_norm``, q and k of ``rope``); callers use only
the returned tensors, which is correct for both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from stallfree.kernels import reference
from stallfree.kernels.attention_meta import AttentionMeta
from stallfree.kernels.linear import Linear

_DTYPES = (torch.float32, torch.bfloat16)
_HEAD_DIMS = (16, 32, 64, 128, 256)
_LANES = 16  # widest SIMD width (AVX-512 floats); sizes divisible by it suit every build

ops = torch.ops.stallfree


def _rows_ok(x: torch.Tensor, multiple: int = _LANES) -> bool:
    return x.dim() == 2 and x.dtype in _DTYPES and x.stride(1) == 1 and x.shape[1] % multiple == 0


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Both caches in one call: a row copy a token (two index_copy_ calls cost more than the copies)."""
    heads_contiguous = all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
    if not (heads_contiguous and k.dtype == v.dtype == k_cache.dtype and k_cache.is_contiguous()):
        return reference.write_kv(k_cache, v_cache, k, v, slot_mapping)
    ops.write_kv(k_cache, v_cache, k, v, slot_mapping)


def linear(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """Decode-sized float32 batches read the layer's compact weights; the rest go to oneDNN."""
    if layer.compact is not None and x.dim() == 2 and x.shape[0] <= layer.COMPACT_ROWS and x.dtype == torch.float32:
        return layer.compact(x.contiguous(), layer.bias)
    return layer(x)


def linear_silu_mul(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """A gated layer on the dot-product kernel in one pass (``gemm_dot_silu``); else the two ops."""
    if layer.gated and layer.dot is not None and x.dtype == torch.bfloat16 and x.dim() == 2:
        return ops.gemm_dot_silu(x, layer.dot)
    return silu_mul(linear(layer, x))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float().contiguous()
    if not _rows_ok(xf):
        return reference.rms_norm(x, weight, eps)
    if xf is x:  # the op writes its residual argument; never the caller's tensor
        xf = xf.clone()
    return ops.add_rms_norm(xf, xf, weight, eps, False)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual (float32) += x in place; returns (rms_norm(residual), residual)."""
    if not (_rows_ok(x) and residual.dtype == torch.float32 and residual.is_contiguous()):
        return reference.add_rms_norm(x, residual, weight, eps)
    return ops.add_rms_norm(x, residual, weight, eps, True), residual


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    if not _rows_ok(x, 2 * _LANES):
        return reference.silu_mul(x)
    return ops.silu_mul(x)


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q and k (views of the QKV projection)."""
    d = q.shape[-1]
    if q.dtype not in _DTYPES or d % (2 * _LANES) or q.stride(1) != d or k.stride(1) != d or q.stride(2) != 1:
        return reference.rope(q, k, positions, cos_sin)
    ops.rope(q, k, positions.contiguous(), cos_sin)
    return q, k


def brgemm_dtypes() -> set[torch.dtype]:
    """The dtypes whose prefill attention tiles run on oneDNN's brgemm here."""
    mask = ops.attention_brgemm(True)
    return {dt for bit, dt in ((1, torch.float32), (2, torch.bfloat16)) if mask & bit}


def amx_tiles() -> bool:
    """Whether bf16 attention (heads of 64) runs on AMX's own instructions
    here: prefill tiles, rather than through oneDNN's brgemm, and decode
    scores, rather than the dot-product loop (``kernels/csrc/attention.cpp``)."""
    return bool(ops.attention_amx(True))


@contextmanager
def brgemm_tiles() -> Iterator[None]:
    """bf16 prefill attention tiles through oneDNN's brgemm, and decode scores
    on the dot-product loop, even where AMX's own instructions would run
    them, for tests and benchmarks."""
    ops.attention_amx(False)
    try:
        yield
    finally:
        ops.attention_amx(True)


@contextmanager
def hand_written_tiles() -> Iterator[None]:
    """Prefill attention tiles on the hand-written kernel inside the block
    (the path of a machine without brgemm), for tests and benchmarks."""
    ops.attention_brgemm(False)
    try:
        yield
    finally:
        ops.attention_brgemm(True)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta, scale: float
) -> torch.Tensor:
    if q.dtype not in _DTYPES or q.shape[-1] not in _HEAD_DIMS or q.shape[1] // k_cache.shape[2] > 16:
        return reference.paged_attention(q, k_cache, v_cache, meta, scale)
    return ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start, scale)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest entry (kernels/csrc/argmax.cpp); other dtypes and layouts the reference."""
    if not (logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1 and logits.shape[1] > 0):
        return reference.argmax(logits)
    return ops.argmax_rows(logits)
