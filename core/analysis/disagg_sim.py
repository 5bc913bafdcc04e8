"""Disaggregated serving on the real scheduler, on virtual clocks, beside
chunked prefill on the same number of colocated workers.

Disaggregated: each arrival goes to the prefill worker with the least prompt
work queued; it runs there as a one-token request (its sampled token is
dropped, as vLLM's disaggregated proxy does). When it finishes, its KV (prompt
tokens x the model's KV bytes per token) crosses that worker's link, one
transfer at a time (bandwidth, plus latency per transfer), to the decode
worker with the fewest requests, which admits it with the prompt's KV
imported (``Request.handoff``, ``core.sched.handoff``) and decodes from its last prompt token:
its first token, then the rest. Colocated: the same arrivals over P + D
workers that each prefill (chunked, as configured) and decode.

Both report the single-engine simulator's per-request figures; the
disaggregated one adds each request's prefill-worker time and transfer time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stallfree.core.analysis.cluster_sim import Cluster, Worker
from stallfree.core.analysis.cost_model import CostModel
from stallfree.core.analysis.disagg_plan import Link
from stallfree.core.analysis.simulator import Arrival
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.handoff import KvHandoff
from stallfree.core.sched.request import Request, SamplingParams
from stallfree.core.sched.timings import percentile, request_timings, summarize


def _queued_tokens(worker: Worker) -> int:
    """Prompt tokens admitted or waiting there, not computed yet."""
    s = worker.engine.scheduler
    return sum(r.num_prompt_tokens - r.num_computed_tokens for r in [*s.waiting, *s.running])


def _fresh(a: Arrival, max_tokens: int, imported_tokens: int = 0) -> Request:
    req = Request(
        a.request_id,
        list(a.prompt),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        int(a.at_s * 1e9),
        a.priority,
        a.tenant,
    )
    if imported_tokens:
        req.handoff = KvHandoff(imported_tokens=imported_tokens)
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
    link_free_ns = {w.name: 0 for w in prefill}  # each prefill worker's link: busy until
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
                cluster.add(min(prefill, key=_queued_tokens), _fresh(payload, 1), t_ns)
            else:  # a transfer landed: the decode worker with the fewest requests takes it over
                a = by_id[payload]
                cluster.add(min(decode, key=lambda w: w.load), _fresh(a, a.max_tokens, len(a.prompt) - 1), t_ns)
            continue
        worker, out = nxt
        for req in cluster.ended(out):
            if worker in prefill:  # its KV onto the link, behind what is already on it
                done = worker.clock.now_ns
                wire_ns = int(len(req.prompt_token_ids) * kv_per_token * 8 / (link.gbps * 1e9) * 1e9)
                start = max(done, link_free_ns[worker.name])
                link_free_ns[worker.name] = start + wire_ns
                landed = start + wire_ns + int(link.latency_s * 1e9)
                t = request_timings(req.timeline)
                phases[req.request_id] = {
                    "prefill_worker_ms": t.e2e_ms,
                    "transfer_ms": (landed - done) / 1e6,
                    "queue_wait_ms": t.queue_wait_ms,  # at the prefill worker
                    "scheduling_delay_ms": t.scheduling_delay_ms,
                }
                cluster.at(landed, req.request_id)
            else:
                finished.append(req)
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
            cluster.add(min(cluster.workers, key=lambda w: (w.load, _queued_tokens(w))), _fresh(a, a.max_tokens), t_ns)
            continue
        _, out = nxt
        finished += cluster.ended(out)
    return _report(finished, {}, cluster, "colocated")


def _report(
    finished: list[Request], phases: dict[str, dict[str, float]], cluster: Cluster, kind: str
) -> dict[str, Any]:
    reqs = {
        req.request_id: {
            "arrival_ms": req.arrival_ns / 1e6,
            "prompt_tokens": req.num_prompt_tokens,
            "output_tokens": req.num_output_tokens,
            "finish_reason": req.finish_reason,
            **request_timings(req.timeline).as_dict(),
            **phases.get(req.request_id, {}),
        }
        for req in finished
    }
    start = min((r.arrival_ns for r in finished), default=0)
    end = max((r.timeline.finished_ns or 0 for r in finished), default=start)
    return {
        "kind": kind,
        "workers": [w.name for w in cluster.workers],
        "summary": {
            "requests": len(reqs),
            **summarize(finished, start, end),
            **(
                {
                    "queue_wait_p50_ms": percentile([p["queue_wait_ms"] for p in phases.values()], 50),
                    "scheduling_delay_p50_ms": percentile([p["scheduling_delay_ms"] for p in phases.values()], 50),
                }
                if phases
                else {}
            ),
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
