"""How many of a prompt's pending tokens a prefill pass places now: the rule each
pass hands the chunks it sizes. Three rules: an even share of what the token
budget leaves (``BUDGET``, ``even_share``); that, cut to the pass's share of the
iteration's time limits (``core.sched.time_limit.TimeLimit``); and mode
``none``'s whole prompt or nothing (``WHOLE``). The passes are the same
arithmetic in every mode; the rule is what differs."""

from __future__ import annotations

from typing import Protocol

from stallfree.core.sched.batch import Batch


class ChunkRule(Protocol):
    def chunk(self, batch: Batch, prefix: int, pending: int, left: int) -> tuple[int, bool]:
        """Tokens placed now of ``pending`` after ``prefix``, within ``left`` of the
        budget; and whether the prefill floor took the iteration past its target."""
        ...


def even_share(pending: int, left: int) -> int:
    """Of a prompt's ``pending`` tokens, those to place when ``left`` is what the
    budget leaves: all if they fit, else an even share of the iterations they need
    at ``left`` a time (2,000 tokens at 248: nine chunks of 223, not eight of 248
    and a last of 16). As many iterations while ``left`` holds, and the same
    tokens in all, but the costliest chunk, the last full one after the longest
    prefix (its attention reads every token before it), is smaller: for that
    prompt beside 8 decodes the worst gap fell 9 % (compare-2026-12-07-13)."""
    if pending <= left:
        return pending
    if left <= 0:
        return 0
    return -(-pending // -(-pending // left))


class Budget:
    def chunk(self, batch: Batch, prefix: int, pending: int, left: int) -> tuple[int, bool]:
        return even_share(pending, left), False


class WholePrompts:
    """Mode ``none``: a prompt runs in one iteration or waits (vLLM V0's frozen batch)."""

    def chunk(self, batch: Batch, prefix: int, pending: int, left: int) -> tuple[int, bool]:
        return (pending if pending <= left else 0), False


BUDGET = Budget()
WHOLE = WholePrompts()
