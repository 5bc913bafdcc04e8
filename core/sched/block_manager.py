"""Paged KV blocks: allocation, reference counts, prefix cache, admission reserve.

Blocks hold ``block_size`` tokens of KV each. A request's ``block_ids`` is its
block table. Full blocks are keyed by a hash chain (parent hash + the block's
tokens); a new request whose prompt starts with the same full blocks reuses
them instead of recomputing (a *prefix hit*). The chain starts from the
request's ``cache_salt`` (``chain_root``): requests with different salts (the
gateway's tenants, by default) never hit each other's blocks. Freed blocks
that carry a hash stay reusable until evicted, least recently freed first;
blocks without a hash are handed out before any cached block is evicted.

Admission reserves a request's *final* footprint (its tokens plus a decode
reserve), so a prompt admitted now can finish its prefill without anybody
being preempted; decode growth beyond the reserve uses unreserved blocks.

One request's blocks, and what the pool's counts mean::

    req.block_ids   [h0][h1][h2][b3][b4][b5]
                    |prefix hit|  computed | + this iteration's tokens
                    |<-- allocated: len(block_ids) -->|<-- reserve left -->|
                    |<-- req.footprint_blocks: prompt + decode reserve --->|

    num_blocks      = used + free;  free = plain (no hash) + cached (hash, LRU)
    unreserved free = free - every request's reserve left
                      (what admission, and growth past a footprint, may take)

A hit block (h0..h2) may be shared by several tables (``ref_count``); a free
block that still has a hash stays findable until it is handed out again.

The manager owns blocks and block tables; what a request has computed is the
scheduler's to record: admission answers with the tokens it found computed
(``Admitted``), growth with the copies the runner must make first (``Grown``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, KeysView
from dataclasses import dataclass

from stallfree.core import faults
from stallfree.core.sched.request import Request


@dataclass(slots=True, frozen=True)
class Admitted:
    """A request admitted: its first ``computed_tokens`` need no computing (prefix
    hits, a sibling's prompt, KV imported from a prefill worker)."""

    computed_tokens: int


@dataclass(slots=True, frozen=True)
class Grown:
    """A block table grown: ``copies`` (source, copy) blocks the runner fills
    before the iteration runs (copy on write of a shared block)."""

    copies: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


def chain_root(cache_salt: str) -> bytes:
    """The parent of a request's first block: ``b""`` without a salt, else a
    16-byte digest of it. As in vLLM's ``cache_salt``: a prefix hit, and the
    time it saves, would tell one tenant which prompt another sent."""
    if not cache_salt:
        return b""
    return hashlib.blake2b(cache_salt.encode(), digest_size=16, person=b"stallfree-salt").digest()


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
        self._unallocated_reserve = 0  # every request's unallocated reserve, summed
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
        """Blocks admitted requests reserved and have not allocated yet."""
        return self._unallocated_reserve

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------
    def _extend_hashes(self, req: Request, num_tokens: int) -> None:
        """Make sure req.block_hashes covers the full blocks in its first num_tokens."""
        bs = self.block_size
        hashes = req.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[i - 1] if i else chain_root(req.cache_salt)
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

    def cached_hashes(self) -> KeysView[bytes]:
        """Hashes of every block a prompt can hit (a live view: the router's digest)."""
        return self._by_hash.keys()

    def prompt_hashes(self, req: Request) -> list[bytes]:
        """The hashes req's full prompt blocks will be cached under."""
        self._extend_hashes(req, req.num_prompt_tokens)
        return req.block_hashes[: req.num_prompt_tokens // self.block_size]

    def cached_prefix_tokens(self, req: Request) -> int:
        """Prefix-hit length req would get if admitted now (for the lpm policy)."""
        return len(self._matched_blocks(req)) * self.block_size

    def cache_computed(self, req: Request, since_tokens: int = 0) -> None:
        """Register req's full, computed blocks so later prompts can hit them.

        since_tokens: tokens computed when this was last called for req; blocks
        full by then were registered then (each step looks only at the blocks
        it filled, not at the whole context). A block whose twin already held
        its hash stays unregistered: the twin serves the hits."""
        if not self.enable_prefix_caching:
            return
        full = req.num_computed_tokens // self.block_size
        self._extend_hashes(req, full * self.block_size)
        for i in range(since_tokens // self.block_size, full):
            block = self.blocks[req.block_ids[i]]
            if block.hash is not None:
                continue
            h = req.block_hashes[i]
            if h not in self._by_hash:  # a twin computed concurrently keeps the entry
                block.hash = h
                self._by_hash[h] = block.block_id

    # -- allocation -------------------------------------------------------
    @staticmethod
    def _reserve_left(req: Request) -> int:
        """Blocks of req's footprint it has not allocated yet (0 once it grew past it)."""
        return max(0, req.footprint_blocks - len(req.block_ids))

    def admit(self, req: Request, reserve_tokens: int) -> Admitted | None:
        """Take prefix hits and reserve req's final footprint, or change nothing (None).

        ``reserve_tokens``: the footprint to guarantee (tokens + decode reserve).
        """
        hits = self._matched_blocks(req)
        footprint = max(self.blocks_for(reserve_tokens), len(hits))
        hits_now_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # taking them uses free blocks
        unreserved_free = self.num_free_blocks - hits_now_free - self._unallocated_reserve
        if footprint - len(hits) > unreserved_free:
            return None
        for block_id in hits:
            self._take(block_id)
        req.block_ids = hits
        req.footprint_blocks = footprint
        self._unallocated_reserve += self._reserve_left(req)
        self.prefix_hit_tokens += len(hits) * self.block_size
        return Admitted(len(hits) * self.block_size)

    def admit_imported(self, req: Request, reserve_tokens: int) -> Admitted | None:
        """Admit req with its first ``req.imported_tokens`` tokens' KV computed
        elsewhere (a prefill worker), or change nothing (None): fresh blocks to
        write it into, held now, and the footprint reserved."""
        blocks = self.blocks_for(req.imported_tokens)
        footprint = max(self.blocks_for(reserve_tokens), blocks)
        if footprint > self.num_free_blocks - self._unallocated_reserve:
            return None
        req.block_ids = [self._pop_free() for _ in range(blocks)]
        req.footprint_blocks = footprint
        self._unallocated_reserve += self._reserve_left(req)
        return Admitted(req.imported_tokens)

    def share(self, req: Request, head: Request, reserve_tokens: int) -> Admitted | None:
        """Admit req, another choice of head's prompt (which head has computed),
        onto head's blocks, or change nothing (None). Every block of the prompt is
        shared, the partial last one too, until either request writes into it
        (copy on write: ``allocate``); req computes only its last prompt token
        again, for the logits of its first token. Its footprint reserves the copy."""
        n = req.num_prompt_tokens
        shared = head.block_ids[: self.blocks_for(n)]
        footprint = max(self.blocks_for(reserve_tokens), len(shared)) + 1  # + the copy of the block it writes
        if footprint - len(shared) > self.num_free_blocks - self._unallocated_reserve:
            return None
        for block_id in shared:
            self._take(block_id)
        req.block_ids = list(shared)
        req.footprint_blocks = footprint
        self._unallocated_reserve += self._reserve_left(req)
        self.prefix_hit_tokens += n - 1
        return Admitted(n - 1)

    def allocate(self, req: Request, num_new_tokens: int) -> Grown | None:
        """Grow req's block table to hold num_new_tokens more tokens, or change nothing (None).

        Blocks come from req's own reservation first, then from blocks nobody
        has reserved.
        """
        faults.point("allocate")
        written = req.num_computed_tokens // self.block_size  # the block the first new token goes to
        shared = written < len(req.block_ids) and self.blocks[req.block_ids[written]].ref_count > 1
        new_blocks = self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_ids) + shared
        if new_blocks <= 0:
            return Grown()
        own_reserve = self._reserve_left(req)
        others_reserve = self._unallocated_reserve - own_reserve
        if new_blocks > self.num_free_blocks - others_reserve:
            return None
        copies: tuple[tuple[int, int], ...] = ()
        if shared:  # copy on write: req's own copy of the block, filled by the runner before it runs
            source, copy = req.block_ids[written], self._pop_free()
            self.blocks[source].ref_count -= 1
            req.block_ids[written] = copy
            copies = ((source, copy),)
            req.footprint_blocks -= 1 if own_reserve else 0  # the copy came out of its reserve
        for _ in range(new_blocks - shared):
            req.block_ids.append(self._pop_free())
        self._unallocated_reserve -= own_reserve - self._reserve_left(req)
        return Grown(copies)

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back req's blocks past those its first num_tokens tokens need (they
        held only rejected draft tokens): into its reserve while inside its
        footprint, else to the free pool."""
        keep = self.blocks_for(num_tokens)
        if len(req.block_ids) <= keep:
            return
        reserve_left = self._reserve_left(req)
        for block_id in reversed(req.block_ids[keep:]):
            self._release(block_id)
        del req.block_ids[keep:]
        self._unallocated_reserve += self._reserve_left(req) - reserve_left

    def free(self, req: Request) -> None:
        """Release req's blocks and reservation. Tail blocks go first in LRU order,
        since a prefix's tail is the part least likely to be shared."""
        self._unallocated_reserve -= self._reserve_left(req)
        for block_id in reversed(req.block_ids):
            self._release(block_id)
        req.block_ids = []
        req.footprint_blocks = 0

    def _release(self, block_id: int) -> None:
        """One block table lets go of the block; the last one frees it."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is None:
                self._free_plain.append(block_id)
            else:
                self._free_cached[block_id] = None

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
            if block.hash is not None:  # always, for a cached block
                del self._by_hash[block.hash]
                block.hash = None
        self.blocks[block_id].ref_count = 1
        return block_id

    # -- checks -------------------------------------------------------------
    def check_invariants(self, requests: Iterable[Request]) -> None:
        """Raise RuntimeError if the pool disagrees with the live requests'
        block tables (the property tests call it every iteration)."""
        refs = [0] * self.num_blocks
        reserve = 0
        for req in requests:
            for block_id in req.block_ids:
                refs[block_id] += 1
            reserve += self._reserve_left(req)
        free_plain, free_cached = list(self._free_plain), list(self._free_cached)
        problems = []
        if len(set(free_plain + free_cached)) != len(free_plain) + len(free_cached):
            problems.append("a block is on the free lists twice")
        free = set(free_plain) | set(free_cached)
        for block in self.blocks:
            i = block.block_id
            if block.ref_count != refs[i]:
                problems.append(f"block {i}: ref_count {block.ref_count}, in {refs[i]} block tables")
            if (block.ref_count == 0) != (i in free):
                problems.append(f"block {i}: ref_count {block.ref_count} but on a free list: {i in free}")
            if block.hash is not None and self._by_hash.get(block.hash) != i:
                problems.append(f"block {i}: its hash is not indexed")
        if any(self.blocks[b].hash is not None for b in free_plain):
            problems.append("a plain free block has a hash")
        if any(self.blocks[b].hash is None for b in free_cached):
            problems.append("a cached free block has no hash")
        if len(self._by_hash) != sum(b.hash is not None for b in self.blocks):
            problems.append("the hash index holds blocks that lost their hash")
        if reserve != self._unallocated_reserve:
            problems.append(f"unallocated reserve {self._unallocated_reserve}, requests hold {reserve}")
        if self._unallocated_reserve > self.num_free_blocks:
            problems.append(f"reserve {self._unallocated_reserve} exceeds the {self.num_free_blocks} free blocks")
        if problems:
            raise RuntimeError("KV block invariants broken: " + "; ".join(problems[:5]))
