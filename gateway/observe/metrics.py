"""Prometheus metrics (``GET /metrics``), fed from the engine's own timestamps.

Histograms start at 1 ms, because vLLM's 10 ms smallest ITL bucket hides
the tail on fast decodes; ``itl`` observes every gap, not per-request means.
Each server owns its registry (several servers can live in one process).

Beside stallfree's own names, the queue and KV gauges are also exported under
the names Kubernetes' Gateway API Inference Extension (llm-d's endpoint
picker) scrapes from a model server: ``vllm:num_requests_waiting``,
``vllm:num_requests_running`` and ``vllm:gpu_cache_usage_perc`` /
``vllm:kv_cache_usage_perc`` (0-1). With replicas (scale-out) the plain
gauges are the sums and ``stallfree_replica_*`` carry each replica's.

Goodput: every ended request is judged once against its targets
(``gateway.observe.observers.goodness``); ``stallfree_requests_good`` over
``stallfree_requests_finished`` is the share of good requests, and
``stallfree_target_met`` says which target the others missed.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, generate_latest

from stallfree.core.cluster.stats import ReplicaStats
from stallfree.core.sched.batch import IterationRecord
from stallfree.core.sched.config import CHUNKING_MODES
from stallfree.core.sched.engine import Counts
from stallfree.core.sched.request import FinishReason, Request, RequestEnd
from stallfree.core.sched.timings import request_timings
from stallfree.gateway.observe.observers import Emitted, Observer, goodness

LATENCY_BUCKETS = (
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.25,  # fine about 2 s: capacity's scheduling-delay limit is read from this histogram
    1.5,
    1.75,
    2.0,
    2.5,
    3.0,
    5.0,
    10.0,
    30.0,
    60.0,
)
# measured / predicted iteration time: 1 is a perfect prediction
RATIO_BUCKETS = (0.5, 0.67, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0)
# on_time: admitted, forecast to meet its TTFT target; late: admitted best-effort,
# forecast to miss it; shed: refused (429)
ADMISSION_VERDICTS = ("on_time", "late", "shed")


class Metrics(Observer):
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(f"stallfree_{name}_seconds", doc, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = hist("ttft", "Time to first token, from arrival")
        self.itl = hist("itl", "Every inter-token gap")
        self.max_gap = hist("max_gap", "Largest inter-token gap of each finished request")
        self.queue_wait = hist("queue_wait", "Arrival to first scheduled")
        self.scheduling_delay = hist(
            "scheduling_delay", "Arrival to first token, less the iterations its prompt ran in (the capacity rule's)"
        )
        self.prefill = hist("prefill", "First scheduled to first token")
        self.decode = hist("decode", "First token to finish")
        self.e2e = hist("e2e", "Arrival to finish")
        self.iteration = hist("iteration_duration", "Engine iteration wall time")
        self.prediction_error = Histogram(
            "stallfree_iteration_prediction_error_ratio",
            "Each iteration's measured / predicted time (the cost model, corrected online)",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.tbt_slo = Gauge("stallfree_tbt_slo_seconds", "TBT target sizing each iteration (0: off)", registry=r)
        self.cost_correction = Gauge(
            "stallfree_cost_model_correction",
            "Measured / fitted iteration time the cost model has learnt, by kind of iteration",
            ["kind"],
            registry=r,
        )
        self.target_missed = Counter(
            "stallfree_tbt_target_missed",
            "Iterations with decodes that ran over the TBT target, by why: decodes (they alone fill it), "
            "floor (prefill kept moving), prediction (sized within, measured over)",
            ["reason"],
            registry=r,
        )
        self.running = Gauge("stallfree_requests_running", "Requests admitted (prefilling or decoding)", registry=r)
        self.waiting = Gauge("stallfree_requests_waiting", "Requests waiting for admission", registry=r)
        self.partial = Gauge("stallfree_partial_prefills", "Prompts partly prefilled", registry=r)
        self.kv_blocks = Gauge("stallfree_kv_blocks", "KV cache blocks by state", ["state"], registry=r)
        self.token_budget = Gauge("stallfree_token_budget", "Tokens per iteration", registry=r)
        self.chunking = Enum("stallfree_chunking_mode", "Scheduler mode", states=list(CHUNKING_MODES), registry=r)
        self.prompt_tokens = Counter("stallfree_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("stallfree_generation_tokens", "Tokens generated", registry=r)
        self.prefix_hit_tokens = Counter(
            "stallfree_prefix_hit_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.preemptions = Counter("stallfree_preemptions", "Requests preempted (recompute)", registry=r)
        self.draft_tokens = Counter(
            "stallfree_draft_tokens", "Draft tokens verified (speculative decoding)", ["outcome"], registry=r
        )
        self.drafts_declined = Counter(
            "stallfree_drafts_declined", "Decodes whose drafts the cost model said would not pay", registry=r
        )
        self.tokens_per_step = Gauge(
            "stallfree_decode_tokens_per_step",
            "Tokens each decode yielded per iteration, the latest iteration with decodes (1 without speculation)",
            registry=r,
        )
        self.finished = Counter("stallfree_requests_finished", "Finished requests", ["finish_reason"], registry=r)
        self.good = Counter(
            "stallfree_requests_good", "Finished requests that completed and met their TTFT and TBT targets", registry=r
        )
        self.target_met = Counter(
            "stallfree_target_met",
            "Finished requests that met each target (TTFT: their first token; TBT: the P99 of their gaps; "
            "a target of 0 is met by anything)",
            ["target"],
            registry=r,
        )
        self.admission = Counter(
            "stallfree_admission",
            "Admission verdicts against the TTFT target's queue forecast: on_time, late (admitted best-effort), "
            "shed (refused)",
            ["verdict"],
            registry=r,
        )
        for target in ("ttft", "tbt"):  # 0, not absent, until the first request ends
            self.target_met.labels(target)
        for verdict in ADMISSION_VERDICTS:
            self.admission.labels(verdict)
        self.aborts = Counter("stallfree_aborts", "Requests aborted (cancel, disconnect, stop string)", registry=r)
        self.errors = Counter("stallfree_errors", "Errors returned to clients, by code", ["code"], registry=r)
        self.gie_waiting = Gauge("vllm:num_requests_waiting", "Requests queued (Inference Extension name)", registry=r)
        self.gie_running = Gauge("vllm:num_requests_running", "Requests running (Inference Extension name)", registry=r)
        self.gie_kv = [
            Gauge(name, "KV cache utilization, 0-1 (Inference Extension name)", registry=r)
            for name in ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc")
        ]
        self.replica_requests = Gauge(
            "stallfree_replica_requests", "Each replica's requests by state", ["replica", "state"], registry=r
        )
        self.replica_kv = Gauge(
            "stallfree_replica_kv_usage", "Each replica's KV cache utilization, 0-1", ["replica"], registry=r
        )
        self.replicas_reporting = Gauge("stallfree_replicas_reporting", "Engine replicas reporting", registry=r)
        self._replicas: set[str] = set()
        self.slow_consumers = Counter(
            "stallfree_slow_consumer_cutoffs", "Streams cut off because their reader fell behind", registry=r
        )

    def on_iteration(self, it: IterationRecord) -> None:
        self.iteration.observe(it.duration_ns / 1e9)
        if it.predicted_ns:
            self.prediction_error.observe(it.duration_ns / it.predicted_ns)
            self.cost_correction.labels("prefill" if it.prefill_tokens else "decode").set(it.correction)
        if it.target_missed is not None:
            self.target_missed.labels(it.target_missed).inc()
        self.tbt_slo.set(it.tbt_slo_ms / 1e3)
        self.token_budget.set(it.token_budget)
        self.chunking.state(it.chunking)
        if it.preemptions:
            self.preemptions.inc(it.preemptions)
        if it.draft_tokens:
            self.draft_tokens.labels("accepted").inc(it.accepted_tokens)
            self.draft_tokens.labels("rejected").inc(it.draft_tokens - it.accepted_tokens)
        if it.drafts_declined:
            self.drafts_declined.inc(it.drafts_declined)
        steps = it.decode_tokens - it.draft_tokens
        if steps:
            self.tokens_per_step.set((steps + it.accepted_tokens) / steps)

    def on_counts(self, c: Counts) -> None:
        self.running.set(c.running)
        self.waiting.set(c.waiting)
        self.partial.set(c.partial_prefills)
        self.kv_blocks.labels("used").set(c.kv_used_blocks)
        self.kv_blocks.labels("free").set(c.kv_free_blocks)
        self.kv_blocks.labels("cached").set(c.kv_cached_blocks)
        self.gie_waiting.set(c.waiting)
        self.gie_running.set(c.running)
        total = c.kv_used_blocks + c.kv_free_blocks
        for gauge in self.gie_kv:
            gauge.set(c.kv_used_blocks / total if total else 0.0)

    def on_admission(self, verdict: str) -> None:
        """A request judged at admission (one of ``ADMISSION_VERDICTS``)."""
        self.admission.labels(verdict).inc()

    def on_error(self, code: str) -> None:
        self.errors.labels(code).inc()

    def on_cut_off(self, request_id: str) -> None:
        self.slow_consumers.inc()

    def on_replicas(self, stats: list[ReplicaStats]) -> None:
        names = {s.replica for s in stats}
        for gone in self._replicas - names:
            self.replica_kv.remove(gone)
            for state in ("running", "waiting"):
                self.replica_requests.remove(gone, state)
        self._replicas = names
        for s in stats:
            self.replica_requests.labels(s.replica, "running").set(s.running)
            self.replica_requests.labels(s.replica, "waiting").set(s.waiting)
            self.replica_kv.labels(s.replica).set(s.kv_utilization)
        self.replicas_reporting.set(len(stats))

    def on_tokens(self, emitted: list[Emitted]) -> None:
        self.generation_tokens.inc(sum(len(e.token_ids) for e in emitted))
        for e in emitted:
            if e.gap_ns is not None:
                self.itl.observe(e.gap_ns / 1e9)
                # tokens of one iteration arrive together; the first carries the gap
                for _ in range(len(e.token_ids) - 1):
                    self.itl.observe(0.0)

    def on_finish(self, req: Request, end: RequestEnd) -> None:
        tl = end.timeline
        timings = request_timings(tl)
        judged = goodness(end, timings)
        self.finished.labels(end.reason).inc()
        self.good.inc(judged.good)
        self.target_met.labels("ttft").inc(judged.ttft_met)
        self.target_met.labels("tbt").inc(judged.tbt_met)
        self.prompt_tokens.inc(req.num_prompt_tokens)
        self.prefix_hit_tokens.inc(end.num_cached_tokens)
        if end.reason == FinishReason.ABORT:
            self.aborts.inc()
        if tl.finished_ns is None:
            return
        scheduled = tl.scheduled_ns if tl.scheduled_ns is not None else tl.finished_ns
        self.queue_wait.observe((scheduled - tl.arrival_ns) / 1e9)
        self.scheduling_delay.observe(timings.scheduling_delay_ms / 1e3)
        self.e2e.observe((tl.finished_ns - tl.arrival_ns) / 1e9)
        if tl.first_token_ns is not None:
            self.ttft.observe((tl.first_token_ns - tl.arrival_ns) / 1e9)
            self.prefill.observe((tl.first_token_ns - scheduled) / 1e9)
            self.decode.observe((tl.finished_ns - tl.first_token_ns) / 1e9)
            self.max_gap.observe(timings.max_gap_ms / 1e3)

    def render(self) -> bytes:
        return generate_latest(self.registry)
