"""Triton kernels, each with the signature of its torch reference (kernels.reference).

The paged attention kernel runs a whole ragged batch in one launch: every
sequence (decode: one query; prefill chunk: many, causal, after a cached
prefix) gets programs over (query tile, query head), walks its block table
with an online softmax, and accumulates in fp32 (inputs are upcast right
after loading, which also keeps the CPU interpreter exact: it holds bf16 as
raw bits). Only ``tl.exp`` and friends are used (no libdevice), so every
kernel also runs under ``TRITON_INTERPRET=1`` on CPU tensors for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stallfree.kernels.attention_meta import AttentionMeta
from stallfree.kernels.linear import Linear


# -- RMSNorm (+ fused residual add) ----------------------------------------------
@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
    rows, cols = x.numel() // x.shape[-1], x.shape[-1]
    _rms_norm_kernel[(rows,)](x, x, weight, out, out, cols, eps, HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(cols))
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x, residual = x.contiguous(), residual.contiguous()
    out = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
    new_residual = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    rows, cols = x.numel() // x.shape[-1], x.shape[-1]
    _rms_norm_kernel[(rows,)](
        x, residual, weight, out, new_residual, cols, eps, HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(cols)
    )
    return out, new_residual


# -- SiLU(gate) * up ---------------------------------------------------------------
@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    n = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    rows = x.numel() // x.shape[-1]
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](x, out, n, BLOCK=block)
    return out


# -- RoPE (rotate-half layout) -------------------------------------------------------
@triton.jit
def _rope_kernel(x_ptr, out_ptr, pos_ptr, cs_ptr, n_heads, HALF: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + token)
    offs = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * 2 * HALF + offs)
    sin = tl.load(cs_ptr + pos * 2 * HALF + HALF + offs)
    base = (token * n_heads + head) * 2 * HALF
    x1 = tl.load(x_ptr + base + offs).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF + offs).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + base + offs, (x1 * cos - x2 * sin).to(ty))
    tl.store(out_ptr + base + HALF + offs, (x2 * cos + x1 * sin).to(ty))


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    outs = []
    for x in (q, k):
        x = x.contiguous()
        out = torch.empty_like(x)
        if x.shape[0]:
            _rope_kernel[(x.shape[0], x.shape[1])](x, out, positions, cos_sin, x.shape[1], HALF=x.shape[2] // 2)
        outs.append(out)
    return outs[0], outs[1]


# -- KV-cache write ------------------------------------------------------------------
@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    tl.store(kc_ptr + slot * ROW + offs, tl.load(k_ptr + token * ROW + offs, mask=mask), mask=mask)
    tl.store(vc_ptr + slot * ROW + offs, tl.load(v_ptr + token * ROW + offs, mask=mask), mask=mask)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if k.shape[0] == 0:
        return
    row = k.shape[1] * k.shape[2]
    _write_kv_kernel[(k.shape[0],)](
        k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping, ROW=row, BLOCK=triton.next_power_of_2(row)
    )


# -- paged attention over a ragged mixed batch -----------------------------------------
@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    seq_lens_ptr,
    qstart_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_table,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(qstart_ptr + seq)
    q_len = tl.load(qstart_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        prefix = seq_len - q_len
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        dims = tl.arange(0, HEAD_DIM)
        q_off = (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0).to(tl.float32)
        q_pos = prefix + rows
        kv_head = head // GROUP
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        kv_end = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)  # causal: nothing past the tile's last row
        offs = tl.arange(0, BLOCK_SIZE)
        for start in range(0, kv_end, BLOCK_SIZE):
            block = tl.load(tables_ptr + seq * stride_table + start // BLOCK_SIZE).to(tl.int64)
            k_pos = start + offs
            k_ok = k_pos < seq_len
            kv_off = block * stride_kb + offs[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
            k = tl.load(k_ptr + kv_off, mask=k_ok[:, None], other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where((k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_off, mask=k_ok[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta, scale: float
) -> torch.Tensor:
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if dim & (dim - 1) or dim < 16 or block_size < 16:
        raise ValueError("the Triton attention needs a power-of-two head_dim >= 16 and block_size >= 16")
    out = torch.empty_like(q)
    if meta.num_seqs == 0:
        return out
    q_lens = [b - a for a, b in zip(meta.query_start_host, meta.query_start_host[1:], strict=False)]
    block_m = 16 if max(q_lens) <= 16 else 64
    grid = (meta.num_seqs, triton.cdiv(max(max(q_lens), 1), block_m), heads)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        meta.block_tables.stride(0),
        GROUP=heads // kv_heads,
        BLOCK_M=block_m,
        BLOCK_SIZE=block_size,
        HEAD_DIM=dim,
    )
    return out


def linear(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


def linear_silu_mul(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    return silu_mul(linear(layer, x))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)  # torch's CUDA reduction: the first index on ties, as the reference
