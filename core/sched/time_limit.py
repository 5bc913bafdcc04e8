"""The time one iteration may take while it is scheduled, and each pass's share of it.

Two limits bound an iteration's predicted time (the cost model's): the TBT target
x the aim while its batch holds decodes, and with ``dynamic_chunking`` the level,
a budget-sized chunk's time with no prefix. Each prefill pass may fill a share of
the time the batch so far leaves under them and is owed a floor of prefill tokens
whatever the time. The scheduler makes one value per pass and hands it to the
chunks that pass sizes, so what a chunk is cut to follows from its arguments.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from stallfree.core.sched.batch import Batch
from stallfree.core.sched.chunk_rule import even_share
from stallfree.core.sched.cost import IterationCost


@dataclass(frozen=True, slots=True)
class TimeLimit:
    """An iteration's limits, with the share of them the current pass may fill."""

    cost: IterationCost
    target_s: float | None  # the TBT target x the aim (None: not applied)
    level_s: float | None  # dynamic chunking's level (None: off)
    # the pass may fill the predicted time up to so_far_s + share x (a limit - so_far_s)
    so_far_s: float = 0.0
    share: float = 1.0
    owed_until: int = 0  # the floor: prefill tokens the batch keeps, time or not

    @property
    def ceiling_s(self) -> float:
        """The lesser limit, whole: what draft tokens may fill up to."""
        return min((t for t in (self.target_s, self.level_s) if t is not None), default=math.inf)

    def shared(self, batch: Batch, share: float, floor: int) -> TimeLimit:
        """The next pass's: ``share`` of the time the batch so far leaves under each
        limit, and ``floor`` prefill tokens owed (never more than the budget leaves)."""
        so_far_s = self.cost.iteration_s(*batch.shape())
        return replace(self, so_far_s=so_far_s, share=share, owed_until=batch.prefill_tokens + max(0, floor))

    def chunk(self, batch: Batch, prefix: int, pending: int, left: int) -> tuple[int, bool]:
        """How many of ``pending`` tokens after ``prefix`` the pass places (a
        ``core.sched.chunk_rule.ChunkRule``): of the even share the budget ``left``
        allows (``even_share``), the most that keep the whole iteration (its
        decodes, the chunks so far, this one) within its share of the level, then
        of the TBT target, but what the floor still owes whatever the time; and
        whether the floor took it past the target."""
        n = even_share(pending, left)
        if n == 0:
            return 0, False
        owed = self.owed_until - batch.prefill_tokens
        if self.level_s is not None:
            n = max(self.fit(batch, prefix, n, self._up_to(self.level_s)), min(n, owed))
        if self.target_s is not None:
            fit = self.fit(batch, prefix, n, self._up_to(self.target_s))
            if fit < min(n, owed):
                return min(n, owed), True
            n = fit
        return n, False

    def fit(self, batch: Batch, prefix: int, n: int, limit_s: float) -> int:
        """The most of n tokens after ``prefix`` that keep the iteration's predicted time within limit_s."""
        decodes, chunks = batch.shape()
        return _largest(n, lambda m: self.cost.iteration_s(decodes, [*chunks, (prefix, m)]) <= limit_s)

    def _up_to(self, limit_s: float) -> float:
        return self.so_far_s + self.share * (limit_s - self.so_far_s)


def _largest(n: int, fits: Callable[[int], bool]) -> int:
    """The largest m in [0, n] with fits(m), for fits monotone (true, then false); fits(0) is taken as true."""
    if fits(n):
        return n
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
