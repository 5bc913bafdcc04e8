"""Run a workload through the real scheduler on a virtual clock (SimRunner).

Workloads are arrival lists: built-in scenarios, or a trace
(``core.analysis.traces``: the Azure and Mooncake production traces, or
stallfree's own JSONL with one request per line)::

    {"t": 0.25, "prompt_tokens": 812, "output_tokens": 64,
     "prefix": "system-a", "prefix_tokens": 256, "id": "r7", "priority": 0}

Requests sharing a prefix (a named one, or Mooncake's equal hash ids) share
those tokens, so prefix caching is replayed too.

With a TTFT target and ``shed_load``, each arrival first meets the server's
admission rule (``core.sched.deadline.verdict`` over the queue's forecast at
that moment): what the queue alone makes late is refused, as the gateway's
429 would. ``report`` judges every request against the targets (goodput).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallfree.core.analysis.sim_runner import SimDrafter, SimRunner, VirtualClock
from stallfree.core.analysis.traces import Replay, TraceRequest, prompt_ids, read_trace, replay
from stallfree.core.sched.batch import IterationRecord
from stallfree.core.sched.config import CacheConfig, SchedulerConfig, Speculate
from stallfree.core.sched.cost import IterationCost
from stallfree.core.sched.deadline import verdict
from stallfree.core.sched.engine import Engine
from stallfree.core.sched.policy import newcomer_place
from stallfree.core.sched.request import FinishReason, Request, SamplingParams
from stallfree.core.sched.timings import judge, request_timings, summarize

VOCAB = 32000


@dataclass(slots=True)
class Arrival:
    at_s: float
    request_id: str
    prompt: list[int]
    max_tokens: int
    priority: int = 0
    tenant: str = ""


def make_arrival(
    at_s: float,
    request_id: str,
    prompt_tokens: int,
    output_tokens: int,
    prefix: str | None = None,
    prefix_tokens: int = 0,
    priority: int = 0,
) -> Arrival:
    shared = ((f"p:{prefix}", min(prefix_tokens, prompt_tokens)),) if prefix else ()
    r = TraceRequest(at_s, prompt_tokens, output_tokens, shared, request_id, priority)
    return trace_arrivals([r])[0]


def trace_arrivals(requests: Iterable[TraceRequest], seed: object = "sim") -> list[Arrival]:
    """Arrivals with token ids for trace requests (equal shared keys, equal tokens)."""
    blocks: dict[str, list[int]] = {}
    return [
        Arrival(r.at_s, r.request_id, prompt_ids(r, seed, VOCAB, blocks=blocks), r.output_tokens, r.priority)
        for r in requests
    ]


def load_trace(path: Path, how: Replay | None = None, seed: object = "sim") -> list[Arrival]:
    """A trace file's window, scaled as ``how`` says (default: all of it as it is),
    as arrivals; errors name the line."""
    return trace_arrivals(replay(read_trace(path), how or Replay()), seed)


def scenario(name: str) -> tuple[list[Arrival], dict[str, Any]]:
    """Built-in workloads and the scheduler settings they assume.

    seed-figure3: the article's figure 3 on its worked example: 64 users
      decoding (B among them), then A arrives with an 8,192-token prompt;
      budget 576 = 64 decode tokens + one 512-token chunk.
    burst: the article's burst: the same 64 decoders, then ten 8,192-token
      prompts at once.
    short-behind-long: the same 64 decoders; a 32,768-token prompt L at
      0.2 s, then ten 200-token prompts S* from 0.25 s, one every 50 ms.
    multi-tenant: tenant "flood" sends 300 prompts of 500 tokens at once at
      0.1 s; tenants t1..t4 each send one like it every 0.25 s (64 output
      tokens each, at most 64 running).
    """
    decoders = [make_arrival(0.0, "B" if i == 0 else f"D{i}", 32, 120) for i in range(64)]
    settings = {"token_budget": 576, "max_num_seqs": 128, "max_model_len": 16384}
    if name == "short-behind-long":
        shorts = [make_arrival(0.25 + 0.05 * i, f"S{i}", 200, 16) for i in range(10)]
        return [*decoders, make_arrival(0.2, "L", 32768, 8), *shorts], settings | {"max_model_len": 40000}
    if name == "multi-tenant":
        flood = [make_arrival(0.1, f"F{i}", 500, 64) for i in range(300)]
        for a in flood:
            a.tenant = "flood"
        small = [make_arrival(0.25 * k, f"t{t}-{k}", 500, 64) for k in range(1, 20) for t in range(1, 5)]
        for a in small:
            a.tenant = a.request_id.split("-")[0]
        return flood + small, settings | {"max_num_seqs": 64}
    if name == "seed-figure3":
        return [*decoders, make_arrival(0.2, "A", 8192, 16)], settings
    if name == "burst":
        for a in decoders:
            a.max_tokens = 400
        return decoders + [make_arrival(0.2, f"L{i}", 8192, 8) for i in range(10)], settings
    raise ValueError(f"unknown scenario {name!r} ({', '.join(SCENARIOS)})")


SCENARIOS = ("seed-figure3", "burst", "short-behind-long", "multi-tenant")


@dataclass(slots=True)
class SimResult:
    requests: dict[str, Request]
    iterations: list[IterationRecord]
    engine: Engine
    shed: list[str] = dataclasses.field(default_factory=list)  # refused at arrival (``shed_load``)


def simulate(
    arrivals: Iterable[Arrival],
    scheduler: SchedulerConfig,
    cache: CacheConfig,
    cost: IterationCost,
    acceptance: float | None = None,
    shed_load: bool = False,
) -> SimResult:
    """``acceptance``: with ``speculate`` on, every decode proposes drafts and
    the simulated model keeps each with this probability (``SimDrafter``).
    ``shed_load``: refuse what the gateway's admission would (a TTFT target needed)."""
    clock = VirtualClock()
    drafter = None
    if scheduler.speculate != Speculate.OFF:
        if acceptance is None or not 0 <= acceptance <= 1:
            raise ValueError("simulating speculation needs an acceptance rate in [0, 1] (--draft-acceptance)")
        drafter = SimDrafter()
    runner = SimRunner(cost, cache.block_size, clock, VOCAB, acceptance=acceptance or 0.0)
    engine = Engine(scheduler, cache, runner, clock, cost, drafter)
    pending = sorted(arrivals, key=lambda a: a.at_s)
    requests: dict[str, Request] = {}
    shed: list[str] = []
    iterations = []
    i = 0
    while i < len(pending) or engine.has_work:
        if not engine.has_work:
            clock.now_ns = max(clock.now_ns, int(pending[i].at_s * 1e9))
        while i < len(pending) and int(pending[i].at_s * 1e9) <= clock.now_ns:
            a = pending[i]
            sampling = SamplingParams(max_tokens=a.max_tokens)
            req = Request(a.request_id, a.prompt, sampling, int(a.at_s * 1e9), a.priority, a.tenant)
            i += 1
            forecast = engine.scheduler.forecast(clock.now_ns)
            target = engine.config.ttft_slo_ms
            if shed_load and forecast is not None and target:
                due = int(a.at_s * 1e9) + target * 1e6
                place = newcomer_place(engine.config.policy, a.priority, a.tenant, len(a.prompt), forecast.served, due)
                if verdict(forecast, len(a.prompt), target, place).refusable:
                    shed.append(a.request_id)
                    continue
            engine.add_request(req)
            requests[a.request_id] = req
        out = engine.step()
        if out is not None and out.iteration is not None:
            iterations.append(out.iteration)
        elif out is None and engine.has_work:
            if i == len(pending):
                raise RuntimeError("simulation stalled: requests remain but none can be scheduled")
            clock.now_ns = int(pending[i].at_s * 1e9)
    return SimResult(requests, iterations, engine, shed)


def report(result: SimResult) -> dict[str, Any]:
    """Per request timings, summary percentiles over every gap, and the iterations."""
    reqs: dict[str, dict[str, Any]] = {}
    good = 0
    for rid, req in result.requests.items():
        timings = request_timings(req.timeline)
        completed = req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        goodness = judge(timings, req.ttft_slo_ms or 0.0, req.tbt_slo_ms, completed)
        good += goodness.good
        reqs[rid] = {
            "arrival_ms": req.arrival_ns / 1e6,
            "prompt_tokens": req.num_prompt_tokens,
            "output_tokens": req.num_output_tokens,
            "cached_tokens": req.num_cached_tokens,
            "finish_reason": req.finish_reason,
            "chunks": len(req.timeline.chunks),
            "preemptions": req.num_preemptions,
            "good": goodness.good,
            **timings.as_dict(),
        }
    its = result.iterations
    start = min((r.arrival_ns for r in result.requests.values()), default=0)
    end = max((it.end_ns for it in its), default=start)
    config = result.engine.config
    return {
        "config": {f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
        "summary": {
            "requests": len(reqs) + len(result.shed),
            "shed_requests": len(result.shed),
            "good_requests": good,
            "iterations": len(its),
            **summarize(result.requests.values(), start, end),
            "preemptions": result.engine.scheduler.num_preemptions,
            "prefix_hit_tokens": result.engine.kv.prefix_hit_tokens,
            **speculation(its),
        },
        "requests": reqs,
        "iterations": [
            {
                "iteration": it.iteration,
                "start_ms": (it.start_ns - start) / 1e6,
                "duration_ms": it.duration_ns / 1e6,
                "decode_tokens": it.decode_tokens,
                "prefill_tokens": it.prefill_tokens,
                "chunks": it.chunks,
                "kv_used_blocks": it.kv_used_blocks,
            }
            for it in its
        ],
    }


def speculation(its: list[IterationRecord]) -> dict[str, float]:
    """Draft tokens verified and kept, and the decode tokens each speculating or
    plain decode step yielded on average (1 without speculation)."""
    drafts = sum(it.draft_tokens for it in its)
    accepted = sum(it.accepted_tokens for it in its)
    decode_steps = sum(it.decode_tokens - it.draft_tokens for it in its)
    return {
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance": accepted / drafts if drafts else 0.0,
        "tokens_per_decode_step": (decode_steps + accepted) / decode_steps if decode_steps else 0.0,
    }


def format_report(rep: dict[str, Any], max_rows: int = 12, show_iterations: bool = False) -> str:
    s = rep["summary"]
    c = rep["config"]
    lines = [
        f"chunking {c['chunking']}, token budget {c['token_budget']}, policy {c['policy']}: "
        f"{s['requests']} requests, {s['iterations']} iterations, {s['duration_ms']:.1f} ms simulated",
        f"TTFT p50 {s['ttft_p50_ms']:.1f} ms, p99 {s['ttft_p99_ms']:.1f} ms | ITL p50 {s['itl_p50_ms']:.2f} ms, "
        f"p99 {s['itl_p99_ms']:.2f} ms, max gap {s['max_gap_ms']:.1f} ms | "
        f"{s['throughput_tokens_per_s']:,.0f} tokens/s, {s['preemptions']} preemptions",
        *(
            [
                f"goodput: {s['good_requests']} of {s['requests']} requests met both targets "
                f"(TTFT {c['ttft_slo_ms']:g} ms, TBT {c['tbt_slo_ms']:g} ms), {s['shed_requests']} refused"
            ]
            if c["ttft_slo_ms"] or c["tbt_slo_ms"]
            else []
        ),
        *(
            [
                f"speculation: {s['draft_tokens']:,} draft tokens verified, {s['acceptance']:.0%} kept, "
                f"{s['tokens_per_decode_step']:.2f} tokens per decode step"
            ]
            if s["draft_tokens"]
            else []
        ),
        "",
        f"  {'request':<10} {'prompt':>7} {'out':>5} {'queue':>8} {'prefill':>9} {'decode':>9} {'ttft':>9}"
        f" {'itl p50':>8} {'itl p99':>8} {'max gap':>8}  (ms)",
    ]
    rows = sorted(rep["requests"].items(), key=lambda kv: (-kv[1]["prompt_tokens"], kv[1]["arrival_ms"]))
    for rid, r in rows[:max_rows]:
        lines.append(
            f"  {rid:<10} {r['prompt_tokens']:>7} {r['output_tokens']:>5} {r['queue_wait_ms']:>8.1f}"
            f" {r['prefill_ms']:>9.1f} {r['decode_ms']:>9.1f} {r['ttft_ms']:>9.1f} {r['itl_p50_ms']:>8.2f}"
            f" {r['itl_p99_ms']:>8.2f} {r['max_gap_ms']:>8.1f}"
        )
    if len(rows) > max_rows:
        lines.append(f"  ... {len(rows) - max_rows} more (longest prompts first; --json for all)")
    if show_iterations:
        lines += ["", "  iteration  start ms  duration ms  decode  prefill  chunks"]
        for it in rep["iterations"]:
            chunks = ", ".join(f"{k}:{v}" for k, v in it["chunks"].items())
            lines.append(
                f"  {it['iteration']:>9} {it['start_ms']:>9.1f} {it['duration_ms']:>12.2f} {it['decode_tokens']:>7}"
                f" {it['prefill_tokens']:>8}  {chunks}"
            )
    return "\n".join(lines)
