"""Disaggregated serving on the real scheduler, on virtual clocks, beside
chunked prefill on the same number of colocated workers.

Disaggregated: each arrival goes to the prefill worker with the least prompt
work queued; it runs there as a one-token request (its sampled token is
dropped, as vLLM's disaggregated proxy does). When it finishes, its KV (prompt
tokens x the model's KV bytes per token) crosses that worker's link, one
transfer at a time (bandwidth, plus latency per transfer), to the decode
worker with the fewest requests, which admits it with the prompt's KV
imported (``Request.kv_imported``) and decodes from its last prompt token:
its first token, then the rest. Colocated: the same arrivals over P + D
workers that each prefill (chunked, as configured) and decode.

Both report the single-engine simulator's per-request figures; the
disaggregated one adds each request's prefill-worker time and transfer time.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from core.analysis.cost_model import CostModel
from core.analysis.disagg_plan import Link
from core.analysis.sim_runner import SimRunner, VirtualClock
from core.analysis.simulator import VOCAB, Arrival
from core.sched.config import CacheConfig, SchedulerConfig
from core.sched.engine import Engine, StepOutput
from core.sched.request import Request, SamplingParams
from core.sched.timings import gaps_ns, percentile, request_timings


@dataclass(slots=True)
class Worker:
    name: str
    clock: VirtualClock
    engine: Engine
    link_free_ns: int = 0  # a prefill worker's link: when its current transfer is on the wire until

    @property
    def queued_tokens(self) -> int:
        s = self.engine.scheduler
        return sum(r.num_prompt_tokens - r.num_computed_tokens for r in [*s.waiting, *s.running])

    @property
    def load(self) -> int:
        s = self.engine.scheduler
        return len(s.waiting) + len(s.running)


@dataclass(slots=True)
class Cluster:
    """Workers on their own virtual clocks and one event loop over arrivals,
    deliveries (transfers) and the iteration of whichever worker is furthest behind."""

    workers: list[Worker]
    events: list[tuple[int, int, Any]] = field(default_factory=list)  # (time ns, order, payload)
    order: itertools.count[int] = field(default_factory=itertools.count)

    @classmethod
    def build(cls, names: list[str], scheduler: SchedulerConfig, cache: CacheConfig, cost: CostModel) -> Cluster:
        workers = []
        for name in names:
            clock = VirtualClock()
            runner = SimRunner(cost, cache.block_size, clock, VOCAB, read_context=False)
            workers.append(Worker(name, clock, Engine(scheduler, cache, runner, clock, chunk_limit=cost.level_chunk)))
        return cls(workers)

    def at(self, t_ns: int, payload: Any) -> None:
        heapq.heappush(self.events, (t_ns, next(self.order), payload))

    def add(self, worker: Worker, req: Request, t_ns: int) -> None:
        worker.clock.now_ns = max(worker.clock.now_ns, t_ns)
        worker.engine.add_request(req)

    def next(self) -> tuple[int, Any] | tuple[Worker, StepOutput | None] | None:
        """The next thing that happens: an event (time, payload) or a worker's iteration (worker, output)."""
        busy = [w for w in self.workers if w.engine.has_work]
        step_at = min((w.clock.now_ns for w in busy), default=None)
        if self.events and (step_at is None or self.events[0][0] <= step_at):
            t_ns, _, payload = heapq.heappop(self.events)
            return t_ns, payload
        if step_at is None:
            return None
        worker = min(busy, key=lambda w: w.clock.now_ns)
        out = worker.engine.step()
        if out is None:  # nothing schedulable (KV full): wait for the next event or worker
            later = [
                t
                for t in [*(w.clock.now_ns for w in busy), *(e[0] for e in self.events[:1])]
                if t > worker.clock.now_ns
            ]
            if not later:
                raise RuntimeError(f"simulation stalled on {worker.name}: requests remain but none can run")
            worker.clock.now_ns = min(later)
        return worker, out


def _fresh(a: Arrival, max_tokens: int, kv_imported: int = 0) -> Request:
    req = Request(
        a.request_id,
        list(a.prompt),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        int(a.at_s * 1e9),
        a.priority,
        a.tenant,
    )
    req.kv_imported = kv_imported
    return req


def simulate_disaggregated(
    arrivals: Iterable[Arrival],
    prefill_workers: int,
    decode_workers: int,
    link: Link,
    scheduler: SchedulerConfig,
    cache: CacheConfig,
    cost: CostModel,
) -> dict[str, Any]:
    names = [f"p{i}" for i in range(prefill_workers)] + [f"d{i}" for i in range(decode_workers)]
    cluster = Cluster.build(names, scheduler, cache, cost)
    prefill, decode = cluster.workers[:prefill_workers], cluster.workers[prefill_workers:]
    by_id: dict[str, Arrival] = {}
    phases: dict[str, dict[str, float]] = {}
    finished: list[Request] = []
    for a in arrivals:
        cluster.at(int(a.at_s * 1e9), a)
    kv_per_token = cost.model.kv_bytes_per_token
    while (nxt := cluster.next()) is not None:
        if isinstance(nxt[0], int):
            t_ns, payload = nxt
            if isinstance(payload, Arrival):  # to the prefill worker with the least work queued
                by_id[payload.request_id] = payload
                cluster.add(min(prefill, key=lambda w: w.queued_tokens), _fresh(payload, 1), t_ns)
            else:  # a transfer landed: the decode worker with the fewest requests takes it over
                a = by_id[payload]
                cluster.add(min(decode, key=lambda w: w.load), _fresh(a, a.max_tokens, len(a.prompt) - 1), t_ns)
            continue
        worker, out = nxt
        for o in out.outputs if out is not None else ():
            if o.request is None:
                continue
            if worker in prefill:  # its KV onto the link, behind what is already on it
                done = worker.clock.now_ns
                wire_ns = int(len(o.request.prompt_token_ids) * kv_per_token * 8 / (link.gbps * 1e9) * 1e9)
                start = max(done, worker.link_free_ns)
                worker.link_free_ns = start + wire_ns
                landed = start + wire_ns + int(link.latency_s * 1e9)
                t = request_timings(o.request.timeline)
                phases[o.request_id] = {"prefill_worker_ms": t.e2e_ms, "transfer_ms": (landed - done) / 1e6}
                cluster.at(landed, o.request_id)
            else:
                finished.append(o.request)
    return _report(finished, phases, cluster, "disaggregated")


def simulate_colocated(
    arrivals: Iterable[Arrival], workers: int, scheduler: SchedulerConfig, cache: CacheConfig, cost: CostModel
) -> dict[str, Any]:
    cluster = Cluster.build([f"w{i}" for i in range(workers)], scheduler, cache, cost)
    finished: list[Request] = []
    for a in arrivals:
        cluster.at(int(a.at_s * 1e9), a)
    while (nxt := cluster.next()) is not None:
        if isinstance(nxt[0], int):
            t_ns, a = nxt
            # fewest requests, then least prompt work: the decodes spread, then the prompts
            cluster.add(min(cluster.workers, key=lambda w: (w.load, w.queued_tokens)), _fresh(a, a.max_tokens), t_ns)
            continue
        _, out = nxt
        finished += [o.request for o in (out.outputs if out is not None else ()) if o.request is not None]
    return _report(finished, {}, cluster, "colocated")


def _report(
    finished: list[Request], phases: dict[str, dict[str, float]], cluster: Cluster, kind: str
) -> dict[str, Any]:
    reqs: dict[str, dict[str, Any]] = {}
    all_gaps: list[float] = []
    ttfts = []
    for req in finished:
        t = request_timings(req.timeline)
        all_gaps += [g / 1e6 for g in gaps_ns(req.timeline)]
        ttfts.append(t.ttft_ms)
        reqs[req.request_id] = {
            "arrival_ms": req.arrival_ns / 1e6,
            "prompt_tokens": req.num_prompt_tokens,
            "output_tokens": req.num_output_tokens,
            "finish_reason": req.finish_reason,
            **t.as_dict(),
            **phases.get(req.request_id, {}),
        }
    start = min((r.arrival_ns for r in finished), default=0)
    end = max((r.timeline.finished_ns or 0 for r in finished), default=start)
    out_tokens = sum(r.num_output_tokens for r in finished)
    return {
        "kind": kind,
        "workers": [w.name for w in cluster.workers],
        "summary": {
            "requests": len(reqs),
            "duration_ms": (end - start) / 1e6,
            "output_tokens": out_tokens,
            "throughput_tokens_per_s": out_tokens / ((end - start) / 1e9) if end > start else 0.0,
            "ttft_p50_ms": percentile(ttfts, 50),
            "ttft_p99_ms": percentile(ttfts, 99),
            "itl_p50_ms": percentile(all_gaps, 50),
            "itl_p99_ms": percentile(all_gaps, 99),
            "max_gap_ms": max(all_gaps, default=0.0),
            "transfer_p50_ms": percentile([p["transfer_ms"] for p in phases.values()], 50),
            "kv_used_blocks_after": sum(w.engine.kv.num_used_blocks for w in cluster.workers),
        },
        "requests": reqs,
    }


def format_side_by_side(disagg: dict[str, Any], colocated: dict[str, Any], label: str) -> str:
    head = f"  {'':<26} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'max gap':>8} {'tokens/s':>9}"
    lines = [label, "", head]
    for name, rep in ((f"disaggregated {label.split()[1]}", disagg), ("chunked, colocated", colocated)):
        s = rep["summary"]
        lines.append(
            f"  {name:<26} {s['ttft_p50_ms']:>9.1f} {s['ttft_p99_ms']:>9.1f} {s['itl_p50_ms']:>8.2f}"
            f" {s['itl_p99_ms']:>8.2f} {s['max_gap_ms']:>8.1f} {s['throughput_tokens_per_s']:>9,.0f}"
        )
    lines.append(
        f"  (ms; disaggregated TTFT includes the KV transfer, median {disagg['summary']['transfer_p50_ms']:.1f} ms)"
    )
    return "\n".join(lines)
