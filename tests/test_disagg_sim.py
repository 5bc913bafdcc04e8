"""Prompts prefilled elsewhere (``Request.handoff``) and the disaggregated simulator."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from stallfree.core.analysis.cost_model import CostModel
from stallfree.core.analysis.disagg_plan import Link
from stallfree.core.analysis.disagg_sim import simulate_colocated, simulate_disaggregated
from stallfree.core.analysis.simulator import scenario
from stallfree.core.cluster.stats import prompt_hashes
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.engine import Engine
from stallfree.core.sched.handoff import KvHandoff
from stallfree.core.sched.request import Request, RequestStatus, SamplingParams
from tests.simkit import sim_engine, step_items

BS = 16


def _engine() -> Engine:
    return sim_engine(64, BS, cost=CostModel(), read_context=False, token_budget=256, max_num_seqs=64)


def test_an_imported_prompt_goes_straight_to_decoding_on_fresh_blocks():
    engine = _engine()
    prompt = list(range(100, 150))  # 50 tokens: 49 arrive computed, the 50th is decoded for the first token
    decoder = Request("other", [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True), 0)
    engine.add_request(decoder)
    engine.step()
    req = Request("moved", prompt, SamplingParams(max_tokens=3, ignore_eos=True), 0)
    req.handoff = KvHandoff(imported_tokens=49)
    engine.add_request(req)
    out = engine.step()
    assert out is not None and out.iteration.prefill_tokens == 0 and out.iteration.decode_tokens == 2
    assert req.status == RequestStatus.DECODING and req.num_output_tokens == 1 and not req.timeline.chunks
    assert len(req.block_ids) == 4  # 50 tokens now computed, in 16-token blocks
    # the receiver's prefix cache knows the imported blocks under the prompt's own hashes
    assert set(prompt_hashes(prompt[:49], BS)) <= set(engine.kv.cached_hashes())
    assert not decoder.timeline.stalled[-1]  # nothing was prefilled beside the other decode
    engine.kv.check_invariants(engine.scheduler.running)
    while engine.has_work:
        engine.step()
    assert req.num_output_tokens == 3 and engine.kv.num_used_blocks == 0


def test_an_imported_prompt_decodes_among_the_decodes_ahead_of_any_chunk():
    """The model runner reads the first ``num_decodes`` sequences as one query row
    each (``Batch``): an import admitted in pass 3, after a prompt's chunk, must
    still go among the decodes, or the reference attention reads the chunk as one row."""
    engine = _engine()
    engine.add_request(Request("local", list(range(300, 600)), SamplingParams(max_tokens=2, ignore_eos=True), 0))
    engine.step()  # its first chunk; the last 44 tokens are a short partial prefill, placed in pass 2
    moved = Request("moved", list(range(100, 150)), SamplingParams(max_tokens=3, ignore_eos=True), 0)
    moved.handoff = KvHandoff(imported_tokens=49)
    engine.add_request(moved)
    items, _ = step_items(engine)
    assert [(rid, prefill) for rid, _, prefill in items] == [("moved", False), ("local", True)]


def test_imported_kv_must_cover_all_but_the_last_token():
    engine = _engine()
    req = Request("bad", list(range(20)), SamplingParams(max_tokens=2), 0)
    req.handoff = KvHandoff(imported_tokens=10)
    with pytest.raises(ValueError, match="every token but the last"):
        engine.add_request(req)


def test_disaggregated_serving_has_no_stall_and_pays_the_transfer():
    arrivals, settings = scenario("seed-figure3")
    config, cache, cost = SchedulerConfig(**settings), CacheConfig(16384, BS), CostModel()
    disagg = simulate_disaggregated(arrivals, 1, 1, Link(100, 0.001), config, cache, cost)
    colocated = simulate_colocated(arrivals, 2, config, cache, cost)
    for rep in (disagg, colocated):
        assert rep["summary"]["requests"] == len(arrivals)
        assert rep["summary"]["kv_used_blocks_after"] == 0
        assert all(
            r["output_tokens"] == a.max_tokens
            for a, r in zip(arrivals, (rep["requests"][a.request_id] for a in arrivals), strict=True)
        )
    step_ms = cost.iteration_s([0] * 64, []) * 1e3
    assert disagg["summary"]["max_gap_ms"] == pytest.approx(step_ms, rel=0.01)  # decode workers only decode
    assert colocated["summary"]["max_gap_ms"] > 3 * step_ms  # chunks beside the decodes
    a = disagg["requests"]["A"]  # the 8,192-token prompt: 1 GiB of KV at 100 Gbit/s + 1 ms
    assert a["transfer_ms"] == pytest.approx(2**30 * 8 / 100e9 * 1e3 + 1, rel=0.01)
    assert a["ttft_ms"] >= a["prefill_worker_ms"] + a["transfer_ms"]


def test_simulate_disaggregate_command():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "stallfree.cli",
            "simulate",
            "--scenario",
            "seed-figure3",
            "--disaggregate",
            "1:2",
            "--json",
        ],
        check=True,
        capture_output=True,
    ).stdout
    doc = orjson.loads(out)
    assert doc["disaggregated"]["workers"] == ["p0", "d0", "d1"] and len(doc["colocated"]["workers"]) == 3
    assert doc["disaggregated"]["summary"]["requests"] == doc["colocated"]["summary"]["requests"] == 65


def _run(engine: Engine, req: Request) -> Request:
    engine.add_request(req)
    while engine.has_work:
        engine.step()
    return req


def _disaggregated(prefill: Engine, decode: Engine, prompt: list[int], n: int, corrupt: bool = False) -> list[int]:
    """Prefill on one engine (one token, its KV exported), decode on the other from the imported KV."""
    head = Request("r", prompt, SamplingParams(max_tokens=1, ignore_eos=True), 0)
    head.handoff = KvHandoff(export=True)
    _run(prefill, head)
    payload = head.handoff.payload
    assert payload is not None and prefill.kv.num_used_blocks == 0
    if corrupt:  # one token of the transferred KV wrong
        payload[1][3] += 1
    tail = Request("r", prompt, SamplingParams(max_tokens=n, ignore_eos=True), 0)
    tail.handoff = KvHandoff(imported_tokens=len(prompt) - 1, payload=payload)
    _run(decode, tail)
    assert decode.kv.num_used_blocks == 0
    return tail.output_token_ids


def _sim_engine() -> Engine:
    return sim_engine(64, BS, cost=CostModel(), token_budget=32, max_num_seqs=64)


def test_transferred_kv_gives_the_tokens_colocated_serving_gives():
    """SimRunner samples a hash of the whole context it reads back from its paged
    cache, so a block written wrong, misplaced or missing changes the tokens."""
    prompt = list(range(300, 370))  # 70 tokens: chunked at budget 32, 5 blocks, the last partial
    colocated = _run(_sim_engine(), Request("r", prompt, SamplingParams(max_tokens=12, ignore_eos=True), 0))
    assert _disaggregated(_sim_engine(), _sim_engine(), prompt, 12) == colocated.output_token_ids
    assert _disaggregated(_sim_engine(), _sim_engine(), prompt, 12, corrupt=True) != colocated.output_token_ids


def test_transferred_kv_gives_the_real_models_greedy_tokens():
    import torch

    from stallfree.core.model.loader import load_tiny
    from stallfree.core.model.model_runner import ModelRunner

    loaded = load_tiny()

    def engine() -> Engine:
        runner = ModelRunner(loaded, 64, BS, torch.float32, torch.device("cpu"))
        return Engine(SchedulerConfig(token_budget=32, max_model_len=512), CacheConfig(64, BS), runner)

    prompt = loaded.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 5)
    colocated = _run(engine(), Request("r", prompt, SamplingParams(max_tokens=10, ignore_eos=True), 0))
    assert _disaggregated(engine(), engine(), prompt, 10) == colocated.output_token_ids
