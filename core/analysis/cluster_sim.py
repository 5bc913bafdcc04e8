"""Simulated clusters of engines (``Cluster``), and N replicas behind a
router on them: the routers compared on paper.

Each engine is the real one (scheduler, block manager, prefix cache) over a
cost-model runner with its own virtual clock. One event loop takes, in time
order, the next arrival (routed on the replicas' current stats) or the next
iteration of the engine whose clock is furthest behind; an idle engine's
clock jumps to its next arrival. Finished turns schedule the conversation's
next one (``ChatSession``), so the workload is closed loop. The
disaggregated simulator (``disagg_sim``) runs on the same loop.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from stallfree.core.analysis.chat_workload import ChatSession, ChatWorkload, Conversation
from stallfree.core.analysis.cost_model import CostModel
from stallfree.core.analysis.sim_runner import SimRunner, VirtualClock
from stallfree.core.analysis.simulator import VOCAB
from stallfree.core.cluster.router import Prompt, Router
from stallfree.core.cluster.stats import ReplicaStats, engine_stats, prompt_hashes
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.engine import Engine, StepOutput
from stallfree.core.sched.request import Request, SamplingParams
from stallfree.core.sched.timings import summarize


@dataclass(slots=True)
class Worker:
    """One engine of a simulated cluster, on its own virtual clock."""

    name: str
    clock: VirtualClock
    engine: Engine
    events: int = 0  # arrivals and iterations so far: the number of its stats report

    @property
    def load(self) -> int:
        s = self.engine.scheduler
        return len(s.waiting) + len(s.running)

    def stats(self) -> ReplicaStats:
        return engine_stats(self.name, self.engine, self.events, live=True)


@dataclass(slots=True)
class Cluster:
    """Engines on their own virtual clocks and one event loop over timed
    events (arrivals, deliveries) and the iteration of whichever busy engine
    is furthest behind; an idle engine's clock jumps to its next request."""

    workers: list[Worker]
    events: list[tuple[int, int, Any]] = field(default_factory=list)  # (time ns, order, payload)
    order: itertools.count[int] = field(default_factory=itertools.count)
    running: dict[str, Request] = field(default_factory=dict)  # added and not yet ended, by id

    @classmethod
    def build(cls, names: list[str], scheduler: SchedulerConfig, cache: CacheConfig, cost: CostModel) -> Cluster:
        workers = []
        for name in names:
            clock = VirtualClock()
            runner = SimRunner(cost, cache.block_size, clock, VOCAB, read_context=False)
            workers.append(Worker(name, clock, Engine(scheduler, cache, runner, clock, cost)))
        return cls(workers)

    def at(self, t_ns: int, payload: Any) -> None:
        heapq.heappush(self.events, (t_ns, next(self.order), payload))

    def add(self, worker: Worker, req: Request, t_ns: int) -> None:
        worker.clock.now_ns = max(worker.clock.now_ns, t_ns)
        worker.engine.add_request(req)
        self.running[req.request_id] = req
        worker.events += 1

    def ended(self, out: StepOutput | None) -> list[Request]:
        """The requests an iteration's output says have ended."""
        outputs = out.outputs if out is not None else []
        return [self.running.pop(o.request_id) for o in outputs if o.end is not None]

    def next(self) -> tuple[int, Any] | tuple[Worker, StepOutput | None] | None:
        """The next thing that happens: an event (time, payload), or an
        iteration (worker, its output); None once nothing is left."""
        busy = [w for w in self.workers if w.engine.has_work]
        step_at = min((w.clock.now_ns for w in busy), default=None)
        if self.events and (step_at is None or self.events[0][0] <= step_at):
            t_ns, _, payload = heapq.heappop(self.events)
            return t_ns, payload
        if step_at is None:
            return None
        worker = min(busy, key=lambda w: w.clock.now_ns)
        out = worker.engine.step()
        worker.events += 1
        if out is None:  # nothing schedulable (KV full): wait for the next event or engine
            times = [w.clock.now_ns for w in busy] + [e[0] for e in self.events[:1]]
            later = [t for t in times if t > worker.clock.now_ns]
            if not later:
                raise RuntimeError(f"simulation stalled on {worker.name}: requests remain but none can run")
            worker.clock.now_ns = min(later)
        return worker, out


@dataclass(slots=True)
class ClusterResult:
    router: str
    replicas: list[Worker]
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
    cluster = Cluster.build([f"r{i}" for i in range(num_replicas)], scheduler, cache, cost)
    by_name = {w.name: w for w in cluster.workers}
    session = ChatSession(workload, VOCAB)
    for t_s, conv in session.starts():
        cluster.at(int(t_s * 1e9), conv)
    result = ClusterResult(router.name, cluster.workers)
    conversation_of: dict[str, Conversation] = {}
    while (nxt := cluster.next()) is not None:
        if isinstance(nxt[0], int):  # a conversation's next turn
            at_ns, conv = nxt
            request_id, prompt, max_tokens = session.next_prompt(conv)
            hashes = prompt_hashes(prompt, cache.block_size)
            replica = by_name[router.choose(Prompt(len(prompt), hashes), [w.stats() for w in cluster.workers])]
            req = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), at_ns)
            cluster.add(replica, req, at_ns)
            conversation_of[request_id] = conv
            result.requests.append((req, replica.name))
            continue
        worker, out = nxt
        for req in cluster.ended(out):
            conv = conversation_of.pop(req.request_id)
            think_s = session.answered(conv, req.output_token_ids)
            if think_s is not None:
                cluster.at(worker.clock.now_ns + int(think_s * 1e9), conv)
    result.fallbacks = router.fallbacks
    return result


def cluster_report(result: ClusterResult, duration_floor_ns: int = 1) -> dict[str, Any]:
    """The routers' figures: prefix-hit rate, TTFT, gaps, throughput, spread."""
    requests = [req for req, _ in result.requests]
    start = min((r.arrival_ns for r in requests), default=0)
    end = max([start + duration_floor_ns, *(r.timeline.finished_ns or 0 for r in requests)])
    prompt_tokens = sum(r.num_prompt_tokens for r in requests)
    routed = Counter(name for _, name in result.requests)
    per_replica = [routed[w.name] for w in result.replicas]
    s = summarize(requests, start, end)
    return {
        "router": result.router,
        "replicas": len(result.replicas),
        "requests": len(requests),
        "prefix_hit_rate": sum(r.num_cached_tokens for r in requests) / prompt_tokens if prompt_tokens else 0.0,
        "ttft_p50_ms": s["ttft_p50_ms"],
        "ttft_p99_ms": s["ttft_p99_ms"],
        "itl_p99_ms": s["itl_p99_ms"],
        "max_gap_ms": s["max_gap_ms"],
        "throughput_tokens_per_s": s["throughput_tokens_per_s"],
        "duration_s": (end - start) / 1e9,
        "routed_min": min(per_replica, default=0),
        "routed_max": max(per_replica, default=0),
        "fallbacks": result.fallbacks,
        "preemptions": sum(w.engine.scheduler.num_preemptions for w in result.replicas),
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
