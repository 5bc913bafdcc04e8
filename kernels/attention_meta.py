"""Per-iteration attention metadata, built once and shared by every layer.

The flattened batch holds ``num_decodes`` decode sequences first (one query
token each), then prefill chunks (several query tokens each, attending to
their cached prefix and causally to each other). Sequence ``s`` owns query
rows ``query_start[s]:query_start[s + 1]`` and, after this step's KV write,
``seq_lens[s]`` cached tokens reachable through ``block_tables[s]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMeta:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [S] int32: KV length after this step
    query_start: torch.Tensor  # [S + 1] int32: prefix sums of query lengths
    num_decodes: int
    block_size: int
    # host copies, so the torch reference never syncs with the device
    seq_lens_host: list[int] = field(default_factory=list)
    query_start_host: list[int] = field(default_factory=list)
    # derived once per iteration by the torch reference (see kernels.reference)
    decode_gather: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


def build_attention_meta(
    block_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    num_decodes: int,
    block_size: int,
    device: torch.device,
) -> AttentionMeta:
    """Metadata for sequences given in batch order (decodes first)."""
    max_blocks = max((len(bt) for bt in block_tables), default=0) or 1
    table = torch.zeros(len(block_tables), max_blocks, dtype=torch.int32)
    for i, bt in enumerate(block_tables):
        table[i, : len(bt)] = torch.tensor(bt, dtype=torch.int32)
    query_start = [0]
    slots = []
    for bt, seq_len, q_len in zip(block_tables, seq_lens, query_lens, strict=True):
        query_start.append(query_start[-1] + q_len)
        for pos in range(seq_len - q_len, seq_len):
            slots.append(bt[pos // block_size] * block_size + pos % block_size)
    return AttentionMeta(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
        num_decodes=num_decodes,
        block_size=block_size,
        seq_lens_host=list(seq_lens),
        query_start_host=query_start,
    )
