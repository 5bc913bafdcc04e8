"""Paged KV blocks: allocation, reference counts, prefix cache, admission reserve.

Blocks hold ``block_size`` tokens of KV each. A request's ``block_ids`` is its
block table. Full blocks are keyed by a hash chain (parent hash + the block's
tokens); a new request whose prompt starts with the same full blocks reuses
them instead of recomputing (a *prefix hit*). Freed blocks that carry a hash
stay reusable until evicted, least recently freed first; blocks without a hash
are handed out before any cached block is evicted.

Admission reserves a request's *final* footprint (its tokens plus a decode
reserve), so a prompt admitted now can finish its prefill without anybody
being preempted; decode growth beyond the reserve uses unreserved blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from core import faults
from core.sched.request import Request


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """Hash of a full block given its parent's hash.

    A cryptographic hash, not Python's ``hash``: integer hashes are trivially
    invertible, and a crafted prompt colliding with another user's block
    would read that user's KV.
    """
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self._by_hash: dict[bytes, int] = {}
        self._outstanding = 0  # reserved blocks not yet allocated, all requests
        self.prefix_hit_tokens = 0

    # -- counters ---------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks reusable by a prefix hit (in use or free)."""
        return len(self._by_hash)

    @property
    def num_reserved_blocks(self) -> int:
        return self._outstanding

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------
    def _extend_hashes(self, req: Request, num_tokens: int) -> None:
        """Make sure req.block_hashes covers the full blocks in its first num_tokens."""
        bs = self.block_size
        hashes = req.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[i - 1] if i else b""
            hashes.append(chain_hash(parent, req.tokens(i * bs, (i + 1) * bs)))

    def _matched_blocks(self, req: Request) -> list[int]:
        """Cached blocks matching req's leading full blocks.

        At least one token is always left to compute: its logits give the
        next token.
        """
        if not self.enable_prefix_caching:
            return []
        limit = (req.num_tokens - 1) // self.block_size
        self._extend_hashes(req, limit * self.block_size)
        hits = []
        for h in req.block_hashes[:limit]:
            block_id = self._by_hash.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cached_prefix_tokens(self, req: Request) -> int:
        """Prefix-hit length req would get if admitted now (for the lpm policy)."""
        return len(self._matched_blocks(req)) * self.block_size

    def cache_computed(self, req: Request) -> None:
        """Register req's full, computed blocks so later prompts can hit them."""
        if not self.enable_prefix_caching:
            return
        full = req.num_computed_tokens // self.block_size
        self._extend_hashes(req, full * self.block_size)
        for i in range(full):
            block = self.blocks[req.block_ids[i]]
            if block.hash is not None:
                continue
            h = req.block_hashes[i]
            if h not in self._by_hash:  # a twin computed concurrently keeps the entry
                block.hash = h
                self._by_hash[h] = block.block_id

    # -- allocation -------------------------------------------------------
    def _outstanding_of(self, req: Request) -> int:
        return max(0, req.reserved_blocks - len(req.block_ids))

    def admit(self, req: Request, reserve_tokens: int) -> bool:
        """Take prefix hits and reserve req's final footprint, or change nothing.

        ``reserve_tokens``: the footprint to guarantee (tokens + decode reserve).
        On success req.num_computed_tokens covers the hit blocks.
        """
        hits = self._matched_blocks(req)
        reserved = max(self.blocks_for(reserve_tokens), len(hits))
        hits_now_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        available = self.num_free_blocks - hits_now_free - self._outstanding
        if reserved - len(hits) > available:
            return False
        for block_id in hits:
            self._take(block_id)
        req.block_ids = hits
        req.reserved_blocks = reserved
        self._outstanding += self._outstanding_of(req)
        req.num_computed_tokens = len(hits) * self.block_size
        self.prefix_hit_tokens += req.num_computed_tokens
        return True

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Grow req's block table to hold num_new_tokens more tokens, or change nothing.

        Blocks come from req's own reservation first, then from blocks nobody
        has reserved.
        """
        faults.point("allocate")
        need = self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        own = self._outstanding_of(req)
        if need > self.num_free_blocks - (self._outstanding - own):
            return False
        for _ in range(need):
            req.block_ids.append(self._pop_free())
        self._outstanding -= own - self._outstanding_of(req)
        return True

    def free(self, req: Request) -> None:
        """Release req's blocks and reservation. Tail blocks go first in LRU order,
        since a prefix's tail is the part least likely to be shared."""
        self._outstanding -= self._outstanding_of(req)
        for block_id in reversed(req.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free_plain.append(block_id)
                else:
                    self._free_cached[block_id] = None
        req.block_ids = []
        req.reserved_blocks = 0

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._free_cached.pop(block_id)
        block.ref_count += 1

    def _pop_free(self) -> int:
        if self._free_plain:
            block_id = self._free_plain.popleft()
        else:
            block_id, _ = self._free_cached.popitem(last=False)
            block = self.blocks[block_id]
            del self._by_hash[block.hash]
            block.hash = None
        self.blocks[block_id].ref_count = 1
        return block_id
