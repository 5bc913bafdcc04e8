"""Goodput in every report: scripted request timelines judged against their
targets, counted by the metrics and the dashboard's feed, and carried on the
root span and the log line."""

from __future__ import annotations

import time

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from stallfree.core.sched.request import FinishReason, Request, RequestStatus, SamplingParams
from stallfree.gateway.observe.metrics import Metrics
from stallfree.gateway.observe.observers import RequestLog
from stallfree.gateway.observe.telemetry import GOOD_WINDOW, Telemetry
from stallfree.gateway.observe.tracing import Tracing

MS = 1_000_000
TTFT_SLO_MS, TBT_SLO_MS = 500.0, 50.0


def ended(
    ttft_ms: float,
    gaps_ms: list[float],
    reason: FinishReason = FinishReason.LENGTH,
    ttft_slo_ms: float | None = TTFT_SLO_MS,
    request_id: str = "r",
) -> Request:
    """A request as the engine hands it over at its end: first token after
    ``ttft_ms``, then one token after each gap."""
    req = Request(request_id, [1, 2, 3], SamplingParams(max_tokens=len(gaps_ms) + 1), time.perf_counter_ns())
    req.ttft_slo_ms, req.tbt_slo_ms = ttft_slo_ms, TBT_SLO_MS
    tl = req.timeline
    tl.scheduled_ns = tl.arrival_ns + MS
    t = tl.first_token_ns = tl.arrival_ns + int(ttft_ms * MS)
    tl.token_ns.append(t)
    for gap in gaps_ms:
        t += int(gap * MS)
        tl.token_ns.append(t)
    tl.stalled = [False] * len(gaps_ms)
    tl.finished_ns = t
    req.output_token_ids = [7] * len(tl.token_ns)
    req.status, req.finish_reason = RequestStatus.FINISHED, reason
    return req


def finish(observer: Telemetry, req: Request) -> None:
    observer.on_finish(req, req.end())


def good() -> Request:
    return ended(200, [20] * 10)


def late() -> Request:
    return ended(900, [20] * 10)


def stalled() -> Request:
    """One 400 ms gap in 10 is its P99: over the TBT target."""
    return ended(200, [20] * 9 + [400])


def one_spike() -> Request:
    """One 400 ms gap in 200 is its worst, not its P99: within the TBT target."""
    return ended(200, [20] * 199 + [400])


def aborted() -> Request:
    """Within both targets, but cut off: not good."""
    return ended(200, [20] * 3, FinishReason.ABORT)


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def test_metrics_count_good_requests_and_each_target_met():
    metrics = Metrics()
    assert sample(metrics, "stallfree_target_met_total", target="ttft") == 0  # present before any request
    for req in (good(), late(), stalled(), one_spike(), aborted()):
        metrics.on_finish(req, req.end())
    assert sample(metrics, "stallfree_requests_good_total") == 2  # good, one_spike
    assert sample(metrics, "stallfree_target_met_total", target="ttft") == 4  # all but late
    assert sample(metrics, "stallfree_target_met_total", target="tbt") == 4  # all but stalled
    assert sample(metrics, "stallfree_max_gap_seconds_sum") > 0.8  # the two 400 ms worst gaps


def test_metrics_count_admission_verdicts():
    metrics = Metrics()
    for verdict in ("on_time", "on_time", "late", "shed"):
        metrics.on_admission(verdict)
    counts = {v: sample(metrics, "stallfree_admission_total", verdict=v) for v in ("on_time", "late", "shed")}
    assert counts == {"on_time": 2, "late": 1, "shed": 1}


def test_a_request_with_no_targets_is_good_once_it_completes():
    metrics = Metrics()
    slow = ended(5_000, [900] * 3, ttft_slo_ms=0.0)
    slow.tbt_slo_ms = 0.0
    never_scheduled = Request("n", [1], SamplingParams(), time.perf_counter_ns())  # no target given
    slow.finish_reason = FinishReason.STOP
    never_scheduled.finish_reason = FinishReason.ABORT
    metrics.on_finish(slow, slow.end())
    metrics.on_finish(never_scheduled, never_scheduled.end())
    assert sample(metrics, "stallfree_requests_good_total") == 1
    assert sample(metrics, "stallfree_target_met_total", target="ttft") == 2


def test_telemetry_shares_over_the_last_requests_and_since_start():
    telemetry = Telemetry()
    for i in range(50):
        finish(telemetry, ended(900, [20] * 10, request_id=f"late{i}"))
    first = telemetry.frame({})["goodput"]
    assert first["recent"] == {"requests": 50, "good": 0, "ttft_met": 0, "tbt_met": 50}
    for i in range(GOOD_WINDOW):
        finish(telemetry, ended(200, [20] * 10, FinishReason.STOP, request_id=f"good{i}"))
    finish(telemetry, stalled())
    goodput = telemetry.frame({})["goodput"]
    n = GOOD_WINDOW
    assert goodput["recent"] == {"requests": n, "good": n - 1, "ttft_met": n, "tbt_met": n - 1}  # the late ones left
    assert goodput["total"] == {"requests": 51 + n, "good": n, "ttft_met": 1 + n, "tbt_met": 50 + n}


def verdict(attributes) -> tuple[bool, bool, bool]:
    return tuple(attributes[f"stallfree.{k}"] for k in ("good", "ttft_target_met", "tbt_target_met"))


def test_root_span_carries_the_verdict_and_the_targets():
    exporter = InMemorySpanExporter()
    tracing = Tracing(exporter)
    spike, missed = one_spike(), late()
    spike.request_id, missed.request_id = "spike", "late"
    try:
        for req in (spike, missed):
            tracing.on_submit(req, "chat", "smol", None)
            tracing.on_finish(req, req.end())
        assert tracing.provider.force_flush(5_000)
        spans = exporter.get_finished_spans()
    finally:
        tracing.shutdown()
    roots = {s.attributes["stallfree.request.id"]: s.attributes for s in spans if s.kind == SpanKind.SERVER}
    assert verdict(roots["spike"]) == (True, True, True)
    assert roots["spike"]["stallfree.max_gap_ms"] == 400  # beside the P99 it was judged by
    assert (roots["spike"]["stallfree.ttft_slo_ms"], roots["spike"]["stallfree.tbt_slo_ms"]) == (500, 50)
    assert verdict(roots["late"]) == (False, False, True)


def test_the_log_line_says_whether_the_request_was_good():
    log = RequestLog(tokenizer=None)  # no text asked for: the tokenizer is never used
    with capture_logs() as logs:
        for req in (one_spike(), stalled(), aborted()):
            log.on_finish(req, req.end())
    judged = [(e["good"], e["ttft_met"], e["tbt_met"], e["max_gap_ms"]) for e in logs]
    assert judged == [(True, True, True, 400), (False, True, False, 400), (False, True, True, 20)]
    assert (logs[0]["ttft_slo_ms"], logs[0]["tbt_slo_ms"]) == (TTFT_SLO_MS, TBT_SLO_MS)
