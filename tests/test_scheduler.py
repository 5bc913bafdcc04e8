"""Scheduler behaviour, one rule per test, on the engine with SimRunner."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.core.analysis.cost_model import CostModel, HardwareSpec, ModelSpec
from stallfree.core.sched import scheduler as scheduler_module
from stallfree.core.sched.chunk_rule import even_share
from stallfree.core.sched.config import SchedulerConfig
from stallfree.core.sched.engine import check_request
from stallfree.core.sched.request import RequestStatus
from tests.simkit import request, run_to_completion, sim_engine
from tests.simkit import step_items as run_step


def step_items(engine):
    """Run one iteration; return [(request id, tokens, is_prefill)] in batch order."""
    return run_step(engine)[0]


def start_decoding(engine, *rids, prompt=4, max_tokens=50):
    for rid in rids:
        engine.add_request(request(rid, prompt, max_tokens=max_tokens))
    while any(engine.scheduler.requests[r].status != RequestStatus.DECODING for r in rids):
        engine.step()


def test_decodes_first_then_partial_then_new_within_budget():
    e = sim_engine(token_budget=40, max_num_seqs=8)
    start_decoding(e, "d1", "d2")
    e.add_request(request("long", 60))
    items = step_items(e)
    assert items[:2] == [("d1", 1, False), ("d2", 1, False)]
    # 60 tokens need two iterations of the 38 the decodes leave: two even chunks, not 38 and 22
    assert items[2] == ("long", 30, True)
    e.add_request(request("new", 30))
    items = step_items(e)
    # the partial prefill's next chunk comes before the newcomer, which takes what is left
    assert [i[0] for i in items] == ["d1", "d2", "long", "new"]
    assert sum(n for _, n, _ in items) == 40
    assert items[2:] == [("long", 30, True), ("new", 8, True)]


def test_partial_prefill_cap_still_admits_prompts_that_finish_in_one_chunk(monkeypatch):
    # Without a per-chunk limit a partial prefill takes all leftover budget, so
    # at most one exists; with one (dynamic chunking, a TBT target; here a
    # fixed 10 tokens in place of the budget's rule) several can, and the cap bounds them.
    class TenAtMost:
        def chunk(self, batch, prefix, pending, left):
            return min(10, pending, left), False

    monkeypatch.setattr(scheduler_module, "BUDGET", TenAtMost())
    e = sim_engine(token_budget=40, max_num_seqs=8, max_partial_prefills=2)
    for rid in ("long1", "long2", "long3"):
        e.add_request(request(rid, 100))
    e.add_request(request("short", 3))
    items = step_items(e)
    # short goes first; long3 would be a third partial prefill, so it waits
    assert items == [("short", 3, True), ("long1", 10, True), ("long2", 10, True)]
    assert e.scheduler.num_partial_prefills == 2
    items = step_items(e)
    assert [i[0] for i in items] == ["short", "long1", "long2"]
    while e.has_work:
        e.step()
        assert e.scheduler.num_partial_prefills <= 2


def test_kv_admission_checks_final_footprint():
    # 12 blocks of 4 tokens = 48 tokens of KV
    e = sim_engine(
        num_blocks=12, block_size=4, token_budget=24, max_num_seqs=8, decode_reserve_tokens=4, long_prefill_tokens=64
    )
    e.add_request(request("a", 30, max_tokens=4))  # footprint 34 tokens -> 9 blocks
    e.add_request(request("b", 12, max_tokens=4))  # footprint 16 -> 4 blocks: would not fit next to a
    items = step_items(e)
    assert [i[0] for i in items] == ["a"]  # b's first chunk would fit, its final footprint does not
    items = step_items(e)
    assert [i[0] for i in items] == ["a"]
    run_to_completion(e)
    assert e.scheduler.requests == {}
    assert e.kv.num_free_blocks == 12


def test_preemption_newest_first_and_recompute_gives_same_tokens():
    def run(num_blocks):
        e = sim_engine(num_blocks=num_blocks, block_size=4, token_budget=32, max_num_seqs=8, decode_reserve_tokens=0)
        for i in range(4):
            e.add_request(request(f"r{i}", 6, max_tokens=20))
        preempted = []
        while e.has_work:
            before = {r.request_id: r.num_preemptions for r in e.scheduler.requests.values()}
            out = e.step()
            if out and out.iteration and out.iteration.preemptions:
                now = {r.request_id: r.num_preemptions for r in e.scheduler.requests.values()}
                preempted += [rid for rid in now if now[rid] > before.get(rid, 0)]
        return e, preempted

    _roomy, none = run(256)
    tight, preempted = run(20)  # 4 x 26 tokens needs 28 blocks
    assert none == []
    assert tight.scheduler.num_preemptions > 0
    assert preempted[0] == "r3"  # the newest decode goes first
    assert tight.kv.num_free_blocks == 20


def test_preempted_request_tokens_identical():
    def outputs(num_blocks):
        e = sim_engine(num_blocks=num_blocks, block_size=4, token_budget=32, max_num_seqs=8, decode_reserve_tokens=0)
        reqs = [request(f"r{i}", 6, max_tokens=20) for i in range(4)]
        for r in reqs:
            e.add_request(r)
        run_to_completion(e)
        return [r.output_token_ids for r in reqs], e.scheduler.num_preemptions

    (roomy, p0), (tight, p1) = outputs(256), outputs(20)
    assert p0 == 0
    assert p1 > 0
    assert roomy == tight


def test_unchunked_mode_freezes_decodes_for_a_whole_prompt():
    e = sim_engine(token_budget=40, max_num_seqs=8, max_model_len=512, chunking="none")
    start_decoding(e, "d1", "d2")
    e.add_request(request("long", 300))
    items = step_items(e)
    assert items == [("long", 300, True)]  # one iteration, whole prompt, decodes wait
    items = step_items(e)
    assert {i[0] for i in items} == {"d1", "d2", "long"}
    assert all(not p for _, _, p in items)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 600))
def test_an_even_share_takes_as_many_iterations_as_filling_the_budget(pending, left):
    """Placed chunk after chunk at ``left`` a time: the iterations filling each
    would take, no chunk over ``left``, and no two differing by more than one."""
    sizes = []
    while pending:
        sizes.append(even_share(pending, left))
        pending -= sizes[-1]
    assert len(sizes) == math.ceil(sum(sizes) / left)
    assert max(sizes) <= left and max(sizes) - min(sizes) <= 1


def test_a_prompt_longer_than_the_budget_runs_in_even_chunks():
    """2,000 tokens beside 8 decodes at budget 256: the nine iterations the
    leftover 248 needs, as chunks of 222 or 223, not eight of 248 and a last of
    16: the last full chunk reads the longest prefix, and it is the smaller."""
    e = sim_engine(num_blocks=1024, token_budget=256, max_num_seqs=16, max_model_len=4096)
    start_decoding(e, *(f"d{i}" for i in range(8)), max_tokens=100)
    e.add_request(request("long", 2000))
    sizes = []
    while e.scheduler.requests["long"].status != RequestStatus.DECODING:
        items = step_items(e)
        assert sum(1 for _, _, prefill in items if not prefill) == 8
        sizes += [n for rid, n, prefill in items if rid == "long"]
    assert sizes == [223, 223] + [222] * 7


def test_decode_first_mode_waits_for_decodes_to_finish():
    e = sim_engine(token_budget=40, max_num_seqs=8, chunking="decode_first")
    start_decoding(e, "d1", max_tokens=5)
    e.add_request(request("new", 8))
    while "d1" in e.scheduler.requests:
        assert [i[0] for i in step_items(e)] == ["d1"]
    assert [i[0] for i in step_items(e)] == ["new"]


def test_mode_switch_live_takes_effect_next_iteration():
    e = sim_engine(token_budget=40, max_num_seqs=8, max_model_len=512)
    start_decoding(e, "d1")
    e.add_request(request("long", 200))
    assert step_items(e) == [("d1", 1, False), ("long", 34, True)]  # 200 in six iterations of 39 at most
    assert e.reconfigure({"chunking": "none"}) == []
    assert step_items(e) == [("long", 166, True)]  # the rest of the partial prefill, whole
    with pytest.raises(ValueError, match="cannot be changed at runtime") as info:
        e.reconfigure({"max_num_seqs": 3})
    assert "max_num_seqs" not in str(info.value)  # a name is the caller's input: never echoed
    with pytest.raises(ValueError, match="chunking"):
        e.reconfigure({"chunking": "sometimes"})


def test_budget_clamped_with_warning():
    config, warnings = SchedulerConfig(token_budget=64, max_num_seqs=64).validated()
    assert config.token_budget == 80
    assert "clamped" in warnings[0]
    e = sim_engine(token_budget=10, max_num_seqs=8)
    assert e.config.token_budget == 24
    assert e.warnings
    assert e.reconfigure({"token_budget": 4})
    assert e.config.token_budget == 24


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("fcfs", "a"), ("sjf", "c"), ("priority", "b"), ("fair", "a")],
)
def test_waiting_policies(policy, expected):
    e = sim_engine(token_budget=24, max_num_seqs=1, policy=policy)
    e.add_request(request("a", 12, arrival_ns=0))
    e.add_request(request("b", 10, arrival_ns=1, priority=-1))
    e.add_request(request("c", 5, arrival_ns=2))
    assert step_items(e)[0][0] == expected


def test_lpm_prefers_longest_cached_prefix():
    e = sim_engine(token_budget=40, max_num_seqs=1, policy="lpm", block_size=4)
    shared = list(range(1000, 1024))
    e.add_request(request("warm", [*shared, 1], max_tokens=1))
    run_to_completion(e)
    e.add_request(request("cold", list(range(5000, 5020)), arrival_ns=1))
    e.add_request(request("hit", [*shared, 2, 3], arrival_ns=2))
    items = step_items(e)
    assert items == [("hit", 2, True)]  # 24 of 26 tokens came from the cache
    assert e.scheduler.requests["hit"].num_cached_tokens == 24


def test_starvation_ceiling_lets_overdue_request_jump_the_queue():
    e = sim_engine(token_budget=24, max_num_seqs=1, policy="sjf", max_defer_s=1.0)
    e.add_request(request("long", 20, arrival_ns=0, max_tokens=1))
    e.add_request(request("short", 2, arrival_ns=0, max_tokens=1))
    e.clock.now_ns = 2_000_000_000  # both overdue: oldest first, then by arrival
    e.add_request(request("fresh", 1, arrival_ns=2_000_000_000, max_tokens=1))
    assert step_items(e)[0][0] == "long"


def test_abort_mid_prefill_and_mid_decode_frees_blocks():
    e = sim_engine(num_blocks=64, token_budget=24)
    start_decoding(e, "dec")
    e.add_request(request("pre", 100))
    e.step()
    assert e.scheduler.requests["pre"].status == RequestStatus.PREFILLING
    assert e.abort_request("pre")
    assert e.abort_request("dec")
    assert not e.abort_request("nope")
    out = e.step()
    assert {o.request_id: o.finish_reason for o in out.outputs} == {"pre": "abort", "dec": "abort"}
    assert e.kv.num_free_blocks == 64
    assert e.kv.num_reserved_blocks == 0
    assert not e.has_work


def test_stop_tokens_and_ignore_eos():
    probe = sim_engine()
    r = request("p", 5, max_tokens=6)
    probe.add_request(r)
    run_to_completion(probe)
    third = r.output_token_ids[2]
    e = sim_engine()
    stop = request("s", r.prompt_token_ids, max_tokens=6, stop_token_ids=(third,))
    e.add_request(stop)
    run_to_completion(e)
    assert stop.output_token_ids == r.output_token_ids[:3]
    assert stop.finish_reason == "stop"
    e.scheduler.eos_token_ids = frozenset({third})
    ignore = request("i", r.prompt_token_ids, max_tokens=6, ignore_eos=True)
    eos = request("e", r.prompt_token_ids, max_tokens=6)
    e.add_request(ignore)
    e.add_request(eos)
    run_to_completion(e)
    assert ignore.finish_reason == "length"
    assert len(ignore.output_token_ids) == 6
    assert eos.finish_reason == "stop"
    assert len(eos.output_token_ids) == 3


def test_dynamic_chunking_shrinks_later_chunks():
    e = sim_engine(token_budget=64, max_num_seqs=8, dynamic_chunking=True, max_model_len=100_000, num_blocks=4096)
    e.add_request(request("long", 6000, max_tokens=1))
    sizes = []
    while e.has_work:
        sizes += [n for _, n, p in step_items(e) if p]
    body = sizes[:-1]  # the last chunk is whatever remains
    assert sum(sizes) == 6000
    assert body[0] == 64
    assert body[-1] < 56
    assert all(a >= b for a, b in itertools.pairwise(body))


# `serve --sim`'s cost model: the embedded 135M model on the CPU-like hardware (core.build),
# where attention over a long prefix costs far more than the projections: a 512-token chunk
# takes 0.34 s with no prefix, 1.9 s after 7,000 tokens
SIM_CPU = CostModel(
    ModelSpec("smollm2-135m", 134515008, 2.0, layers=30, heads=9, kv_heads=3, head_dim=64),
    HardwareSpec("cpu-like", flops=0.5e12, mem_bw=10e9, overhead_s=0.007, attention_flops=0.16e12),
    attention=True,
    kv_reads=True,
)


def test_dynamic_chunking_levels_the_whole_iteration_under_a_flood_of_long_prompts():
    # A decode streams while long prompts flood in, two partial prefills at a time.
    # Each iteration (the decode and every chunk) stays within what a budget-sized
    # chunk with no prefix takes, as the prompts' prefixes grow, unless the prefill
    # floor is all it holds; the decode gets its token in every one, nobody is
    # preempted and every prompt finishes. (Levelling each chunk alone let two
    # chunks and the decode run an iteration to twice the level.)
    e = sim_engine(
        num_blocks=4096, block_size=16, cost=SIM_CPU, token_budget=512, max_num_seqs=16, dynamic_chunking=True
    )
    e.add_request(request("canary", 4, max_tokens=100_000))
    while e.scheduler.requests["canary"].status != RequestStatus.DECODING:
        e.step()
    prompts = [f"long{i}" for i in range(4)]
    for rid in prompts:
        e.add_request(request(rid, 2500, max_tokens=4))
    level_s = SIM_CPU.iteration_s([], [(0, 512)])
    floor = e.config.prefill_floor
    over = []
    for _ in range(1000):  # it takes about 40
        if not any(rid in e.scheduler.requests for rid in prompts):
            break
        items, record = run_step(e)
        assert ("canary", 1, False) in items
        if record.predicted_ns > level_s * 1e9 * (1 + 1e-9) and record.prefill_tokens > floor:
            over.append((record.iteration, record.chunks, round(record.predicted_ns / 1e9 / level_s, 2)))
    assert over == []
    assert e.scheduler.num_preemptions == 0
    assert not any(rid in e.scheduler.requests for rid in prompts), "a prompt did not finish"


def test_an_iteration_record_carries_what_its_prediction_read():
    # The cost model reads each decode's context and each chunk's prefix; the
    # record sums them, so the iterations' scatter can be told apart by shape.
    e = sim_engine(token_budget=40, max_num_seqs=8, cost=SIM_CPU)
    start_decoding(e, "d1", "d2", prompt=4)  # each 4 cached (+ its first token, not yet cached)
    e.add_request(request("long", 60))
    items, first = run_step(e)
    assert items[2] == ("long", 30, True) and first.chunk_prefix_tokens == 0
    contexts = [e.scheduler.requests[r].num_computed_tokens for r in ("d1", "d2")]
    items, second = run_step(e)
    assert items[2] == ("long", 30, True) and second.chunk_prefix_tokens == 30
    assert second.decode_context_tokens == sum(contexts) > 0


def test_runner_failure_fails_only_that_batch():
    e = sim_engine()
    e.add_request(request("x", 4))
    real = e.runner.execute

    def boom(batch):
        raise RuntimeError("device lost")

    e.runner.execute = boom
    out = e.step()
    assert [(o.request_id, o.finish_reason) for o in out.outputs] == [("x", "error")]
    e.runner.execute = real
    e.add_request(request("y", 4, max_tokens=2))
    run_to_completion(e)
    assert e.kv.num_used_blocks == 0


def test_requests_that_can_never_run_are_refused():
    e = sim_engine(num_blocks=8, block_size=4, max_model_len=64)
    assert e.config.max_model_len == 32
    assert "exceeds the KV cache" in e.warnings[0]

    def check(req):  # the one check, which the gateway makes before any engine sees a request
        check_request(req.num_prompt_tokens, req.sampling, e.config.max_model_len, e.runner.vocab_size)

    with pytest.raises(ValueError, match="context limit is 32"):
        check(request("a", 32))
    with pytest.raises(ValueError, match="empty"):
        check(request("c", []))
    with pytest.raises(ValueError, match="temperature"):
        check(request("d", 4, temperature=float("nan")))
    check(request("ok", 4))
    e.add_request(request("ok", 4))
    with pytest.raises(ValueError, match="duplicate"):
        e.add_request(request("ok", 4))


def test_short_prompts_go_before_a_long_prefill_which_keeps_a_quarter():
    e = sim_engine(token_budget=40, max_num_seqs=8)
    start_decoding(e, "d1", "d2")
    e.add_request(request("long", 200))
    assert step_items(e)[2] == ("long", 34, True)  # alone, an even share of six iterations of 38
    e.add_request(request("s1", 10))
    e.add_request(request("s2", 30))
    items = step_items(e)
    # shorts first within 38 - 9 (a quarter kept for the long prompt); s2 needs two
    # iterations of the 19 left: 15 now; the long prompt its 9 and the 4 s2 left
    assert items[2:] == [("s1", 10, True), ("s2", 15, True), ("long", 13, True)]
    items = step_items(e)
    assert items[3:] == [("s2", 15, True), ("long", 22, True)]  # s1 decodes now: 3 decodes, 37 left


def test_long_prompt_progresses_every_iteration_under_a_flood_of_short_ones():
    e = sim_engine(token_budget=40, max_num_seqs=16, num_blocks=2048)
    e.add_request(request("long", 400, max_tokens=1))
    step_items(e)
    for i in range(30):
        e.add_request(request(f"s{i}", 12, max_tokens=1))
    for _ in range(8):
        chunks = {rid: n for rid, n, is_prefill in step_items(e) if is_prefill}
        assert chunks["long"] >= 40 // 4  # its quarter of the leftover, every iteration
        assert sum(chunks.values()) == 40


def test_long_prefill_threshold_is_live_and_can_be_turned_off():
    e = sim_engine(token_budget=40, max_num_seqs=8)
    e.add_request(request("long", 200))
    step_items(e)
    assert e.reconfigure({"long_prefill_tokens": 10_000}) == []
    e.add_request(request("short", 10))
    assert [rid for rid, _, _ in step_items(e)] == ["long"]  # the old order: oldest partial first


def test_preemption_takes_the_lowest_priority_then_the_newest():
    e = sim_engine(num_blocks=12, block_size=4, token_budget=32, max_num_seqs=8, decode_reserve_tokens=0)
    for rid, priority in (("urgent", -1), ("normal", 0), ("batch", 5), ("newest", 0)):
        e.add_request(request(rid, 6, max_tokens=40, priority=priority))
    preempted = []
    while e.has_work and len(preempted) < 2:
        before = {r.request_id: r.num_preemptions for r in e.scheduler.requests.values()}
        e.step()
        preempted += [
            r.request_id for r in e.scheduler.requests.values() if r.num_preemptions > before.get(r.request_id, 0)
        ]
    assert preempted[:2] == ["batch", "newest"]


def test_fair_policy_serves_the_tenant_with_the_fewest_tokens_first():
    e = sim_engine(token_budget=24, max_num_seqs=1, policy="fair")
    for i in range(4):
        r = request(f"flood{i}", 20, max_tokens=1, arrival_ns=i)
        r.tenant = "flood"
        e.add_request(r)
    while "flood0" in e.scheduler.requests:
        e.step()
    late = request("polite", 20, max_tokens=1, arrival_ns=10)
    late.tenant = "polite"
    e.add_request(late)  # three flood prompts were waiting before it
    assert (
        e.scheduler.tenants.served["polite"] == e.scheduler.tenants.served["flood"]
    )  # lifted: idle time banks no credit
    finished = [o.request_id for out in run_to_completion(e) for o in out.outputs if o.finish_reason]
    assert finished == ["flood1", "polite", "flood2", "flood3"]  # the tie went to the older prompt, then polite


def test_choices_of_one_prompt_compute_it_once_and_share_its_blocks():
    """OpenAI's n > 1: the other choices wait for the first one's prompt, then
    share all its blocks by reference count (the partial last one copied on
    write) and compute only their last prompt token, for their first logits.
    Their tokens are those of three independent requests (SimRunner samples a
    hash of the KV it reads back, so a wrong copy would change them)."""
    prompt = list(range(100, 130))  # 30 tokens: 7 full blocks and 2 tokens

    def run(shared: bool):
        e = sim_engine(token_budget=64, block_size=4)
        reqs = [request(f"c{i}", prompt, max_tokens=6) for i in range(3)]
        for r in reqs[1:]:
            r.prefill_after = "c0" if shared else None
        for r in reqs:
            e.add_request(r)
        return e, reqs

    e, reqs = run(shared=True)
    assert step_items(e) == [("c0", 30, True)]  # the siblings sat out the head's prefill, with budget to spare
    real, copies = e.runner.execute, []
    e.runner.execute = lambda batch: (copies.extend(batch.copies), real(batch))[1]
    second = step_items(e)
    assert sorted(x for x in second if x[2]) == [("c1", 1, True), ("c2", 1, True)]  # one token each
    head_blocks = reqs[0].block_ids
    for r in reqs[1:]:
        assert r.block_ids[:7] == head_blocks[:7] and r.block_ids[7] != head_blocks[7]  # own copy of the last
    assert all(e.kv.blocks[b].ref_count == 3 for b in head_blocks[:7])
    # the head decoded first, into its block while it was still its own; each choice then copied it
    assert copies == [(head_blocks[7], reqs[1].block_ids[7]), (head_blocks[7], reqs[2].block_ids[7])]
    assert e.kv.blocks[head_blocks[7]].ref_count == 1
    e.kv.check_invariants(e.scheduler.requests.values())
    run_to_completion(e)
    assert e.kv.num_used_blocks == 0
    alone, alone_reqs = run(shared=False)
    run_to_completion(alone)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in alone_reqs]


def test_the_next_batch_names_every_ended_request_so_the_runner_releases_it_at_once():
    e = sim_engine()
    released: list[str] = []
    e.runner.release = released.extend
    e.add_request(request("done", 4, max_tokens=1))
    e.add_request(request("cancelled", 4, max_tokens=50))
    e.add_request(request("failed", 4, max_tokens=50))
    e.step()  # "done" samples its one token and finishes
    assert released == []
    e.abort_request("cancelled")
    e.fail([e.scheduler.requests["failed"]])
    e.step()
    assert sorted(released) == ["cancelled", "done", "failed"]
    e.step()
    assert len(released) == 3  # each once
