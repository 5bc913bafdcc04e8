"""What a replica tells the router about itself.

A replica publishes ``ReplicaStats`` after its iterations (over Ray: through
Serve's ``record_routing_stats``; in the simulator: read live). It carries the
hashes of the blocks its prefix cache can hit, or will once the prompts queued
there are computed (the block manager's own chain hashes), so the router can
count how much of a prompt a replica holds by hashing the prompt the same way.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, KeysView, Sequence
from dataclasses import dataclass, field

from stallfree.core.sched.block_manager import chain_hash, chain_root
from stallfree.core.sched.engine import Engine
from stallfree.core.sched.request import RequestStatus


def prompt_hashes(tokens: Sequence[int], block_size: int, cache_salt: str = "") -> list[bytes]:
    """Hashes of the prompt's full blocks, in order: the chain the prefix cache
    keys on (for a request with this ``cache_salt``)."""
    out, parent = [], chain_root(cache_salt)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain_hash(parent, list(tokens[start : start + block_size]))
        out.append(parent)
    return out


class _Either(Collection[bytes]):
    """Cached hashes (a live view) or queued prompts' hashes, without copying the first."""

    def __init__(self, cached: KeysView[bytes], queued: set[bytes]) -> None:
        self.cached, self.queued = cached, queued

    def __contains__(self, h: object) -> bool:
        return h in self.cached or h in self.queued

    def __iter__(self) -> Iterator[bytes]:
        yield from self.cached
        yield from (h for h in self.queued if h not in self.cached)

    def __len__(self) -> int:
        return len(self.cached) + sum(h not in self.cached for h in self.queued)


@dataclass(slots=True, frozen=True)
class ReplicaStats:
    replica: str
    running: int = 0
    waiting: int = 0
    partial_prefills: int = 0
    decoding: int = 0
    mean_context: int = 0  # tokens per decoding request (their attention reads)
    queued_prefill_tokens: int = 0  # prompt tokens admitted or waiting, not yet computed
    kv_blocks: int = 0
    kv_free_blocks: int = 0
    kv_cached_blocks: int = 0
    block_size: int = 16
    token_budget: int = 512
    seq: int = 0  # bumps with each report: work the router sent before it is now counted here
    cached: Collection[bytes] = field(default_factory=frozenset)  # hashes of hittable blocks

    @property
    def load(self) -> int:
        return self.running + self.waiting

    @property
    def kv_used_blocks(self) -> int:
        return self.kv_blocks - self.kv_free_blocks

    @property
    def kv_utilization(self) -> float:
        return self.kv_used_blocks / self.kv_blocks if self.kv_blocks else 0.0

    def matched_blocks(self, hashes: Sequence[bytes]) -> int:
        """Leading prompt blocks this replica can serve from its prefix cache."""
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n


def engine_stats(name: str, engine: Engine, seq: int = 0, live: bool = False) -> ReplicaStats:
    """An engine's stats, taken on its own thread. ``live`` shares the block
    manager's hash index instead of copying it (the simulator reads it in place)."""
    s, kv = engine.scheduler, engine.kv
    decoding = [r for r in s.running if r.status == RequestStatus.DECODING]
    queued = [*s.waiting, *(r for r in s.running if r.status == RequestStatus.PREFILLING)]
    # a waiting prompt's prefix hit is taken at admission: count only what it will compute
    pending = sum(r.num_prompt_tokens - kv.cached_prefix_tokens(r) for r in s.waiting)
    pending += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in queued[len(s.waiting) :])
    incoming = {h for r in queued for h in kv.prompt_hashes(r)}
    cached: Collection[bytes] = (
        _Either(kv.cached_hashes(), incoming) if live else frozenset(kv.cached_hashes()) | incoming
    )
    return ReplicaStats(
        replica=name,
        running=len(s.running),
        waiting=len(s.waiting),
        partial_prefills=s.num_partial_prefills,
        decoding=len(decoding),
        mean_context=sum(r.num_tokens for r in decoding) // len(decoding) if decoding else 0,
        queued_prefill_tokens=pending,
        kv_blocks=kv.num_blocks,
        kv_free_blocks=kv.num_free_blocks,
        kv_cached_blocks=kv.num_cached_blocks,
        block_size=kv.block_size,
        token_budget=engine.config.token_budget,
        seq=seq,
        cached=cached,
    )
