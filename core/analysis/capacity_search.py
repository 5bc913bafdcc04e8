"""Serving capacity under an SLO, as Sarathi-Serve defines it.

Capacity is the highest arrival rate at which the P99 time between tokens
(every output token's gap, stalls and preemptions included) stays within the
TBT SLO and the median scheduling delay within 2 s: arrival to first token,
less the iterations the prompt's chunks ran in (``core.sched.timings``). For
a scheduler that never pauses a started prompt (Sarathi-Serve's, vLLM's)
that is arrival to first scheduled, as Sarathi-Serve measures it; a TTFT
target's deadline order can pass over a started prompt, which then waits
after its first chunk, and that wait counts. The median TTFT must also stay
within 2 s (since 2026-12-06): under a TBT target a started prompt may run
in every iteration at the prefill floor while the decodes fill the target,
so it is never "waiting", and the scheduling delay alone passed trials whose
median first token came after 16-20 s (capacity-2026-12-06-3 and -4, the
Zen 4: stallfree's default "met" 14.7 req/s so). For a scheduler whose
started prompts run at the budget (vLLM's), TTFT is the scheduling delay
plus one prompt's prefill, so the guard asks little more of it.
``Search`` finds it by trials at chosen rates: doubling or halving
from a first guess until one rate passes and a higher one fails, then
bisecting (geometrically) until the two are within the tolerance (2.5 %,
Sarathi-Serve's). Every trial of one search must replay the same requests
(only sooner or later), or meeting the SLO is not monotone in the rate.
Trials already run (for another SLO on the same configuration) are reused.

Goodput capacity is searched the same way on another criterion
(``Goodput``): the highest rate at which a share of the requests (90 %)
were good, each judged against its TTFT and TBT targets, refused ones not.

Used by ``stallfree simulate --capacity`` (the simulator on a trace) and
``bench.serving.capacity`` (real servers, side by side).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from stallfree.core.sched.cost import IterationCost

STRICT, RELAXED = 5.0, 25.0  # Sarathi-Serve's SLOs: this many decode-only iteration times


@dataclass(slots=True, frozen=True)
class SLO:
    tbt_p99_ms: float
    scheduling_delay_p50_ms: float = 2000.0
    ttft_p50_ms: float = 2000.0

    def describe(self) -> str:
        return (
            f"P99 TBT <= {self.tbt_p99_ms:g} ms, P50 scheduling delay <= {self.scheduling_delay_p50_ms:g} ms, "
            f"P50 TTFT <= {self.ttft_p50_ms:g} ms"
        )


@dataclass(slots=True, frozen=True)
class Goodput:
    """Goodput's criterion: at least ``share`` of a trial's requests were good."""

    share: float = 0.9

    def describe(self) -> str:
        return f"at least {self.share:.0%} of the requests good (TTFT and TBT targets met; refused ones not good)"


@dataclass(slots=True)
class Trial:
    """One run at one arrival rate: the figures the criteria read, and the rest measured."""

    rate: float  # requests/s
    tbt_p99_ms: float
    scheduling_delay_p50_ms: float
    errors: int = 0  # requests that failed (or were refused): a trial with any cannot meet an SLO
    figures: dict[str, Any] = field(default_factory=dict)
    good_share: float = 0.0  # good requests over all of them, refused included (what ``Goodput`` reads)
    ttft_p50_ms: float = 0.0

    def meets(self, slo: SLO | Goodput) -> bool:
        if isinstance(slo, Goodput):  # failed requests are simply not good
            return self.good_share >= slo.share
        return (
            self.errors == 0
            and self.tbt_p99_ms <= slo.tbt_p99_ms
            and self.scheduling_delay_p50_ms <= slo.scheduling_delay_p50_ms
            and self.ttft_p50_ms <= slo.ttft_p50_ms
        )


# what a search reads of each trial: an SLO (capacity) or the good share (goodput capacity)
Criterion = TypeVar("Criterion", SLO, Goodput)


@dataclass(slots=True)
class Capacity(Generic[Criterion]):
    slo: Criterion
    rate: float  # the highest rate that passed (0: none did)
    trials: list[Trial]  # this search's, in the order they ran (reused ones included)

    @property
    def at_capacity(self) -> Trial | None:
        return next((t for t in self.trials if t.rate == self.rate), None)


class Search(Generic[Criterion]):
    """One capacity search, a trial at a time: ``next_rate`` says which rate to
    run next (None: done), ``record`` takes its trial. Searches on different
    engines can so be interleaved, trial by trial (alternating, as a fair
    comparison on a noisy machine needs). ``known``: trials already run on
    this configuration (for another SLO), shared and filled in as it goes.

    From ``first`` (or the bracket known trials leave) it doubles (or halves) until one rate passes and a higher
    one fails, then bisects geometrically until they are within
    ``tolerance``; it gives up below ``lowest`` (capacity 0) and after
    ``max_trials``. It assumes that meeting the SLO is monotone in the rate."""

    def __init__(
        self,
        slo: Criterion,
        first: float,
        tolerance: float = 0.025,
        max_trials: int = 16,
        lowest: float = 0.0,
        known: dict[float, Trial] | None = None,
    ) -> None:
        if not first > 0:
            raise ValueError("the first rate must be > 0")
        self.slo: Criterion = slo
        self.first, self.tolerance = first, tolerance
        self.max_trials, self.lowest = max_trials, lowest
        self.known = {} if known is None else known
        self.trials: list[Trial] = []
        self.ran = 0  # trials this search ran (the others it took from ``known``)
        self.lo, self.hi = 0.0, math.inf  # the highest rate met, the lowest missed

    def next_rate(self) -> float | None:
        """The next rate to run, or None once the search is done. Every known
        trial is taken first (one run since for another search narrows this one
        too); ``max_trials`` counts this search's own."""
        taken = {t.rate for t in self.trials}
        for rate in sorted(r for r in self.known if r not in taken):
            self._take(self.known[rate])
        return self._proposal() if self.ran < self.max_trials else None

    def record(self, trial: Trial) -> None:
        self.ran += 1
        self.known[trial.rate] = trial
        self._take(trial)

    def _proposal(self) -> float | None:
        lo, hi = self.lo, self.hi
        if lo == 0 and hi == math.inf:
            return self.first
        if hi == math.inf:
            return lo * 2
        if lo == 0:
            return hi / 2 if hi / 2 >= self.lowest else None
        return math.sqrt(lo * hi) if hi / lo > 1 + self.tolerance else None

    def _take(self, trial: Trial) -> None:
        self.trials.append(trial)
        if trial.meets(self.slo):
            self.lo = max(self.lo, trial.rate)
        else:
            self.hi = min(self.hi, trial.rate)

    @property
    def result(self) -> Capacity[Criterion]:
        return Capacity(self.slo, self.lo, self.trials)


def search(
    run: Callable[[float], Trial],
    slo: Criterion,
    first: float,
    tolerance: float = 0.025,
    max_trials: int = 16,
    known: dict[float, Trial] | None = None,
) -> Capacity[Criterion]:
    """The highest rate meeting ``slo`` to within ``tolerance``, running
    ``run(rate)`` for each trial (see ``Search``)."""
    s = Search(slo, first, tolerance, max_trials, known=known)
    while (rate := s.next_rate()) is not None:
        s.record(run(rate))
    return s.result


def trial_from(rate: float, summary: dict[str, Any]) -> Trial:
    """A trial from a run's summary (``itl_p99_ms``, ``scheduling_delay_p50_ms``, ``ttft_p50_ms``,
    ``errors``; ``refused`` count as errors to an SLO; ``good_share`` where targets were judged)."""
    errors = summary.get("errors", 0) + summary.get("refused", 0)
    return Trial(
        rate,
        summary["itl_p99_ms"],
        summary["scheduling_delay_p50_ms"],
        errors,
        summary,
        summary.get("good_share", 0.0),
        summary["ttft_p50_ms"],
    )


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
