"""What the scheduler needs to know of time: an iteration's predicted cost.

The scheduler decides in tokens but the user's requirement is a time (no
gap over X ms), and an iteration's time depends on its shape, not only its
token count: each decode's context, each chunk's size and the prefix it
attends to. A cost model (``core.analysis``: the fitted roofline, corrected
online from the iterations the engine measures) answers in seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# (prefix length, tokens) of each prefill chunk in an iteration
Chunks = Sequence[tuple[int, int]]


class IterationCost(Protocol):
    def iteration_s(self, decode_contexts: Sequence[int], chunks: Chunks) -> float:
        """Predicted seconds of one iteration: a decode per context (tokens
        already cached), and each chunk after its prefix."""
        ...

    def observe(self, decode_contexts: Sequence[int], chunks: Chunks, measured_s: float) -> None:
        """What an iteration of that shape measured (a fixed model ignores it)."""
        ...

    def correction(self, with_prefill: bool) -> float:
        """Measured / fitted time learnt so far for iterations of that kind (1 for a fixed model)."""
        ...
