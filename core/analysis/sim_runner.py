"""The cost-model runner: charges each iteration the cost model's predicted
time and emits deterministic tokens computed from the KV it was given, so the
real scheduler runs at simulated scale with no model.
"""

from __future__ import annotations

import time

from stallfree.core import faults
from stallfree.core.sched.batch import Batch, Sampled
from stallfree.core.sched.cost import IterationCost
from stallfree.core.sched.drafts import NgramDrafter, verified
from stallfree.core.sched.request import Request

_ACCEPT = 0x5EED  # salts the draw that keeps a draft apart from the one that picks a token


class VirtualClock:
    """A perf_counter_ns stand-in that only moves when told to (simulation)."""

    def __init__(self, start_ns: int = 0) -> None:
        self.now_ns = start_ns

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, ns: int) -> None:
        self.now_ns += ns


class SimDrafter(NgramDrafter):
    """The simulator's drafts: every decode proposes as many as it may, as if
    the whole workload echoed its context; the SimRunner's ``acceptance``
    decides how many the simulated model keeps. How many it may propose, and
    its acceptance rate, follow NgramDrafter's rules."""

    def propose(self, req: Request, k: int, ngram: tuple[int, int]) -> tuple[int, ...]:
        return (DRAFT_TOKEN,) * k


DRAFT_TOKEN = 17  # what SimDrafter proposes (the smallest token SimRunner draws)


class SimRunner:
    """Cost-model runner.

    It keeps a fake paged KV cache (one token id per slot), written and read
    through each request's block table exactly as the model runner would, and
    samples a hash of the whole context it reads back. A scheduling or
    prefix-cache mistake (a skipped, repeated or misplaced token, a wrong
    cache hit) therefore changes the token stream, while correct chunking,
    caching and recompute leave it identical.

    With ``clock`` it advances that virtual clock by the predicted iteration
    time; without, it sleeps that long (a stand-in model for gateway tests).
    ``read_context=False`` skips reading the context back (tokens then depend
    only on the last token and position): for load tests of the gateway,
    where the check would cost more than the model it stands in for.

    Draft tokens are verified as the model runner does (``verified``); with
    ``acceptance`` the simulated model also agrees with each draft with that
    probability (a hash of the context decides), which is how the simulator
    models a workload's acceptance rate (``core.analysis.simulator``).
    """

    eos_token_ids: frozenset[int] = frozenset()

    def __init__(
        self,
        cost: IterationCost,
        block_size: int,
        clock: VirtualClock | None = None,
        vocab_size: int = 32000,
        time_scale: float = 1.0,
        read_context: bool = True,
        acceptance: float = 0.0,
    ) -> None:
        self.cost = cost
        self.block_size = block_size
        self.clock = clock
        self.vocab_size = vocab_size
        self.time_scale = time_scale
        self.read_context = read_context
        self.acceptance = acceptance
        self._slots: dict[int, list[int]] = {}

    def predict_s(self, batch: Batch) -> float:
        return self.cost.iteration_s(*batch.shape())

    def export_kv(self, block_ids: list[int], num_tokens: int) -> object:
        """The fake cache's slots of those blocks (token ids), as a list per block."""
        blocks = block_ids[: -(-num_tokens // self.block_size)]
        return [list(self._slots.get(b, [0] * self.block_size)) for b in blocks]

    def import_kv(self, block_ids: list[int], num_tokens: int, payload: object) -> None:
        assert isinstance(payload, list)
        for block_id, slots in zip(block_ids, payload, strict=False):
            self._slots[block_id] = list(slots)

    def release(self, request_ids: list[str]) -> None:
        """Nothing kept per request: the fake cache is per block."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        for source, copy in copies:
            if source in self._slots:
                self._slots[copy] = list(self._slots[source])

    def execute(self, batch: Batch) -> Sampled:
        faults.point("sample")
        bs = self.block_size
        sampled = []
        for item in batch.items:
            req = item.request
            fed = item.token_ids()
            if self.read_context:
                for pos, token in enumerate(fed, item.start):
                    self._slots.setdefault(req.block_ids[pos // bs], [0] * bs)[pos % bs] = token
            if not item.samples:
                continue
            drawn = []
            first = item.start + item.num_tokens - len(item.drafts)  # the position after the request's own tokens
            for i in range(1 + len(item.drafts)):
                end = first + i
                if not self.read_context:
                    drawn.append(17 + (fed[end - 1 - item.start] * 7919 + end) % (self.vocab_size - 17))
                    continue
                context = []
                for block_id in req.block_ids[: -(-end // bs)]:
                    context += self._slots[block_id]
                key = tuple(context[:end])
                # ints only: a str in the key would salt hash() per process and no two runs would agree
                if i < len(item.drafts) and hash((key, _ACCEPT)) % 10_000 < self.acceptance * 10_000:
                    drawn.append(item.drafts[i])  # the simulated model agrees with this draft
                else:
                    drawn.append(17 + hash(key) % (self.vocab_size - 17))
            sampled.append(verified(item.drafts, drawn))
        duration_ns = int(self.predict_s(batch) * self.time_scale * 1e9)
        if self.clock is not None:
            self.clock.advance(duration_ns)
        else:
            time.sleep(duration_ns / 1e9)
        return Sampled(sampled)
