"""Capacity under a TBT SLO on the simulator, for each way of scheduling.

The real scheduler on the cost model replays a trace at trial rates
(``core.analysis.capacity_search``'s search): with the token budget given; with the
largest budget the cost model puts within the SLO (the article's recipe);
with a TBT target of the SLO; unchunked; and, for a P:D pair, disaggregated
(P prefill and D decode workers: its capacity is the pair's); and, given an
acceptance rate, the TBT target with speculative decoding.

With a TTFT target, goodput capacity too (``core.analysis.capacity_search.Goodput``:
the highest rate at which 90 % of the requests were good, every one judged
at the TTFT target and the SLO, a refused one not good) of the TBT target
alone, both targets, and both with shedding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from stallfree.core.analysis.capacity_search import SLO, Goodput, Trial, budget_for, search, trial_from
from stallfree.core.analysis.cost_model import CostModel
from stallfree.core.analysis.disagg_plan import Link
from stallfree.core.analysis.disagg_sim import simulate_disaggregated
from stallfree.core.analysis.simulator import SimResult, report, simulate, trace_arrivals
from stallfree.core.analysis.traces import Replay, TraceRequest, replay
from stallfree.core.sched.config import CacheConfig, Chunking, SchedulerConfig, Speculate
from stallfree.core.sched.request import FinishReason
from stallfree.core.sched.timings import judge, percentile, request_timings


@dataclass(slots=True)
class Setup:
    """A trace and a machine to search capacity on."""

    requests: list[TraceRequest]  # the whole trace, as read
    how: Replay  # its window and lengths; each trial sets the rate
    config: SchedulerConfig
    cache: CacheConfig
    cost: CostModel
    disaggregate: tuple[int, int] | None = None  # prefill and decode workers
    link: Link | None = None  # their KV link
    acceptance: float | None = None  # drafts kept: adds the TBT target with speculation (SimDrafter)

    def at(self, rate: float) -> Replay:
        """How a trial at ``rate`` replays the trace: the same window at every rate,
        so a higher rate is the same work sooner and meeting the SLO is monotone in it."""
        return dataclasses.replace(self.how, rate=rate)

    def decode_iteration_ms(self, decodes: int) -> tuple[float, int]:
        """The decode-only iteration the SLOs are multiples of: ``decodes`` at the
        window's median prompt; returns it and that context."""
        context = int(percentile([r.prompt_tokens for r in replay(self.requests, self.how)], 50))
        return self.cost.iteration_s([context] * decodes, []) * 1e3, context

    def own_rate(self) -> float:
        """The window's own mean arrival rate (requests/s)."""
        window = replay(self.requests, dataclasses.replace(self.how, rate=None))
        span = window[-1].at_s
        return (len(window) - 1) / span if len(window) > 1 and span > 0 else 1.0


def modes(setup: Setup, slo: SLO, decodes: int, context: int) -> list[tuple[str, SchedulerConfig, bool]]:
    """(name, scheduler settings, disaggregated) for each way of scheduling compared."""
    config = setup.config
    untargeted = dataclasses.replace(config, tbt_slo_ms=0.0)
    fitted = budget_for(setup.cost, slo.tbt_p99_ms, decodes, context, config.max_model_len)
    out = [
        (f"token budget {config.token_budget}", untargeted, False),
        (f"token budget {fitted} (fits the SLO)", dataclasses.replace(untargeted, token_budget=fitted), False),
        (f"TBT target, budget {config.token_budget}", dataclasses.replace(config, tbt_slo_ms=slo.tbt_p99_ms), False),
        ("unchunked", dataclasses.replace(untargeted, chunking=Chunking.NONE), False),
    ]
    if setup.acceptance is not None:
        speculating = dataclasses.replace(config, tbt_slo_ms=slo.tbt_p99_ms, speculate=Speculate.NGRAM)
        name = f"TBT target + speculation ({setup.acceptance:.0%} of drafts kept)"
        out.append((name, speculating, False))
    if setup.disaggregate is not None:
        p, d = setup.disaggregate
        out.append((f"disaggregated {p}:{d}", untargeted, True))
    return out


def run_trial(setup: Setup, rate: float, mode: SchedulerConfig, disaggregated: bool) -> Trial:
    arrivals = trace_arrivals(replay(setup.requests, setup.at(rate)))
    if disaggregated:
        assert setup.disaggregate is not None and setup.link is not None
        p, d = setup.disaggregate
        summary = simulate_disaggregated(arrivals, p, d, setup.link, mode, setup.cache, setup.cost)["summary"]
    else:
        summary = report(simulate(arrivals, mode, setup.cache, setup.cost, setup.acceptance))["summary"]
    return trial_from(rate, summary)


AT_CAPACITY = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "max_gap_ms", "scheduling_delay_p50_ms")


def figures_at_capacity(row: dict[str, Any]) -> list[float]:
    """A mode's ``AT_CAPACITY`` figures (NaN where it met the SLO at no rate)."""
    at = row["at_capacity"] or {}
    return [at.get(k, float("nan")) for k in AT_CAPACITY]


def capacities(setup: Setup, slo: SLO, decodes: int, first: float) -> list[dict[str, Any]]:
    """Each mode's capacity, its figures at capacity and every trial."""
    _, context = setup.decode_iteration_ms(decodes)
    rows = []
    for name, mode, disaggregated in modes(setup, slo, decodes, context):

        def run(rate: float, mode: SchedulerConfig = mode, disaggregated: bool = disaggregated) -> Trial:
            return run_trial(setup, rate, mode, disaggregated)

        found = search(run, slo, first)
        best = found.at_capacity
        rows.append(
            {
                "mode": name,
                "capacity_req_per_s": found.rate,
                "at_capacity": best.figures if best is not None else None,
                "trials": [{"rate": t.rate, "meets": t.meets(slo), **t.figures} for t in found.trials],
            }
        )
    return rows


def good_share(result: SimResult, ttft_slo_ms: float, tbt_slo_ms: float) -> float:
    """The share of a run's requests good at these targets, whatever targets its
    scheduler ran with; refused ones count, as not good."""
    done = (FinishReason.STOP, FinishReason.LENGTH)
    good = sum(
        judge(request_timings(r.timeline), ttft_slo_ms, tbt_slo_ms, r.finish_reason in done).good
        for r in result.requests.values()
    )
    total = len(result.requests) + len(result.shed)
    return good / total if total else 0.0


def goodput_capacities(setup: Setup, slo: SLO, ttft_slo_ms: float, first: float) -> list[dict[str, Any]]:
    """Goodput capacity of the TBT target alone, both targets, and both with
    shedding, each judged at ``ttft_slo_ms`` and the SLO."""
    criterion = Goodput()
    tbt = dataclasses.replace(setup.config, tbt_slo_ms=slo.tbt_p99_ms, ttft_slo_ms=0.0)
    both = dataclasses.replace(tbt, ttft_slo_ms=ttft_slo_ms)
    rows = []
    for name, mode, shed in (
        ("TBT target", tbt, False),
        ("TBT + TTFT targets", both, False),
        ("both + shedding", both, True),
    ):

        def run(rate: float, mode: SchedulerConfig = mode, shed: bool = shed) -> Trial:
            arrivals = trace_arrivals(replay(setup.requests, setup.at(rate)))
            result = simulate(arrivals, mode, setup.cache, setup.cost, shed_load=shed)
            summary = report(result)["summary"]
            share = good_share(result, ttft_slo_ms, slo.tbt_p99_ms)
            figures = {**summary, "good_share": share}
            return Trial(rate, summary["itl_p99_ms"], summary["scheduling_delay_p50_ms"], 0, figures, share)

        found = search(run, criterion, first)
        best = found.at_capacity
        rows.append(
            {
                "mode": name,
                "goodput_capacity_req_per_s": found.rate,
                "at_capacity": best.figures if best is not None else None,
                "trials": [{"rate": t.rate, "meets": t.meets(criterion), **t.figures} for t in found.trials],
            }
        )
    return rows
