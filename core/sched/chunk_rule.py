"""How many of a prompt's pending tokens a prefill pass places now: the rule each
pass hands the chunks it sizes. Three rules: what the token budget leaves
(``BUDGET``); that, cut to the pass's share of the iteration's time limits
(``core.sched.time_limit.TimeLimit``); and mode ``none``'s whole prompt or
nothing (``WHOLE``). The passes are the same arithmetic in every mode; the rule
is what differs."""

from __future__ import annotations

from typing import Protocol

from stallfree.core.sched.batch import Batch


class ChunkRule(Protocol):
    def chunk(self, batch: Batch, prefix: int, pending: int, left: int) -> tuple[int, bool]:
        """Tokens placed now of ``pending`` after ``prefix``, within ``left`` of the
        budget; and whether the prefill floor took the iteration past its target."""
        ...


class Budget:
    def chunk(self, batch: Batch, prefix: int, pending: int, left: int) -> tuple[int, bool]:
        return min(pending, left), False


class WholePrompts:
    """Mode ``none``: a prompt runs in one iteration or waits (vLLM V0's frozen batch)."""

    def chunk(self, batch: Batch, prefix: int, pending: int, left: int) -> tuple[int, bool]:
        return (pending if pending <= left else 0), False


BUDGET = Budget()
WHOLE = WholePrompts()
