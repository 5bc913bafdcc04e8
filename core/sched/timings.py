"""Intervals derived from a request's timestamps, and percentiles.

queue_wait + prefill + decode = e2e by construction:
  queue_wait = first scheduled - arrival
  prefill    = first token - first scheduled
  decode     = finish - first token
Gaps (itl) are per token, never averaged per request first.

The scheduling delay (Sarathi-Serve's capacity rule reads its median) is the
time before the first token that the prompt was not being computed: arrival
to first token, less the iterations its prompt's chunks ran in. Where a
started prompt runs in every iteration until it is done (vLLM; stallfree
without a TTFT target) that is queue_wait, up to the moments between
iterations; where a TTFT target lets a prompt past its deadline give way to
ones that can still make theirs, its first chunk says little: a prompt
started early and then passed over had a short queue_wait and a long wait.
A prompt spread thin (a few tokens in each of many iterations) counts each
of them as computing it, so under a deadline order that spreads the late
ones the median can stay low while their first tokens come late: judge
such a scheduler by goodput.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from stallfree.core.sched.request import Request, Timeline


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def weighted_percentile(pairs: Iterable[tuple[float, int]], q: float) -> float:
    """The smallest value that at least q % of the weight lies at or below (q in
    0..100): a percentile of (value, count) pairs, each pair standing for count
    equal values, such as an iteration's ratio for each of its decodes' gaps.
    0.0 for no weight."""
    ordered = sorted(pairs)
    total = sum(weight for _, weight in ordered)
    if total <= 0:
        return 0.0
    needed, seen = total * q / 100.0, 0
    for value, weight in ordered:
        seen += weight
        if seen >= needed:
            return value
    return ordered[-1][0]


def gaps_ns(timeline: Timeline) -> list[int]:
    t = timeline.token_ns
    return [b - a for a, b in itertools.pairwise(t)]


@dataclass(slots=True)
class RequestTimings:
    queue_wait_ms: float
    scheduling_delay_ms: float  # before the first token (or the end), not computing its prompt
    prefill_ms: float
    decode_ms: float
    ttft_ms: float
    e2e_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    max_gap_ms: float
    stalled_gaps: int  # gaps during which another request's prefill chunk ran

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


def request_timings(timeline: Timeline) -> RequestTimings:
    """Timings of a finished (or aborted) request; phases never reached count as 0."""
    ms = 1e-6
    arrival = timeline.arrival_ns
    end = timeline.finished_ns if timeline.finished_ns is not None else arrival
    scheduled = timeline.scheduled_ns if timeline.scheduled_ns is not None else end
    first = timeline.first_token_ns if timeline.first_token_ns is not None else end
    gaps = [g * ms for g in gaps_ns(timeline)]
    computing = sum(c.end_ns - c.start_ns for c in timeline.chunks if c.start_ns < first)  # not a recompute's
    return RequestTimings(
        queue_wait_ms=(scheduled - arrival) * ms,
        scheduling_delay_ms=max(0, first - arrival - computing) * ms,
        prefill_ms=(first - scheduled) * ms,
        decode_ms=(end - first) * ms,
        ttft_ms=(first - arrival) * ms if timeline.first_token_ns is not None else 0.0,
        e2e_ms=(end - arrival) * ms,
        itl_p50_ms=percentile(gaps, 50),
        itl_p99_ms=percentile(gaps, 99),
        max_gap_ms=max(gaps, default=0.0),
        stalled_gaps=sum(timeline.stalled),
    )


@dataclass(slots=True, frozen=True)
class Goodness:
    """Did a request meet its targets? Good: it completed and met both (a
    target of 0 is met by anything)."""

    ttft_met: bool
    tbt_met: bool
    completed: bool  # ended by a stop or its length, not cut off, aborted or failed

    @property
    def good(self) -> bool:
        return self.completed and self.ttft_met and self.tbt_met


def judge(timings: RequestTimings, ttft_slo_ms: float, tbt_slo_ms: float, completed: bool) -> Goodness:
    """A request against its TTFT target (its first token) and its TBT target
    (the 99th percentile of its own gaps; its worst gap is reported beside)."""
    ttft_met = not ttft_slo_ms or 0 < timings.ttft_ms <= ttft_slo_ms  # 0: no first token
    tbt_met = not tbt_slo_ms or timings.itl_p99_ms <= tbt_slo_ms
    return Goodness(ttft_met, tbt_met, completed)


def summarize(requests: Iterable[Request], start_ns: int, end_ns: int) -> dict[str, float]:
    """A run's latency figures over its requests: every TTFT, queue wait,
    scheduling delay and gap pooled, throughput over [start_ns, end_ns]."""
    ttfts: list[float] = []
    waits: list[float] = []
    delays: list[float] = []
    gaps: list[float] = []
    out_tokens = 0
    for req in requests:
        timings = request_timings(req.timeline)
        ttfts.append(timings.ttft_ms)
        waits.append(timings.queue_wait_ms)
        delays.append(timings.scheduling_delay_ms)
        gaps += [g / 1e6 for g in gaps_ns(req.timeline)]
        out_tokens += req.num_output_tokens
    duration_ns = end_ns - start_ns
    return {
        "duration_ms": duration_ns / 1e6,
        "output_tokens": out_tokens,
        "throughput_tokens_per_s": out_tokens / (duration_ns / 1e9) if duration_ns > 0 else 0.0,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "queue_wait_p50_ms": percentile(waits, 50),
        "scheduling_delay_p50_ms": percentile(delays, 50),
        "itl_p50_ms": percentile(gaps, 50),
        "itl_p99_ms": percentile(gaps, 99),
        "max_gap_ms": max(gaps, default=0.0),
    }
