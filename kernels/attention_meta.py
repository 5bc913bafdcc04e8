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
    positions: torch.Tensor  # [T] int64: position of each query token in its sequence
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
    """Metadata for sequences given in batch order (decodes first).

    Built once per iteration with whole-tensor ops: no Python loop over
    tokens (a 2,000-token chunk would be 2,000 list appends)."""
    num_seqs = len(block_tables)
    max_blocks = max((len(bt) for bt in block_tables), default=0) or 1
    flat = [b for bt in block_tables for b in bt]
    table = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    if flat:
        counts = torch.tensor([len(bt) for bt in block_tables])
        rows = torch.repeat_interleave(torch.arange(num_seqs), counts)
        cols = torch.arange(len(flat)) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        table[rows, cols] = torch.tensor(flat, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    query_start = torch.zeros(num_seqs + 1, dtype=torch.int32)
    torch.cumsum(q_lens, 0, out=query_start[1:])
    seq_of_row = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
    positions = torch.arange(seq_of_row.numel()) - query_start[seq_of_row] + (lens - q_lens)[seq_of_row]
    slots = table[seq_of_row, positions // block_size].long() * block_size + positions % block_size
    return AttentionMeta(
        slot_mapping=slots.to(device),
        block_tables=table.to(device),
        seq_lens=lens.to(device),
        query_start=query_start.to(device),
        positions=positions.to(device),
        num_decodes=num_decodes,
        block_size=block_size,
        seq_lens_host=list(seq_lens),
        query_start_host=query_start.tolist(),
    )
