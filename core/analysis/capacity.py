"""Serving capacity under an SLO, as Sarathi-Serve defines it.

Capacity is the highest arrival rate at which the P99 time between tokens
(every output token's gap, stalls and preemptions included) stays within the
TBT SLO and the median scheduling delay (arrival to first scheduled) within
2 s. ``search`` finds it by trials at chosen rates: doubling or halving
from a first guess until one rate passes and a higher one fails, then
bisecting (geometrically) until the two are within the tolerance (5 %).
Trials already run (for another SLO on the same configuration) are reused.

Used by ``stallfree simulate --capacity`` (the simulator on a trace) and
``bench.capacity`` (real servers, side by side).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from core.sched.cost import IterationCost

STRICT, RELAXED = 5.0, 25.0  # Sarathi-Serve's SLOs: this many decode-only iteration times


@dataclass(slots=True, frozen=True)
class SLO:
    tbt_p99_ms: float
    scheduling_delay_p50_ms: float = 2000.0

    def describe(self) -> str:
        return f"P99 TBT <= {self.tbt_p99_ms:g} ms, P50 scheduling delay <= {self.scheduling_delay_p50_ms:g} ms"


@dataclass(slots=True)
class Trial:
    """One run at one arrival rate: the two figures the SLO reads, and the rest measured."""

    rate: float  # requests/s
    tbt_p99_ms: float
    scheduling_delay_p50_ms: float
    errors: int = 0  # requests that failed: a trial with any cannot pass
    figures: dict[str, Any] = field(default_factory=dict)

    def meets(self, slo: SLO) -> bool:
        return (
            self.errors == 0
            and self.tbt_p99_ms <= slo.tbt_p99_ms
            and self.scheduling_delay_p50_ms <= slo.scheduling_delay_p50_ms
        )


@dataclass(slots=True)
class Capacity:
    slo: SLO
    rate: float  # the highest rate that passed (0: none did)
    trials: list[Trial]  # this search's, in the order they ran (reused ones included)

    @property
    def at_capacity(self) -> Trial | None:
        return next((t for t in self.trials if t.rate == self.rate), None)


def search(
    run: Callable[[float], Trial],
    slo: SLO,
    first: float,
    tolerance: float = 0.05,
    max_trials: int = 16,
    known: dict[float, Trial] | None = None,
) -> Capacity:
    """The highest rate meeting ``slo``, to within ``tolerance``, starting at
    ``first`` requests/s. ``known``: trials already run on this configuration
    (filled in as this search runs more). Assumes that meeting the SLO is
    monotone in the rate (a rate that fails, fails above it too)."""
    if not first > 0:
        raise ValueError("the first rate must be > 0")
    known = {} if known is None else known
    trials: list[Trial] = []

    def trial(rate: float) -> Trial:
        if rate not in known:
            known[rate] = run(rate)
        trials.append(known[rate])
        return known[rate]

    passed = [r for r, t in known.items() if t.meets(slo)]
    failed = [r for r, t in known.items() if not t.meets(slo)]
    lo = max(passed, default=0.0)
    hi = min((r for r in failed if r > lo), default=math.inf)
    rate = first if lo == 0 and hi == math.inf else None
    while len(trials) < max_trials:
        if rate is None:
            if hi == math.inf:
                rate = lo * 2
            elif lo == 0:
                rate = hi / 2
            elif hi / lo <= 1 + tolerance:
                break
            else:
                rate = math.sqrt(lo * hi)
        if trial(rate).meets(slo):
            lo = max(lo, rate)
        else:
            hi = min(hi, rate)
        rate = None
    return Capacity(slo, lo, trials)


def trial_from(rate: float, summary: dict[str, Any]) -> Trial:
    """A trial from a run's summary (``itl_p99_ms``, ``queue_wait_p50_ms``, ``errors``)."""
    return Trial(rate, summary["itl_p99_ms"], summary["queue_wait_p50_ms"], summary.get("errors", 0), summary)


def budget_for(cost: IterationCost, slo_ms: float, decodes: int, context: int, most: int) -> int:
    """The article's recipe for a fixed budget: the largest (in steps of 16, at
    most ``most``) whose iteration, ``decodes`` at ``context`` plus a chunk of the
    rest, is predicted within the SLO."""
    best = 16
    for budget in range(16, most + 1, 16):
        if cost.iteration_s([context] * decodes, [(0, max(0, budget - decodes))]) * 1e3 > slo_ms:
            break
        best = budget
    return best
