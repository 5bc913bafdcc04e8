"""N engines behind a router, on virtual clocks: the routers compared on paper.

Each replica is the real engine (scheduler, block manager, prefix cache) over
a cost-model runner with its own virtual clock. One event loop takes, in time
order, the next arrival (routed on the replicas' current stats) or the next
iteration of the replica whose clock is furthest behind; an idle replica's
clock jumps to its next arrival. Finished turns schedule the conversation's
next one (``ChatSession``), so the workload is closed loop.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any

from core.analysis.chat_workload import ChatSession, ChatWorkload, Conversation
from core.analysis.cost_model import CostModel
from core.analysis.sim_runner import SimRunner, VirtualClock
from core.cluster.router import Prompt, Router
from core.cluster.stats import ReplicaStats, engine_stats, prompt_hashes
from core.sched.config import CacheConfig, SchedulerConfig
from core.sched.engine import Engine
from core.sched.request import Request, SamplingParams
from core.sched.timings import gaps_ns, percentile, request_timings

VOCAB = 32000


@dataclass(slots=True)
class SimReplica:
    name: str
    clock: VirtualClock
    engine: Engine
    events: int = 0  # bumped by every arrival and iteration: the stats' report number
    iterations: int = 0
    routed: int = 0

    def stats(self) -> ReplicaStats:
        return engine_stats(self.name, self.engine, self.events, live=True)


@dataclass(slots=True)
class ClusterResult:
    router: str
    replicas: list[SimReplica]
    requests: list[tuple[Request, str]] = field(default_factory=list)  # (request, replica)
    fallbacks: int = 0


def simulate_cluster(
    workload: ChatWorkload,
    num_replicas: int,
    router: Router,
    scheduler: SchedulerConfig,
    cache: CacheConfig,
    cost: CostModel,
) -> ClusterResult:
    replicas = []
    for i in range(num_replicas):
        clock = VirtualClock()
        runner = SimRunner(cost, cache.block_size, clock, VOCAB, read_context=False)
        engine = Engine(scheduler, cache, runner, clock, chunk_limit=cost.level_chunk)
        replicas.append(SimReplica(f"r{i}", clock, engine))
    by_name = {r.name: r for r in replicas}
    session = ChatSession(workload, VOCAB)
    order = itertools.count()
    arrivals: list[tuple[int, int, Conversation]] = [(int(t * 1e9), next(order), c) for t, c in session.starts()]
    heapq.heapify(arrivals)
    result = ClusterResult(router.name, replicas)
    conversation_of: dict[str, Conversation] = {}
    while True:
        busy = [r for r in replicas if r.engine.has_work]
        step_at = min((r.clock.now_ns for r in busy), default=None)
        if arrivals and (step_at is None or arrivals[0][0] <= step_at):
            at_ns, _, conv = heapq.heappop(arrivals)
            request_id, prompt, max_tokens = session.next_prompt(conv)
            hashes = prompt_hashes(prompt, cache.block_size)
            replica = by_name[router.choose(Prompt(len(prompt), hashes), [r.stats() for r in replicas])]
            replica.clock.now_ns = max(replica.clock.now_ns, at_ns)
            req = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), at_ns)
            replica.engine.add_request(req)
            replica.events += 1
            replica.routed += 1
            conversation_of[request_id] = conv
            result.requests.append((req, replica.name))
            continue
        if step_at is None:
            break
        replica = min(busy, key=lambda r: r.clock.now_ns)
        out = replica.engine.step()
        replica.events += 1
        if out is None:  # nothing schedulable (KV full): wait for the next arrival or another replica
            events = [r.clock.now_ns for r in busy] + ([arrivals[0][0]] if arrivals else [])
            later = [t for t in events if t > replica.clock.now_ns]
            if not later:
                raise RuntimeError(f"simulation stalled on {replica.name}: requests remain but none can run")
            replica.clock.now_ns = min(later)
            continue
        replica.iterations += out.iteration is not None
        for o in out.outputs:
            if o.request is None:
                continue
            conv = conversation_of.pop(o.request_id)
            think_s = session.answered(conv, o.request.output_token_ids)
            if think_s is not None:
                heapq.heappush(arrivals, (replica.clock.now_ns + int(think_s * 1e9), next(order), conv))
    result.fallbacks = router.fallbacks
    return result


def cluster_report(result: ClusterResult, duration_floor_ns: int = 1) -> dict[str, Any]:
    """The routers' figures: prefix-hit rate, TTFT, gaps, throughput, spread."""
    ttfts, gaps = [], []
    prompt_tokens = cached_tokens = out_tokens = 0
    start = min((r.arrival_ns for r, _ in result.requests), default=0)
    end = start + duration_floor_ns
    for req, _ in result.requests:
        t = request_timings(req.timeline)
        ttfts.append(t.ttft_ms)
        gaps += [g / 1e6 for g in gaps_ns(req.timeline)]
        prompt_tokens += req.num_prompt_tokens
        cached_tokens += req.num_cached_tokens
        out_tokens += req.num_output_tokens
        end = max(end, req.timeline.finished_ns or 0)
    routed = [r.routed for r in result.replicas]
    return {
        "router": result.router,
        "replicas": len(result.replicas),
        "requests": len(result.requests),
        "prefix_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "itl_p99_ms": percentile(gaps, 99),
        "max_gap_ms": max(gaps, default=0.0),
        "throughput_tokens_per_s": out_tokens / ((end - start) / 1e9),
        "duration_s": (end - start) / 1e9,
        "routed_min": min(routed, default=0),
        "routed_max": max(routed, default=0),
        "fallbacks": result.fallbacks,
        "preemptions": sum(r.engine.scheduler.num_preemptions for r in result.replicas),
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'replicas':>8} {'router':<13} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p99':>8}"
        f" {'max gap':>8} {'tokens/s':>10} {'routed min-max':>15}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['replicas']:>8} {r['router']:<13} {r['prefix_hit_rate']:>8.1%} {r['ttft_p50_ms']:>7.1f}ms"
            f" {r['ttft_p99_ms']:>7.1f}ms {r['itl_p99_ms']:>6.1f}ms {r['max_gap_ms']:>6.1f}ms"
            f" {r['throughput_tokens_per_s']:>10,.0f} {r['routed_min']:>7}-{r['routed_max']:<7}"
        )
    return "\n".join(lines)
