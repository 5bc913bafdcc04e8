"""Live telemetry for the dashboard: recent gaps, iterations and TTFTs.

Fed from the same per-iteration fan-out (and the same engine timestamps) as
the metrics. Frames are built at most ``FRAMES_PER_S`` times a second and
only while someone watches; with hundreds of streams a frame stays small
because only ``MAX_SERIES`` streams are sent gap by gap (every gap still
counts in the rolling p50/p99/max). The share of good requests is over the
last ``GOOD_WINDOW`` requests that ended (a count, not a time, so that it
stays readable at a few requests a minute) and over all since start.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from stallfree.core.cluster.stats import ReplicaStats
from stallfree.core.sched.batch import IterationRecord
from stallfree.core.sched.request import Request, RequestEnd
from stallfree.core.sched.timings import Goodness, percentile, request_timings
from stallfree.gateway.observe.observers import Emitted, Observer, goodness

FRAMES_PER_S = 10
MAX_SERIES = 12
WINDOW_S = 10.0
MAX_PENDING = 2000  # per kind, between two frames
GOOD_WINDOW = 200  # requests


class Telemetry(Observer):
    def __init__(self) -> None:
        self._t0 = time.perf_counter_ns()
        self._gaps: list[list[float]] = []  # [series slot, t ms, gap ms, stalled]
        # [t ms, duration ms, decode, prefill, budget, predicted ms, TBT target ms]
        self._iterations: list[list[float]] = []
        self._missed = 0  # iterations over the TBT target, since start
        # speculative decoding since start: draft tokens verified, kept; decodes declined; decode steps
        self._drafts = {"draft_tokens": 0, "accepted_tokens": 0, "drafts_declined": 0, "decode_steps": 0}
        self._ttfts: list[list[Any]] = []  # [request id, queue ms, prefill ms]
        self._window: deque[tuple[int, float]] = deque(maxlen=20_000)  # (t ns, gap ms)
        self._slots: dict[str, int] = {}
        self._last: IterationRecord | None = None
        self._replicas: list[ReplicaStats] = []  # scale-out: each replica's latest report
        self._judged: deque[Goodness] = deque(maxlen=GOOD_WINDOW)
        self._total = {"requests": 0, "good": 0, "ttft_met": 0, "tbt_met": 0}  # since start

    def _ms(self, ns: int) -> float:
        return round((ns - self._t0) / 1e6, 2)

    def on_iteration(self, it: IterationRecord) -> None:
        self._last = it
        self._missed += it.target_missed is not None
        d = self._drafts
        d["draft_tokens"] += it.draft_tokens
        d["accepted_tokens"] += it.accepted_tokens
        d["drafts_declined"] += it.drafts_declined
        d["decode_steps"] += it.decode_tokens - it.draft_tokens
        if len(self._iterations) < MAX_PENDING:
            self._iterations.append(
                [
                    self._ms(it.end_ns),
                    round(it.duration_ns / 1e6, 2),
                    it.decode_tokens,
                    it.prefill_tokens,
                    it.token_budget,
                    round(it.predicted_ns / 1e6, 2),
                    it.tbt_slo_ms,
                    round(it.thread_cpu_ns / 1e6, 2),
                    it.thread_preempted,
                    it.thread_waits,
                    it.page_faults,
                    round(it.collector_ns / 1e6, 2),
                    it.decode_context_tokens,
                    it.chunk_prefix_tokens,
                ]
            )

    def on_tokens(self, emitted: list[Emitted]) -> None:
        """The gap before each request's tokens; stalled: the iteration also ran another request's prefill chunk."""
        for request_id, _, emit_ns, gap_ns, stalled in emitted:
            if gap_ns is None:
                continue
            gap_ms = gap_ns / 1e6
            self._window.append((emit_ns, gap_ms))
            slot = self._slots.get(request_id)
            if slot is None and len(self._slots) < MAX_SERIES:
                used = set(self._slots.values())
                slot = self._slots[request_id] = next(i for i in range(MAX_SERIES) if i not in used)
            if slot is not None and len(self._gaps) < MAX_PENDING:
                self._gaps.append([slot, self._ms(emit_ns), round(gap_ms, 2), int(stalled)])

    def on_finish(self, req: Request, end: RequestEnd) -> None:
        self._slots.pop(req.request_id, None)
        tl = end.timeline
        judged = goodness(end, request_timings(tl))
        self._judged.append(judged)
        self._total["requests"] += 1
        self._total["good"] += judged.good
        self._total["ttft_met"] += judged.ttft_met
        self._total["tbt_met"] += judged.tbt_met
        if tl.first_token_ns is None or len(self._ttfts) >= MAX_PENDING:
            return
        scheduled = tl.scheduled_ns if tl.scheduled_ns is not None else tl.first_token_ns
        self._ttfts.append(
            [
                req.request_id,
                round((scheduled - tl.arrival_ns) / 1e6, 2),
                round((tl.first_token_ns - scheduled) / 1e6, 2),
            ]
        )

    def on_replicas(self, stats: list[ReplicaStats]) -> None:
        self._replicas = stats

    def _state(self) -> dict[str, int]:
        """Queue and KV counts: the last iteration's, or with replicas the sums of their reports."""
        if self._replicas:
            rs = self._replicas
            return {
                "running": sum(r.running for r in rs),
                "waiting": sum(r.waiting for r in rs),
                "partial_prefills": sum(r.partial_prefills for r in rs),
                "kv_used": sum(r.kv_used_blocks for r in rs),
                "kv_cached": sum(r.kv_cached_blocks for r in rs),
                "kv_free": sum(r.kv_free_blocks for r in rs),
            }
        it = self._last
        return {
            "running": it.num_running if it else 0,
            "waiting": it.num_waiting if it else 0,
            "partial_prefills": it.num_partial_prefills if it else 0,
            "kv_used": it.kv_used_blocks if it else 0,
            "kv_cached": it.kv_cached_blocks if it else 0,
            "kv_free": it.kv_free_blocks if it else 0,
        }

    def _speculation(self) -> dict[str, float]:
        d = self._drafts
        steps = d["decode_steps"]
        per_step = (steps + d["accepted_tokens"]) / steps if steps else 1.0
        return {
            "draft_tokens": d["draft_tokens"],
            "accepted_tokens": d["accepted_tokens"],
            "drafts_declined": d["drafts_declined"],
            "tokens_per_step": round(per_step, 3),
        }

    def _goodput(self) -> dict[str, dict[str, int]]:
        """Ended requests, the good ones and those that met each target: the last ``GOOD_WINDOW``, and since start."""
        recent = self._judged
        return {
            "recent": {
                "requests": len(recent),
                "good": sum(j.good for j in recent),
                "ttft_met": sum(j.ttft_met for j in recent),
                "tbt_met": sum(j.tbt_met for j in recent),
            },
            "total": dict(self._total),
        }

    def frame(self, config: dict[str, Any]) -> dict[str, Any]:
        """Everything since the previous frame, plus rolling gap statistics."""
        now = time.perf_counter_ns()
        horizon = now - int(WINDOW_S * 1e9)
        while self._window and self._window[0][0] < horizon:
            self._window.popleft()
        gaps = [g for _, g in self._window]
        frame: dict[str, Any] = {
            "type": "telemetry",
            "t": self._ms(now),
            "gaps": self._gaps,
            "iterations": self._iterations,
            "ttft": self._ttfts[-20:],
            "stats": {
                "p50": round(percentile(gaps, 50), 2),
                "p99": round(percentile(gaps, 99), 2),
                "max": round(max(gaps, default=0.0), 2),
                "count": len(gaps),
                "window_s": WINDOW_S,
            },
            "goodput": self._goodput(),
            "state": {**self._state(), "target_missed": self._missed, **self._speculation(), **config},
        }
        if self._replicas:
            frame["replicas"] = [
                {
                    "replica": r.replica,
                    "running": r.running,
                    "waiting": r.waiting,
                    "kv_used": r.kv_used_blocks,
                    "kv_cached": r.kv_cached_blocks,
                    "kv_blocks": r.kv_blocks,
                }
                for r in self._replicas
            ]
        self._gaps, self._iterations, self._ttfts = [], [], []
        return frame
