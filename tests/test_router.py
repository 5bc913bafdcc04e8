"""The routers (core.cluster) and the cluster simulator that compares them."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from stallfree.core.analysis.chat_workload import ChatWorkload
from stallfree.core.analysis.cluster_sim import cluster_report, simulate_cluster
from stallfree.core.analysis.cost_model import CostModel
from stallfree.core.cluster.router import CostAware, Prompt, make_router
from stallfree.core.cluster.stats import ReplicaStats, engine_stats, prompt_hashes
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.engine import Engine
from stallfree.core.sched.request import Request, SamplingParams
from tests.simkit import sim_engine

BS = 16


def _engine(blocks: int = 256) -> Engine:
    return sim_engine(blocks, BS, cost=CostModel(), token_budget=256, max_num_seqs=64)


def _run(engine: Engine) -> None:
    while engine.has_work:
        engine.step()


def _stats(name: str, cached: list[bytes] = (), **kw: int) -> ReplicaStats:  # type: ignore[assignment]
    base = {"kv_blocks": 1000, "kv_free_blocks": 1000, "block_size": BS, "token_budget": 512}
    return ReplicaStats(name, cached=frozenset(cached), **(base | kw))


def test_the_router_hashes_a_prompt_as_the_prefix_cache_does() -> None:
    engine = _engine()
    prompt = list(range(100, 150))  # 3 full blocks and 2 tokens
    engine.add_request(Request("a", prompt, SamplingParams(max_tokens=1), 0))
    _run(engine)
    hashes = prompt_hashes(prompt, BS)
    assert len(hashes) == 3
    stats = engine_stats("r0", engine)
    assert stats.matched_blocks(hashes) == 3
    assert stats.matched_blocks(prompt_hashes([7, *prompt[1:]], BS)) == 0  # the chain breaks at block 0
    assert engine.kv.num_used_blocks == 0


def test_the_router_hashes_a_salted_prompt_as_the_prefix_cache_does() -> None:
    engine = _engine()
    prompt = list(range(100, 150))
    engine.add_request(Request("a", prompt, SamplingParams(max_tokens=1), 0, cache_salt="key-1"))
    _run(engine)
    stats = engine_stats("r0", engine)
    assert stats.matched_blocks(prompt_hashes(prompt, BS, "key-1")) == 3
    assert stats.matched_blocks(prompt_hashes(prompt, BS, "key-2")) == 0  # another tenant's prompt: no hit predicted
    assert stats.matched_blocks(prompt_hashes(prompt, BS)) == 0


def test_stats_count_queued_prompts_blocks_and_only_their_uncached_tokens() -> None:
    engine = _engine()
    shared = list(range(1000, 1064))  # 4 blocks
    engine.add_request(Request("a", [*shared, 1], SamplingParams(max_tokens=1), 0))
    _run(engine)
    engine.add_request(Request("b", [*shared, *range(2000, 2032), 5], SamplingParams(max_tokens=1), 0))
    stats = engine_stats("r0", engine)
    assert stats.waiting == 1
    assert stats.queued_prefill_tokens == 33  # 97 tokens, 64 of them cached
    assert stats.matched_blocks(prompt_hashes([*shared, *range(2000, 2032)], BS)) == 6  # queued blocks count


def test_cost_router_follows_the_cache_until_the_queue_there_costs_more() -> None:
    prompt = list(range(3000, 3000 + 2048))
    hashes = prompt_hashes(prompt, BS)
    router = CostAware(CostModel())
    home = _stats("home", hashes[:120])  # 1,920 of 2,048 tokens cached
    assert router.choose(Prompt(len(prompt), hashes), [_stats("cold"), home]) == "home"
    busy_home = _stats("home", hashes[:120], queued_prefill_tokens=8000, seq=5)
    router = CostAware(CostModel())
    assert router.choose(Prompt(len(prompt), hashes), [_stats("cold"), busy_home]) == "cold"


def test_cost_router_puts_a_replica_without_kv_room_last_and_breaks_ties_on_free_kv() -> None:
    prompt = list(range(64))
    hashes = prompt_hashes(prompt, BS)
    router = CostAware(CostModel())
    full = _stats("full", hashes, kv_free_blocks=0)  # holds the prefix but cannot fit the rest
    assert router.choose(Prompt(80, hashes), [full, _stats("empty")]) == "empty"
    router = CostAware(CostModel())
    roomy, tight = _stats("roomy", kv_free_blocks=900), _stats("tight", kv_free_blocks=100)
    assert router.choose(Prompt(64, hashes), [tight, roomy]) == "roomy"


def test_routers_count_what_they_sent_until_a_report_includes_it() -> None:
    replicas = [_stats("a"), _stats("b")]
    least = make_router("least_loaded")
    assert {least.choose(Prompt(10, []), replicas) for _ in range(2)} == {"a", "b"}
    prefix = make_router("prefix", settle_reports=2)
    hashes = prompt_hashes(list(range(64)), BS)
    first = prefix.choose(Prompt(64, hashes), replicas)
    assert prefix.choose(Prompt(64, hashes), replicas) == first  # its blocks are on their way there
    reported = [_stats(r.replica, seq=2) for r in replicas]  # two reports later, and neither has them
    loads = {prefix.choose(Prompt(64, []), reported) for _ in range(2)}
    assert loads == {"a", "b"}


def test_power_of_two_fallback_when_loads_are_uneven() -> None:
    hashes = prompt_hashes(list(range(64)), BS)
    hot = _stats("hot", hashes, running=100)
    cold = [_stats(f"c{i}") for i in range(3)]
    router = make_router("prefix", seed=1)
    picks = [router.choose(Prompt(64, hashes), [hot, *cold]) for _ in range(20)]
    assert router.fallbacks == 20
    assert "hot" not in picks  # the hot replica loses every pair it is drawn in


@pytest.mark.parametrize("n", [1, 3])
def test_cluster_simulation_serves_every_turn_and_frees_kv(n: int) -> None:
    workload = ChatWorkload(conversations=12, rate_per_s=6.0, turns=3, system_tokens=256)
    cost = CostModel()
    result = simulate_cluster(
        workload, n, make_router("cost", cost), SchedulerConfig(token_budget=512), CacheConfig(2048, BS), cost
    )
    assert len(result.requests) == 36
    assert all(r.finish_reason == "length" for r, _ in result.requests)
    assert all(r.engine.kv.num_used_blocks == 0 for r in result.replicas)
    for r in result.replicas:
        r.engine.kv.check_invariants([])
    # every later turn holds the earlier one: a cache-following router hits it
    turn2 = [r for r, _ in result.requests if r.request_id.endswith("-t2")]
    assert all(r.num_cached_tokens >= r.num_prompt_tokens - 400 - BS for r in turn2)


def test_cost_router_beats_cache_blind_routers_on_hit_rate_and_ttft_tail() -> None:
    workload = ChatWorkload(conversations=30, rate_per_s=8.0, turns=4, system_tokens=512)
    cost = CostModel()
    rows = {}
    for name in ("cost", "round_robin", "least_loaded"):
        result = simulate_cluster(
            workload, 4, make_router(name, cost), SchedulerConfig(token_budget=512), CacheConfig(8192, BS), cost
        )
        rows[name] = cluster_report(result)
    for other in ("round_robin", "least_loaded"):
        assert rows["cost"]["prefix_hit_rate"] > rows[other]["prefix_hit_rate"] + 0.1
        assert rows["cost"]["ttft_p99_ms"] < rows[other]["ttft_p99_ms"]


def test_simulate_replicas_command_prints_one_row_per_router() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "stallfree.cli",
            "simulate",
            "--replicas",
            "2",
            "--conversations",
            "8",
            "--rate",
            "4",
            "--turns",
            "2",
            "--router",
            "cost,round_robin",
            "--json",
        ],
        check=True,
        capture_output=True,
    ).stdout
    doc = orjson.loads(out)
    assert [r["router"] for r in doc["routers"]] == ["cost", "round_robin"]
    assert all(r["requests"] == 16 for r in doc["routers"])
    bad = subprocess.run(
        [sys.executable, "-m", "stallfree.cli", "simulate", "--replicas", "2", "--router", "nope"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "unknown router 'nope'" in bad.stderr
