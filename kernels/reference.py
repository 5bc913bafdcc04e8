"""Torch reference of every kernel: the CPU path, and the ground truth in tests.

Shapes: tokens are flattened across the batch (T rows); q is [T, heads, d],
k/v are [T, kv_heads, d]; one layer's cache is [blocks, block_size, kv_heads, d].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stallfree.kernels.attention_meta import AttentionMeta
from stallfree.kernels.linear import Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Computed in float32; the result has the weight's (compute) dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(weight.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual (float32) += x; return (rms_norm(residual), residual).

    Keeping the residual stream in float32 while matmuls run in bf16 is what
    makes bf16 agree with fp32: with a bf16 residual the embedded SmolLM2's
    greedy top-1 flipped on 0.7 % of prompt positions (a first answer token
    among them), with a float32 one on none of the positions tried.
    """
    residual = residual + x.float()
    return rms_norm(residual, weight, eps), residual


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] on the last dim; returns silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE (the Hugging Face layout). cos_sin: [max_pos, d] = [cos | sin] halves."""
    cs = cos_sin[positions]
    half = cs.shape[-1] // 2
    cos = cs[:, None, :half].to(q.dtype)
    sin = cs[:, None, half:].to(q.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's K/V rows into their cache slots."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def _decode_groups(meta: AttentionMeta) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Decodes grouped by context length, each group padded only to its own
    longest context: (rows, flat block ids [rows * nb], additive mask [1, rows, 1, nb * bs]).

    One padded batch would make a single 2,000-token context cost every short
    decode as much (measured: 8 decodes at 256 + one at 2,000 took 110 ms in
    one group, 35 ms in two).
    """
    if meta.decode_gather is None:
        lens = meta.seq_lens_host[: meta.num_decodes]
        order = sorted(range(len(lens)), key=lens.__getitem__)
        groups: list[list[int]] = []
        for i in order:
            if groups and lens[i] <= 2 * lens[groups[-1][0]] + meta.block_size:
                groups[-1].append(i)
            else:
                groups.append([i])
        device = meta.block_tables.device
        meta.decode_gather = []
        for g in groups:
            rows = torch.tensor(g, device=device)
            nb = -(-lens[g[-1]] // meta.block_size)
            blocks = meta.block_tables[rows, :nb].reshape(-1).long()
            positions = torch.arange(nb * meta.block_size, device=device)
            mask = torch.zeros(1, len(g), 1, positions.numel(), device=device)
            mask.masked_fill_(positions[None, None, None, :] >= meta.seq_lens[rows][None, :, None, None], float("-inf"))
            meta.decode_gather.append((rows, blocks, mask))
    return meta.decode_gather


def _gather_head_major(cache: torch.Tensor, blocks: torch.Tensor, rows: int) -> torch.Tensor:
    """[kv_heads, rows, L, dim] from the blocks' KV: index_select (a parallel
    block copy) then one contiguous transpose, so the matmuls get plain
    batched matrices (measured here: ~2.3x faster than indexing the cache and
    multiplying permuted views)."""
    kv_heads, dim = cache.shape[2], cache.shape[3]
    picked = torch.index_select(cache, 0, blocks).view(rows, -1, kv_heads, dim)
    return picked.permute(2, 0, 1, 3).contiguous()


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta, scale: float
) -> torch.Tensor:
    """Attention of every query row over its sequence's cached KV (this step's
    rows already written). Decodes are batched in one pass; each prefill chunk
    attends to its prefix and causally within itself."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(q)
    d = meta.num_decodes
    for rows, blocks, mask in _decode_groups(meta) if d else ():
        n = rows.numel()
        k = _gather_head_major(k_cache, blocks, n)  # [kvh, n, L, dim]
        v = _gather_head_major(v_cache, blocks, n)
        qg = q[rows].view(n, kv_heads, group, dim).transpose(0, 1)  # [kvh, n, group, dim]
        scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale + mask
        o = torch.matmul(scores.softmax(-1).to(q.dtype), v)  # [kvh, n, group, dim]
        out[rows] = o.transpose(0, 1).reshape(n, heads, dim)
    qs, lens = meta.query_start_host, meta.seq_lens_host
    for s in range(d, meta.num_seqs):
        start, end, seq_len = qs[s], qs[s + 1], lens[s]
        n = end - start
        if n == 0:
            continue
        nb = -(-seq_len // meta.block_size)
        blocks = meta.block_tables[s, :nb].long()
        # 4-D [1, heads, len, dim]: with 3-D inputs SDPA on CPU leaves its flash
        # path (measured 6x slower for a 2,048-token prompt)
        k = _gather_head_major(k_cache, blocks, 1)[None, :, 0, :seq_len]  # [1, kvh, L, dim]
        v = _gather_head_major(v_cache, blocks, 1)[None, :, 0, :seq_len]
        qq = q[start:end].transpose(0, 1)[None]  # [1, heads, n, dim]
        prefix = seq_len - n
        if prefix == 0:
            o = F.scaled_dot_product_attention(qq, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            cols = torch.arange(seq_len, device=q.device)
            rows = torch.arange(prefix, seq_len, device=q.device)
            allowed = cols[None, :] <= rows[:, None]
            o = F.scaled_dot_product_attention(qq, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out


def linear(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


def linear_silu_mul(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) of a layer whose weight stacks gate rows then up rows."""
    return silu_mul(linear(layer, x))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token, the first on ties: ``max`` rather than
    ``argmax``, 3x faster on the CPU for 32 rows of 49,152 (same answer)."""
    return logits.max(dim=-1).indices
