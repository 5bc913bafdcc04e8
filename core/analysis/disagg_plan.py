"""Disaggregated prefill/decode against chunked prefill, on paper.

P prefill workers run whole prompts (prefill-only batches), ship each
prompt's KV over a link to one of D decode workers, which only decode. The
same P + D workers colocated run chunked prefill beside their decodes. The
article's arithmetic gives each side's TTFT, inter-token gaps and worst gap;
queueing at the prefill workers and on the links is M/D/1 (Poisson arrivals,
fixed service time), so a side whose prefill or link is saturated has no
finite TTFT.

Disaggregated TTFT counts the transfer and the decode worker's first step:
the first token streams from the decode worker, as the client sees it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from stallfree.core.analysis.cost_model import CostModel
from stallfree.core.analysis.planner import chunk_schedule


@dataclass(slots=True, frozen=True)
class Link:
    gbps: float  # each prefill worker's link, Gbit/s
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.gbps > 0 or self.latency_s < 0:
            raise ValueError("the KV link needs bandwidth > 0 (--link-gbps) and latency >= 0 (--link-latency-ms)")

    def transfer_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes * 8 / (self.gbps * 1e9)


def md1_wait_s(service_s: float, utilization: float) -> float:
    """Mean wait in an M/D/1 queue (Pollaczek-Khinchine with no service variance)."""
    if utilization >= 1.0:
        return math.inf
    return utilization * service_s / (2 * (1 - utilization))


def disaggregated(
    cost: CostModel,
    prefill_workers: int,
    decode_workers: int,
    link: Link,
    prompt: int,
    rate: float,
    decoders: int,
    decode_context: int = 0,
) -> dict[str, Any]:
    """One prompt length at one arrival rate (prompts/s over the whole cluster)."""
    prefill_s = cost.iteration_s([], [(0, prompt)])
    kv_bytes = prompt * cost.model.kv_bytes_per_token
    transfer_s = link.transfer_s(kv_bytes)
    per_decode_worker = math.ceil(decoders / decode_workers)
    step_s = cost.iteration_s([decode_context] * per_decode_worker, [])
    prefill_util = rate * prefill_s / prefill_workers
    link_util = rate * (transfer_s - link.latency_s) / prefill_workers
    wait_s = md1_wait_s(prefill_s, prefill_util) + md1_wait_s(transfer_s - link.latency_s, link_util)
    return {
        "kv_bytes": kv_bytes,
        "transfer_ms": transfer_s * 1e3,
        "prefill_ms": prefill_s * 1e3,
        "prefill_utilization": prefill_util,
        "link_utilization": link_util,
        "ttft_ms": (wait_s + prefill_s + transfer_s + step_s) * 1e3,
        "itl_ms": step_s * 1e3,
        "itl_p99_ms": step_s * 1e3,
        "max_gap_ms": step_s * 1e3,
        "decoders_per_worker": per_decode_worker,
    }


def colocated(
    cost: CostModel, workers: int, prompt: int, rate: float, decoders: int, budget: int, decode_context: int = 0
) -> dict[str, Any]:
    """The same workers, each decoding its share and prefilling its share of prompts in chunks."""
    per_worker = math.ceil(decoders / workers)
    times = chunk_schedule(cost, per_worker, decode_context, prompt, budget)
    service_s = sum(times)
    step_s = cost.iteration_s([decode_context] * per_worker, [])
    util = rate / workers * service_s  # the share of time a worker runs chunks
    # one gap per iteration: per second, util / (mean chunk iteration) of them are chunk iterations
    chunk_rate = util / (service_s / len(times))
    plain_rate = (1 - util) / step_s
    saturated = util >= 1
    return {
        "chunks": len(times),
        "chunk_iteration_ms": max(times) * 1e3,
        "prefill_utilization": util,
        "ttft_ms": (md1_wait_s(service_s, util) + service_s) * 1e3,
        "itl_ms": math.inf if saturated else 1e3 / (chunk_rate + plain_rate),
        "itl_p99_ms": max(times) * 1e3 if saturated or chunk_rate / (chunk_rate + plain_rate) > 0.01 else step_s * 1e3,
        "max_gap_ms": max(times) * 1e3,
        "decoders_per_worker": per_worker,
    }


def _winner(a: float, b: float) -> str:
    if math.isinf(a) and math.isinf(b):
        return "neither"
    return "disaggregated" if a < b else "chunked" if b < a else "tie"


def compare(
    cost: CostModel,
    prefill_workers: int,
    decode_workers: int,
    link: Link,
    prompts: tuple[int, ...],
    rates: tuple[float, ...],
    decoders: int = 64,
    budget: int = 576,
    decode_context: int = 0,
) -> dict[str, Any]:
    """Every prompt length x arrival rate: both sides' figures and who wins on TTFT and on the worst gap."""
    if prefill_workers < 1 or decode_workers < 1:
        raise ValueError("--disaggregate P:D needs at least one prefill and one decode worker")
    workers = prefill_workers + decode_workers
    rows = []
    for prompt in prompts:
        for rate in rates:
            d = disaggregated(cost, prefill_workers, decode_workers, link, prompt, rate, decoders, decode_context)
            c = colocated(cost, workers, prompt, rate, decoders, budget, decode_context)
            rows.append(
                {
                    "prompt_tokens": prompt,
                    "rate_per_s": rate,
                    "disaggregated": d,
                    "chunked": c,
                    "ttft_winner": _winner(d["ttft_ms"], c["ttft_ms"]),
                    "max_gap_winner": _winner(d["max_gap_ms"], c["max_gap_ms"]),
                }
            )
    return {
        "model": cost.model.name,
        "hardware": cost.hardware.name,
        "prefill_workers": prefill_workers,
        "decode_workers": decode_workers,
        "link_gbps": link.gbps,
        "link_latency_ms": link.latency_s * 1e3,
        "decoders": decoders,
        "token_budget": budget,
        "kv_bytes_per_token": cost.model.kv_bytes_per_token,
        "rows": rows,
    }


def _ms(v: float) -> str:
    return "sat." if math.isinf(v) else f"{v:,.1f}"


def format_compare(doc: dict[str, Any]) -> str:
    p, d = doc["prefill_workers"], doc["decode_workers"]
    lines = [
        f"Disaggregated {p}:{d} (link {doc['link_gbps']:g} Gbit/s, {doc['link_latency_ms']:g} ms) against chunked "
        f"prefill on {p + d} workers (budget {doc['token_budget']}); {doc['model']} on {doc['hardware']}, "
        f"{doc['decoders']} decoding users",
        "TTFT counts the KV transfer and the decode worker's first step; 'sat.' = that side cannot keep up.",
        "",
        f"  {'prompt':>7} {'rate/s':>6} | {'KV MiB':>7} {'xfer ms':>8} {'TTFT':>8} {'ITL':>6} {'max gap':>8} |"
        f" {'TTFT':>8} {'ITL':>6} {'ITL p99':>8} {'max gap':>8} | {'TTFT':<13} {'max gap':<13}",
        f"  {'':>7} {'':>6} | {'disaggregated':^43} | {'chunked':^35} | {'wins':^27}",
    ]
    for r in doc["rows"]:
        a, c = r["disaggregated"], r["chunked"]
        lines.append(
            f"  {r['prompt_tokens']:>7,} {r['rate_per_s']:>6g} |"
            f" {a['kv_bytes'] / 2**20:>7,.0f} {a['transfer_ms']:>8.1f}"
            f" {_ms(a['ttft_ms']):>8} {_ms(a['itl_ms']):>6} {_ms(a['max_gap_ms']):>8} |"
            f" {_ms(c['ttft_ms']):>8} {_ms(c['itl_ms']):>6} {_ms(c['itl_p99_ms']):>8} {_ms(c['max_gap_ms']):>8} |"
            f" {r['ttft_winner']:<13} {r['max_gap_winner']:<13}"
        )
    return "\n".join(lines)
