"""Admission's forecast kept as prompts come and go (``core.sched.forecast``)
against the scan it replaced, over random workloads: every place a newcomer
could take reads the same tokens ahead."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.core.sched.config import POLICIES, Policy
from stallfree.core.sched.deadline import Forecast, Pace, Place, deadline_ns, slack_s
from stallfree.core.sched.forecast import WaitingPlaces
from stallfree.core.sched.policy import class_rank, overdue_before
from stallfree.core.sched.request import RequestStatus
from tests.simkit import examples, request, sim_engine


def scanned(s, now_ns: int) -> Forecast | None:
    """The forecast as every queued request, read one by one, gives it (the code before)."""
    pace = s.pace
    if pace is None:
        return None
    cfg = s.config
    cutoff = overdue_before(now_ns, cfg.max_defer_s)
    queued: list[tuple[Place, int]] = []
    for r in s.requests.values():
        if r.status == RequestStatus.DECODING or s._prompt_pending(r.prefill_after):
            continue
        tokens = 1 if s._prompt_source(r) is not None else r.num_pending_tokens
        due = deadline_ns(r)
        on_time = due is not None and slack_s(r, now_ns, pace) >= 0
        if due is not None and not on_time and r.arrival_ns >= cutoff:
            continue
        rank = class_rank(cfg.policy, r.priority, r.tenant, r.num_pending_tokens, s.tenants.served)
        queued.append(((rank, due if on_time and due is not None else math.inf), tokens))
    return Forecast.of(pace, s.num_added, queued, s.tenants.active() if cfg.policy == "fair" else {})


spec = st.tuples(
    st.integers(0, 100),  # arrival, ms
    st.integers(4, 60),  # prompt tokens
    st.sampled_from([None, 0.0, 30.0, 200.0]),  # its own TTFT target, ms (None: the server's)
    st.integers(0, 2),  # priority
    st.sampled_from(["a", "b", "c"]),  # tenant
    st.sampled_from([False] * 5 + [True]),  # a second choice of the previous prompt (n > 1)
)


@settings(max_examples=examples(60), deadline=None)
@given(
    st.lists(spec, min_size=1, max_size=40),
    st.sampled_from(POLICIES),
    st.sampled_from([0.0, 100.0]),
    st.sampled_from([0.05, 0.3, 2.0]),
    st.integers(16, 60),
    st.sampled_from([1.0, 40.0]),
)
def test_the_kept_forecast_reads_as_the_scan_does(specs, policy, server_target, max_defer_s, blocks, slow):
    """Queues that build (a machine ``slow`` times the model's): prompts wait past
    their deadlines and past the ceiling, are admitted, preempted, finish."""
    e = sim_engine(
        num_blocks=blocks,
        block_size=4,
        token_budget=16,
        max_num_seqs=3,
        time_scale=slow,
        tbt_slo_ms=20.0,
        ttft_slo_ms=server_target,
        policy=policy,
        max_defer_s=max_defer_s,
    )
    s = e.scheduler
    pending = sorted(enumerate(specs), key=lambda p: p[1][0])
    steps, previous = 0, None
    while (pending or e.has_work) and steps < 3_000:
        while pending and pending[0][1][0] * 1_000_000 <= e.clock():
            i, (at_ms, prompt, target, priority, tenant, sibling) = pending.pop(0)
            size = min(prompt, blocks * 4 - 12)
            r = request(f"q{i}", size, max_tokens=4, arrival_ns=at_ms * 1_000_000, priority=priority)
            if sibling and previous is not None:
                r = request(f"q{i}", previous.prompt_token_ids, max_tokens=4, arrival_ns=r.arrival_ns)
                r.prefill_after = previous.request_id
            r.ttft_slo_ms, r.tenant = target, tenant
            e.add_request(r)
            previous = r
        out = e.step()
        if out is None and pending:
            e.clock.now_ns = pending[0][1][0] * 1_000_000
        steps += 1
        now = e.clock()
        kept, scan = s.forecast(now), scanned(s, now)
        assert (kept is None) == (scan is None)
        if kept is None or scan is None:
            continue
        assert kept.pace == scan.pace and kept.served == scan.served and kept.seen == scan.seen
        ranks = {p[0] for p in scan.places} | {-1, 0, 10**9}
        dues = {p[1] for p in scan.places} | {now, now + 10**8, math.inf}
        for place in [(r, d) for r in ranks for d in dues]:
            assert kept.ahead(place) == scan.ahead(place), (place, steps)


def test_the_deadline_heap_keeps_no_more_than_the_prompts_waiting():
    """Prompts admitted before their deadlines leave entries behind; without a
    forecast to drain them (no cost model sets a pace) the heap is compacted."""
    from stallfree.core.sched.forecast import WaitingPlaces

    places = WaitingPlaces()
    for i in range(1_000):
        r = request(f"p{i}", 8, arrival_ns=i)
        r.ttft_slo_ms = 1_000.0
        places.add(r)
        places.remove(r)
    assert len(places._by_due) <= 64 + 2


def test_a_standing_prompt_leaves_its_sum_by_what_it_was_summed_under():
    """Admission records a prompt's cached prefix before the queue lets it go,
    so its tokens to prefill drop on the way out; under SJF they are its class.
    Removal once looked the class up by the new count (KeyError: found by the
    scheduler's property test with prefixes shared under a TTFT target)."""
    places = WaitingPlaces()
    places.places(0, Pace(64, 0.01), Policy.SJF, 0.05, {})  # sets the policy: standing prompts are summed
    kept, leaving = request("kept", 6), request("leaving", 6)
    for r in (kept, leaving):
        places.add(r)  # no TTFT target: standing at once
    leaving.num_computed_tokens = 4  # its prefix found in the cache
    places.remove(leaving)
    assert places.places(1, Pace(64, 0.01), Policy.SJF, 0.05, {}) == [
        ((class_rank(Policy.SJF, 0, "", 6, {}), math.inf), 6)
    ]
