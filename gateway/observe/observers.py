"""The one interface for everything that watches requests and iterations:
metrics, dashboard telemetry, traces and the request log.

``EngineClient`` admits requests and fans tokens out; it tells each
observer what happened, guarding every call, so that an observer's failure
never costs anybody their tokens.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

import structlog

from stallfree.core.cluster.stats import ReplicaStats
from stallfree.core.model.tokenizer import Tokenizer
from stallfree.core.sched.batch import IterationRecord
from stallfree.core.sched.engine import Counts
from stallfree.core.sched.request import FinishReason, Request, RequestEnd
from stallfree.core.sched.timings import Goodness, RequestTimings, judge, request_timings

log = structlog.get_logger(__name__)


class Emitted(NamedTuple):
    """One request's tokens of one iteration."""

    request_id: str
    token_ids: list[int]
    emit_ns: int  # engine time the tokens were produced
    gap_ns: int | None  # since the request's previous tokens (None for its first)
    stalled: bool  # another request's prefill ran in that gap


class Observer:
    """Every event, on the event loop; an observer overrides those it needs."""

    def on_submit(self, req: Request, operation: str, model: str, traceparent: str | None) -> None:
        """Accepted and queued (operation: ``chat`` or ``text_completion``)."""

    def on_counts(self, counts: Counts) -> None:
        """After every engine step, including the ones that only report aborts."""

    def on_iteration(self, it: IterationRecord) -> None:
        """Once per iteration that ran."""

    def on_tokens(self, emitted: list[Emitted]) -> None:
        """Every request's tokens of one iteration, in one call (1,000 streams made
        one call per request per observer a fifth of the fan-out), before any of
        those requests' ``on_finish``."""

    def on_finish(self, req: Request, end: RequestEnd) -> None:
        """The request ended: ``req`` as the gateway sent it, ``end`` as the engine
        reports it (why, and the timeline with the engine's timestamps)."""

    def on_replicas(self, stats: list[ReplicaStats]) -> None:
        """Each engine replica's latest report (scale-out only), a few times a second."""

    def on_error(self, code: str) -> None:
        """An error answered to a client (a response or a frame), by its code."""

    def on_cut_off(self, request_id: str) -> None:
        """A reader too slow for its output was cut off (its KV freed)."""


COMPLETED = (FinishReason.STOP, FinishReason.LENGTH)


def goodness(end: RequestEnd, timings: RequestTimings) -> Goodness:
    """A finished request against the targets the scheduler gave it: the one
    judgment behind metrics, spans, the log and the dashboard (a request that
    never reached the scheduler had none)."""
    return judge(timings, end.ttft_slo_ms, end.tbt_slo_ms, end.reason in COMPLETED)


class RequestLog(Observer):
    """One ``request_finished`` line per request; prompt and completion text
    only when asked for (``--log-text``)."""

    def __init__(self, tokenizer: Tokenizer, log_text: bool = False) -> None:
        self.tokenizer = tokenizer
        self.log_text = log_text
        self._outputs: dict[str, list[int]] = {}  # with log_text: each request's tokens so far

    def on_tokens(self, emitted: list[Emitted]) -> None:
        if self.log_text:
            for e in emitted:
                self._outputs.setdefault(e.request_id, []).extend(e.token_ids)

    def on_finish(self, req: Request, end: RequestEnd) -> None:
        timings = request_timings(end.timeline)
        judged = goodness(end, timings)
        fields: dict[str, Any] = {
            "request_id": req.request_id,
            "tenant": req.tenant,
            "finish_reason": end.reason,
            "prompt_tokens": req.num_prompt_tokens,
            "completion_tokens": end.num_output_tokens,
            "cached_tokens": end.num_cached_tokens,
            "preemptions": end.num_preemptions,
            **timings.as_dict(),
            "ttft_slo_ms": end.ttft_slo_ms,
            "tbt_slo_ms": end.tbt_slo_ms,
            "good": judged.good,
            "ttft_met": judged.ttft_met,
            "tbt_met": judged.tbt_met,
        }
        if self.log_text:
            fields["prompt"] = self.tokenizer.decode(req.prompt_token_ids)
            fields["completion"] = self.tokenizer.decode(self._outputs.pop(req.request_id, []))
        log.info("request_finished", **fields)


class TargetLog(Observer):
    """A ``tbt_target_missed`` line when iterations run over the TBT target:
    at most one a second (it counts the misses since the previous line, by
    reason) and the shape of the last one, so a log is readable under load."""

    def __init__(self, period_s: float = 1.0) -> None:
        self.period_ns = int(period_s * 1e9)
        self._missed: Counter[str] = Counter()
        self._last_line_ns: int | None = None

    def on_iteration(self, it: IterationRecord) -> None:
        if it.target_missed is None:
            return
        self._missed[it.target_missed] += 1
        if self._last_line_ns is not None and it.end_ns - self._last_line_ns < self.period_ns:
            return
        log.warning(
            "tbt_target_missed",
            iterations=dict(self._missed),
            tbt_slo_ms=it.tbt_slo_ms,
            last_ms=round(it.duration_ns / 1e6, 2),
            last_predicted_ms=round(it.predicted_ns / 1e6, 2),
            last_reason=it.target_missed,
            last_decode_tokens=it.decode_tokens,
            last_prefill_tokens=it.prefill_tokens,
        )
        self._missed.clear()
        self._last_line_ns = it.end_ns
