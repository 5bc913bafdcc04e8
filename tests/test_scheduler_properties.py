"""Scheduler invariants over random arrival traces (hypothesis).

Each example runs a random workload (arrivals, prompt and output lengths,
shared prefixes, aborts) under a random configuration on SimRunner and checks
every iteration:
- the token budget is never exceeded;
- in stall_free mode every request decoding before the iteration gets its
  token unless preempted;
- partial prefills stay within max_partial_prefills;
- while an overdue request (waited > max_defer_s) waits, nothing younger is
  admitted ahead of it unless that one finishes its prompt in the same chunk;
- KV blocks always cover computed tokens, and all return when the run ends;
- the oldest long partial prefill gets a chunk in every iteration that has
  budget left after the decodes (short prompts go first, never all of it);
- a preempted decode never has higher priority than one that was served;
- under a TBT target, an iteration with decodes is predicted within the
  target unless the floor was in force (it says so), and every prompt still
  finishes (the floor and the long prompt's share keep prefill moving);
- with speculation on (outputs of a 3-token vocabulary repeat, so drafts are
  proposed, kept and rejected), all of the above hold with the drafts
  counted: rejected drafts' blocks go back, preemption and aborts mid-speculation leak nothing.
And: chunked, unchunked and decode-first runs, roomy or tight KV (with
preemption), sized by a TBT target or not, speculating or not, give
identical token streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from stallfree.core.analysis.cost_model import LLAMA3_8B, CostModel, HardwareSpec
from stallfree.core.sched.config import CHUNKING_MODES, POLICIES
from stallfree.core.sched.deadline import deadline_ns, slack_s
from stallfree.core.sched.engine import RequestRejected, check_request
from stallfree.core.sched.request import FinishReason, RequestStatus
from tests.simkit import examples, request, sim_engine, tokens

PREFIXES = {name: tokens(("prefix", name), 24) for name in ("sys-a", "sys-b")}
# The article's model on a slow accelerator: 0.8 ms per token of compute, so a
# target of a few tokens' time binds on these small batches.
SLOW = CostModel(LLAMA3_8B, HardwareSpec("slow", flops=20e12, mem_bw=3e12), attention=True)


@dataclass
class Spec:
    at_ms: int
    prompt: int
    max_tokens: int
    prefix: str | None
    priority: int
    abort_after_steps: int | None


spec = st.builds(
    Spec,
    at_ms=st.integers(0, 400),
    prompt=st.integers(1, 90),
    max_tokens=st.integers(1, 40),
    prefix=st.sampled_from([None, "sys-a", "sys-b"]),
    priority=st.integers(-2, 2),
    abort_after_steps=st.one_of(st.none(), st.integers(1, 30)),
)

config = st.fixed_dictionaries(
    {
        "token_budget": st.integers(8, 96),
        "max_num_seqs": st.integers(1, 8),
        "max_partial_prefills": st.integers(1, 3),
        "chunking": st.sampled_from(CHUNKING_MODES),
        "policy": st.sampled_from(POLICIES),
        "dynamic_chunking": st.booleans(),
        "max_defer_s": st.sampled_from([0.05, 0.2, 30.0]),
        "decode_reserve_tokens": st.sampled_from([0, 0, 4, 16]),
        "tbt_slo_ms": st.sampled_from([0.0, 0.0, 5.0, 8.0, 15.0, 30.0]),
        "ttft_slo_ms": st.sampled_from([0.0, 0.0, 20.0, 100.0, 1000.0]),
        "speculate": st.sampled_from(["off", "ngram"]),
        "draft_tokens": st.integers(1, 6),
    }
)
SMALL_VOCAB = 20  # SimRunner draws tokens 17..19: outputs repeat, prompt lookup proposes drafts


def build(i: int, s: Spec):
    prompt = (PREFIXES[s.prefix] if s.prefix else []) + tokens(("req", i), s.prompt)
    return request(f"r{i}", prompt, max_tokens=s.max_tokens, arrival_ns=s.at_ms * 1_000_000, priority=s.priority)


def run(
    specs: list[Spec],
    cfg: dict,
    num_blocks: int,
    block_size: int,
    aborts: bool = True,
    check=None,
    max_model_len: int = 256,
):
    """Drive a trace to completion on a virtual clock; returns the engine and the requests."""
    e = sim_engine(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        cost=SLOW,
        vocab_size=SMALL_VOCAB,
        **cfg,
    )
    if check is not None:
        e.scheduler.schedule = check(e, e.scheduler.schedule)
    reqs = [build(i, s) for i, s in enumerate(specs)]
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_ns)
    added_at: dict[int, int] = {}
    steps = 0
    while pending or e.has_work:
        if not e.has_work:
            e.clock.now_ns = max(e.clock.now_ns, reqs[pending[0]].arrival_ns)
        while pending and reqs[pending[0]].arrival_ns <= e.clock.now_ns:
            i = pending.pop(0)
            if reqs[i].num_prompt_tokens >= e.config.max_model_len:
                with pytest.raises(RequestRejected):  # the check the gateway makes before any engine sees it
                    check_request(reqs[i].num_prompt_tokens, reqs[i].sampling, e.config.max_model_len, SMALL_VOCAB)
                reqs[i].status = RequestStatus.FINISHED  # refused before any work
                continue
            e.add_request(reqs[i])
            added_at[i] = steps
        if aborts:
            for i, s in enumerate(specs):
                if s.abort_after_steps is not None and added_at.get(i) == steps - s.abort_after_steps:
                    e.abort_request(reqs[i].request_id)
        out = e.step()
        if out is None and e.has_work:
            assert pending, "requests remain but none can be scheduled"
            e.clock.now_ns = reqs[pending[0]].arrival_ns
        steps += 1
        assert steps < 20_000
    return e, reqs


def invariants(e, schedule):
    cfg_holder = e.scheduler

    def checked(now_ns):
        cfg = cfg_holder.config
        decoding = {r for r in cfg_holder.running if r.status == RequestStatus.DECODING}
        partial_before = {r for r in cfg_holder.running if r.status == RequestStatus.PREFILLING}
        waiting_before = set(cfg_holder.waiting)
        limit = cfg.long_prefill_tokens or cfg.token_budget
        long_partial = [
            r for r in cfg_holder.running if r.status == RequestStatus.PREFILLING and r.num_pending_tokens > limit
        ]
        for r in decoding:  # no block beyond its KV: a rejected draft's block went back
            assert len(r.block_ids) == e.kv.blocks_for(r.num_computed_tokens), r.request_id
        deadline = now_ns - int(cfg.max_defer_s * 1e9)
        batch = schedule(now_ns)
        if batch.draft_tokens:
            event("drafts verified")
            assert cfg.speculate == "ngram"
            assert all(
                i.samples and not i.is_prefill and i.num_tokens == 1 + len(i.drafts) for i in batch.items if i.drafts
            )
        overdue_partial = [
            r for r in cfg_holder.running if r.status == RequestStatus.PREFILLING and r.arrival_ns < deadline
        ]

        def on_time(r) -> bool:  # can it still make its TTFT target, at this iteration's pace?
            return deadline_ns(r) is not None and slack_s(r, now_ns, cfg_holder.pace) >= 0

        if cfg.chunking == "stall_free" and batch.decode_tokens < cfg.token_budget:
            if not cfg.ttft_slo_ms and long_partial:
                assert any(i.request is long_partial[0] for i in batch.items), "a long prefill starved"
            if cfg.ttft_slo_ms and overdue_partial:  # deadlines order prefill; the ceiling bounds the rest
                assert any(
                    i.is_prefill and (i.request.arrival_ns < deadline or on_time(i.request)) for i in batch.items
                ), "an overdue prefill starved behind prompts that cannot make their targets"
        if batch.yielded:  # partial prefills give their slot only to prompts admitted now, under TTFT targets
            event("a partial prefill yielded its slot")
            admitted = [i.request for i in batch.items if i.request in waiting_before]
            assert cfg.ttft_slo_ms and set(batch.yielded) <= partial_before
            assert len(batch.yielded) <= len(admitted)
            assert all(r.status == RequestStatus.WAITING and not r.block_ids for r in batch.yielded)
        served = [i.request for i in batch.items if not i.is_prefill]
        for victim in batch.preempted:
            assert all(victim.priority >= r.priority for r in served), "preempted ahead of lower priority"
        if batch.target_s:
            assert cfg.tbt_slo_ms and batch.decode_tokens, "a target applies only while decodes run"
            event(f"TBT floor in force: {batch.over_target}")
            if batch.over_target is None:
                assert e.scheduler.cost.iteration_s(*batch.shape()) <= batch.target_s, "sized over the target"
        cap = max(cfg.token_budget, cfg.max_model_len) if cfg.chunking == "none" else cfg.token_budget
        assert batch.num_tokens <= cap
        if cfg.chunking == "stall_free":
            decoded = {i.request for i in batch.items if not i.is_prefill}
            assert decoded | set(batch.preempted) == decoding
        finishing = {i.request for i in batch.items if i.is_prefill and i.samples}
        still_partial = [r for r in cfg_holder.running if r.status == RequestStatus.PREFILLING and r not in finishing]
        assert len(still_partial) <= cfg.max_partial_prefills
        if any(r.arrival_ns < deadline for r in cfg_holder.waiting):
            for item in batch.items:
                r = item.request
                if r in waiting_before and r.arrival_ns >= deadline and not (cfg.ttft_slo_ms and on_time(r)):
                    assert item.samples, f"{r.request_id} admitted ahead of an overdue request"
        bs = e.kv.block_size
        for r in cfg_holder.running:
            assert len(r.block_ids) * bs >= r.num_computed_tokens
        for item in batch.items:
            assert len(item.request.block_ids) * bs >= item.start + item.num_tokens
        assert e.kv.num_free_blocks + e.kv.num_used_blocks == e.kv.num_blocks
        e.kv.check_invariants(cfg_holder.requests.values())  # ref counts, free lists, hashes, reserve
        return batch

    return checked


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(spec, min_size=1, max_size=14),
    cfg=config,
    num_blocks=st.integers(12, 160),
    block_size=st.sampled_from([2, 4, 8]),
)
def test_invariants_hold_on_random_traces(specs, cfg, num_blocks, block_size):
    e, reqs = run(specs, cfg, num_blocks, block_size, check=invariants)
    event(f"preempted: {e.scheduler.num_preemptions > 0}")
    event(f"prefix hits: {e.kv.prefix_hit_tokens > 0}")
    assert all(r.status == RequestStatus.FINISHED for r in reqs)
    assert e.kv.num_free_blocks == e.kv.num_blocks
    assert e.kv.num_reserved_blocks == 0
    for r, s in zip(reqs, specs, strict=True):
        if r.finish_reason == FinishReason.LENGTH:
            assert r.num_output_tokens == s.max_tokens or r.num_tokens == e.config.max_model_len


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(spec, min_size=1, max_size=10),
    budget=st.integers(12, 64),
    policy=st.sampled_from(POLICIES),
    tight_blocks=st.integers(32, 60),
)
def test_token_streams_identical_across_modes_and_memory(specs, budget, policy, tight_blocks):
    results = []
    for chunking, blocks, dynamic, tbt_slo_ms, speculate in [
        ("stall_free", 400, False, 0.0, "off"),
        ("none", 400, False, 0.0, "off"),
        ("decode_first", 400, False, 0.0, "off"),
        ("stall_free", tight_blocks, True, 0.0, "off"),
        ("stall_free", 400, False, 8.0, "off"),
        ("stall_free", 400, False, 0.0, "ngram"),
        ("stall_free", tight_blocks, False, 8.0, "ngram"),
    ]:
        cfg = {
            "token_budget": budget,
            "max_num_seqs": 6,
            "chunking": chunking,
            "policy": policy,
            "dynamic_chunking": dynamic,
            "decode_reserve_tokens": 0,
            "tbt_slo_ms": tbt_slo_ms,
            "speculate": speculate,
        }
        e, reqs = run(specs, cfg, blocks, 4, aborts=False, max_model_len=128)
        results.append([r.output_token_ids for r in reqs])
        if blocks == tight_blocks:
            event(f"tight run preempted: {e.scheduler.num_preemptions > 0}")
        if speculate == "ngram":
            event(f"drafts kept: {sum(r.num_accepted_tokens for r in reqs) > 0}")
            event(f"drafts rejected: {sum(r.num_draft_tokens - r.num_accepted_tokens for r in reqs) > 0}")
    assert all(r == results[0] for r in results[1:])
