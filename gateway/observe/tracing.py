"""OpenTelemetry spans: one SERVER span per request with children
``queue_wait``, ``prefill`` (an event per chunk) and ``decode``.

Every start and end comes from the engine's monotonic timestamps, mapped
onto the wall clock once, so the three phases tile the request exactly.
Configured by the standard ``OTEL_*`` variables and off unless an OTLP
endpoint is set; spans go through a BatchSpanProcessor, whose worker thread
does all exporting (an unreachable collector costs a logged warning).
Optional ``engine.iteration`` spans (sampled) link to the requests they served.
The root span carries the request's verdict against its targets
(``stallfree.good``), so a trace search finds the requests that missed one.
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Link, Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from stallfree.core.sched.batch import IterationRecord
from stallfree.core.sched.request import Request, RequestEnd
from stallfree.core.sched.timings import request_timings
from stallfree.gateway.observe.observers import Observer, goodness

log = structlog.get_logger(__name__)


def exporter_from_env() -> SpanExporter | None:
    """The OTLP exporter the standard variables ask for, or None (tracing off)."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true" or env.get("OTEL_TRACES_EXPORTER", "otlp") == "none":
        return None
    if not (env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return None
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    if protocol != "http/protobuf":
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r} is not supported (http/protobuf, grpc)")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter()


class Tracing(Observer):
    def __init__(self, exporter: SpanExporter, iteration_sample: float = 0.0) -> None:
        service = os.environ.get("OTEL_SERVICE_NAME", "stallfree")
        self.provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("stallfree")
        self.iteration_sample = iteration_sample
        self._wall_offset = time.time_ns() - time.perf_counter_ns()  # monotonic -> wall, fixed once
        self._roots: dict[str, Span] = {}

    @classmethod
    def from_env(cls, iteration_sample: float = 0.0) -> Tracing | None:
        exporter = exporter_from_env()
        return cls(exporter, iteration_sample) if exporter is not None else None

    def _wall(self, perf_ns: int) -> int:
        return perf_ns + self._wall_offset

    def on_submit(self, req: Request, operation: str, model: str, traceparent: str | None) -> None:
        """Open the root span at arrival; its parent comes from a W3C traceparent."""
        parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent}) if traceparent else Context()
        s = req.sampling
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": model,
            "stallfree.request.id": req.request_id,
            "gen_ai.request.max_tokens": s.max_tokens,
            "gen_ai.request.temperature": s.temperature,
            "gen_ai.request.top_p": s.top_p,
            "gen_ai.request.top_k": s.top_k,
        }
        if s.seed is not None:
            attributes["gen_ai.request.seed"] = s.seed
        span = self.tracer.start_span(
            f"{operation} {model}",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=self._wall(req.arrival_ns),
            attributes=attributes,
        )
        self._roots[req.request_id] = span

    def traceparent(self, request_id: str) -> str | None:
        """The W3C traceparent of a request's root span, for work done elsewhere (a replica)."""
        root = self._roots.get(request_id)
        if root is None:
            return None
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(root))
        return carrier.get("traceparent")

    def on_finish(self, req: Request, ended: RequestEnd) -> None:
        root = self._roots.pop(req.request_id, None)
        if root is None:
            return
        tl = ended.timeline
        t = request_timings(tl)
        judged = goodness(ended, t)
        end = tl.finished_ns if tl.finished_ns is not None else time.perf_counter_ns()
        scheduled = tl.scheduled_ns if tl.scheduled_ns is not None else end
        parent = trace.set_span_in_context(root)
        self.tracer.start_span("queue_wait", parent, start_time=self._wall(tl.arrival_ns)).end(self._wall(scheduled))
        if tl.scheduled_ns is not None:
            first = tl.first_token_ns if tl.first_token_ns is not None else end
            prefill = self.tracer.start_span("prefill", parent, start_time=self._wall(scheduled))
            prefill.set_attribute("stallfree.chunks", len(tl.chunks))
            for c in tl.chunks:
                prefill.add_event(
                    "chunk",
                    {
                        "stallfree.iteration": c.iteration,
                        "stallfree.chunk_tokens": c.tokens,
                        "stallfree.prefix_len": c.prefix_len,
                        "stallfree.iteration_ms": (c.end_ns - c.start_ns) / 1e6,
                    },
                    timestamp=self._wall(c.start_ns),
                )
            prefill.end(self._wall(first))
            if tl.first_token_ns is not None:
                decode = self.tracer.start_span("decode", parent, start_time=self._wall(first))
                decode.set_attributes(
                    {
                        "gen_ai.usage.output_tokens": ended.num_output_tokens,
                        "stallfree.itl_p50_ms": t.itl_p50_ms,
                        "stallfree.itl_p99_ms": t.itl_p99_ms,
                        "stallfree.max_gap_ms": t.max_gap_ms,
                        "stallfree.stalled_gaps": t.stalled_gaps,
                        "stallfree.draft_tokens": ended.num_draft_tokens,
                        "stallfree.accepted_draft_tokens": ended.num_accepted_tokens,
                    }
                )
                decode.end(self._wall(end))
        root.set_attributes(
            {
                "gen_ai.usage.input_tokens": req.num_prompt_tokens,
                "gen_ai.usage.output_tokens": ended.num_output_tokens,
                "gen_ai.response.finish_reasons": [ended.reason],
                "stallfree.cached_tokens": ended.num_cached_tokens,
                "stallfree.preemptions": ended.num_preemptions,
                "stallfree.max_gap_ms": t.max_gap_ms,
                "stallfree.ttft_slo_ms": ended.ttft_slo_ms,
                "stallfree.tbt_slo_ms": ended.tbt_slo_ms,
                "stallfree.ttft_target_met": judged.ttft_met,
                "stallfree.tbt_target_met": judged.tbt_met,
                "stallfree.good": judged.good,
            }
        )
        root.end(self._wall(end))

    def on_iteration(self, it: IterationRecord) -> None:
        if self.iteration_sample <= 0 or random.random() >= self.iteration_sample:
            return
        links = [Link(self._roots[r].get_span_context()) for r in it.request_ids if r in self._roots]
        span = self.tracer.start_span(
            "engine.iteration",
            Context(),
            links=links,
            start_time=self._wall(it.start_ns),
            attributes={
                "stallfree.iteration": it.iteration,
                "stallfree.decode_tokens": it.decode_tokens,
                "stallfree.prefill_tokens": it.prefill_tokens,
                "stallfree.token_budget": it.token_budget,
                "stallfree.iteration_ms": it.duration_ns / 1e6,
                "stallfree.predicted_ms": it.predicted_ns / 1e6,
                "stallfree.tbt_slo_ms": it.tbt_slo_ms,
                "stallfree.chunking": it.chunking,
                "stallfree.draft_tokens": it.draft_tokens,
                "stallfree.accepted_draft_tokens": it.accepted_tokens,
                "stallfree.drafts_declined": it.drafts_declined,
            },
        )
        if it.target_missed is not None:
            span.set_attribute("stallfree.tbt_target_missed", it.target_missed)
        span.end(self._wall(it.end_ns))

    def shutdown(self, timeout_s: float = 3.0) -> None:
        """Flush what is queued, but never hang shutdown on a dead collector."""
        worker = threading.Thread(target=self.provider.shutdown, daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            log.warning("trace_export_unfinished", detail="collector unreachable; spans dropped at shutdown")
