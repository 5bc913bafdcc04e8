"""What a load run measured, summarised: TTFT, every inter-token gap,
throughput, refusals, prefix-cache hits, and goodput against TBT and TTFT targets.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from stallfree.core.sched.timings import percentile
from stallfree.loadtest.clients import Result


def all_decoding_rate(ok: list[Result]) -> float:
    """Tokens per second while every stream decodes: from the last stream's
    first token to the first stream's last. The run's throughput also holds
    the time before (the prompts' prefill, the first tokens) and after (the
    last streams alone); this is the decode rate of all of them together. 0
    when no such window exists (a stream ended before another began)."""
    if not ok:
        return 0.0
    begin, end = max(r.token_s[0] for r in ok), min(r.token_s[-1] for r in ok)
    if end <= begin:
        return 0.0
    return sum(begin < t <= end for r in ok for t in r.token_s) / (end - begin)


def outlived(results: list[Result], decoders: str = "decoder", long: str = "long") -> bool:
    """Whether every ``decoders`` stream still had a token to come after the last
    ``long`` prompt's first token: it decoded through the whole prefill, the last
    (costliest) chunk included. A faster engine's streams can end mid-prefill,
    and their worst gap then leaves out the chunks after the longest prefix."""
    firsts = [r.token_s[0] for r in results if r.job.group == long and r.token_s]
    streams = [r for r in results if r.job.group == decoders]
    if not firsts or not streams:
        return False
    return all(r.token_s and r.token_s[-1] > max(firsts) for r in streams)


def summarize(
    results: list[Result],
    group: str | None = None,
    tbt_slo_ms: float | None = None,
    scheduling_delay_ms: float | None = None,
    ttft_slo_ms: float | None = None,
) -> dict[str, Any]:
    """TTFT, scheduling delay and every inter-token gap, percentiles and max;
    throughput over the run; prefix-cache hits where the server says;
    refusals (how many, how fast); with a target (TBT, TTFT or both),
    goodput (``goodput``). ``scheduling_delay_ms``: the run's median scheduling
    delay read elsewhere (a probe), for servers whose responses do not carry it."""
    rs = [r for r in results if group is None or r.job.group == group]
    ok = [r for r in rs if r.error is None and r.token_s]
    refused = [r for r in rs if r.refused]
    ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    gaps = [g * 1e3 for r in ok for g in r.gaps_s]
    start = min((r.sent_s for r in rs), default=0.0)
    end = max((r.token_s[-1] for r in ok), default=start)
    tokens = sum(len(r.token_s) for r in ok)
    failed = [r for r in rs if not r.refused and (r.error is not None or not r.token_s)]
    out: dict[str, Any] = {
        "requests": len(rs),
        "errors": len(failed),
        "error_kinds": dict(Counter(r.error or "no tokens" for r in failed)),
        "refused": len(refused),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p90_ms": percentile(ttft, 90),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(gaps, 50),
        "itl_p90_ms": percentile(gaps, 90),
        "itl_p99_ms": percentile(gaps, 99),
        "max_gap_ms": max(gaps, default=0.0),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": tokens,
        "throughput_tokens_per_s": tokens / (end - start) if end > start else 0.0,
        "decode_tokens_per_s": all_decoding_rate(ok),
    }
    if refused:
        refusal_ms = [(r.refused_s or 0.0) * 1e3 for r in refused]
        out["refusal_p50_ms"] = percentile(refusal_ms, 50)
        out["refusal_p99_ms"] = percentile(refusal_ms, 99)
        out["refusal_max_ms"] = max(refusal_ms)
        waits = [r.retry_after_s for r in refused if r.retry_after_s is not None]
        if waits:
            out["retry_after_p50_s"] = percentile(waits, 50)
    split = [r.server_timings for r in ok if r.server_timings]
    if split:
        for k in ("queue_wait_ms", "prefill_ms", "decode_ms"):
            out[f"server_{k}_p50"] = percentile([t[k] for t in split], 50)
        out["scheduling_delay_p50_ms"] = percentile([t["scheduling_delay_ms"] for t in split], 50)
    elif scheduling_delay_ms is not None:
        out["scheduling_delay_p50_ms"] = scheduling_delay_ms
    reported = [r for r in ok if r.cached_tokens is not None]
    if reported:
        prompt = sum(r.prompt_tokens for r in reported)
        out["prefix_hit_rate"] = sum(r.cached_tokens or 0 for r in reported) / prompt if prompt else 0.0
    exact = [r for r in ok if r.job.prompt_tokens is not None]
    if exact:
        out["prompt_length_mismatches"] = sum(r.prompt_tokens != r.job.prompt_tokens for r in exact)
    if tbt_slo_ms is not None or ttft_slo_ms is not None:
        out |= goodput(rs, ttft_slo_ms, tbt_slo_ms, end - start)
    first_error = next((r.error for r in failed if r.error), None)
    if first_error:
        out["first_error"] = first_error
    return out


def goodput(rs: list[Result], ttft_slo_ms: float | None, tbt_slo_ms: float | None, span_s: float) -> dict[str, Any]:
    """Goodput, each request judged by ``Result.judge``: how many were good, their
    share of every request (refused and failed ones count as not good: what
    the goodput capacity reads) and of those admitted (what shedding keeps),
    each target's attainment over every request, and the good ones per second
    over ``span_s``; best-effort admissions (the server forecast a late first
    token): how many, how many were good after all; the median of measured
    over predicted TTFT, where the server predicted it."""
    judged = [(r, r.judge(ttft_slo_ms, tbt_slo_ms)) for r in rs]
    good = sum(g.good for _, g in judged)
    admitted = sum(not r.refused for r in rs)
    out: dict[str, Any] = {
        "tbt_slo_ms": tbt_slo_ms,
        "ttft_slo_ms": ttft_slo_ms,
        "good_requests": good,
        "good_share": good / len(rs) if rs else 0.0,
        "admitted_good_share": good / admitted if admitted else 0.0,
        "goodput_req_per_s": good / span_s if span_s > 0 else 0.0,
    }
    if ttft_slo_ms and rs:
        out["ttft_attainment"] = sum(g.ttft_met for _, g in judged) / len(rs)
    if tbt_slo_ms and rs:
        out["tbt_attainment"] = sum(g.tbt_met for _, g in judged) / len(rs)
    best_effort = [g for r, g in judged if r.best_effort]
    if best_effort:
        out["best_effort_requests"] = len(best_effort)
        out["best_effort_good"] = sum(g.good for g in best_effort)
    ratios = [(r.ttft_s or 0.0) * 1e3 / r.predicted_ttft_ms for r, g in judged if g.completed and r.predicted_ttft_ms]
    if ratios:
        out["ttft_over_predicted_p50"] = percentile(ratios, 50)
    return out
