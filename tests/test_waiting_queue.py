"""The waiting queue's maintained answers against a scan of the same requests,
and the scheduler's count of queued prompts with TTFT targets against a scan."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.core.sched.request import RequestStatus
from stallfree.core.sched.waiting import WaitingQueue
from tests.simkit import examples, request, sim_engine

ops = st.lists(
    st.tuples(st.sampled_from(["add", "add_first", "remove"]), st.integers(0, 11), st.integers(1, 40)),
    max_size=120,
)


@settings(max_examples=examples(200), deadline=None)
@given(ops)
def test_the_queue_answers_as_a_scan_of_a_list_would(steps: list[tuple[str, int, int]]) -> None:
    queue, model = WaitingQueue(), []  # model: the list the scheduler kept before
    for op, n, size in steps:
        rid = f"r{n}"
        present = next((r for r in model if r.request_id == rid), None)
        if op == "remove":
            if present is not None:
                model.remove(present)
            queue.remove(present or request(rid, size))
            continue
        if present is not None:
            continue  # a request waits once
        req = request(rid, size, arrival_ns=size * 7 % 13)
        if op == "add":
            model.append(req)
            queue.add(req)
        else:
            model.insert(0, req)
            queue.add_first(req)
        assert list(queue) == model
        assert len(queue) == len(model) and all(r in queue for r in model)
        assert queue.oldest_arrival_ns() == min((r.arrival_ns for r in model), default=None)
        assert queue.most_pending_tokens() == max((r.num_pending_tokens for r in model), default=0)
    assert list(queue) == model
    assert queue.oldest_arrival_ns() == min((r.arrival_ns for r in model), default=None)
    assert queue.most_pending_tokens() == max((r.num_pending_tokens for r in model), default=0)


@settings(max_examples=examples(40), deadline=None)
@given(
    st.lists(st.tuples(st.integers(4, 60), st.sampled_from([None, 0.0, 50.0, 400.0]), st.booleans()), max_size=14),
    st.integers(8, 40),
)
def test_the_count_of_prompts_with_targets_follows_every_status_change(
    specs: list[tuple[int, float | None, bool]], blocks: int
) -> None:
    """Own targets only (none from the server), tight KV (preemption), aborts: the
    scheduler keeps deadlines exactly while a scan finds a queued prompt with a target."""
    e = sim_engine(num_blocks=blocks, block_size=4, token_budget=24, max_num_seqs=4, tbt_slo_ms=30.0)
    sched = e.scheduler
    reqs = []
    for i, (prompt, target, abort) in enumerate(specs):
        r = request(f"q{i}", min(prompt, blocks * 4 - 8), max_tokens=6)
        r.ttft_slo_ms = target
        reqs.append((r, abort))
        e.add_request(r)
    steps = 0
    while e.has_work and steps < 2_000:
        e.step()
        steps += 1
        if steps == 3:
            for r, abort in reqs:
                if abort:
                    e.abort_request(r.request_id)
        scan = any(r.ttft_slo_ms for r in sched.requests.values() if r.status != RequestStatus.DECODING)
        assert sched._keeps_deadlines() == scan
        assert all(r.status == RequestStatus.WAITING for r in sched.waiting)
    assert not e.has_work and not sched._keeps_deadlines()
