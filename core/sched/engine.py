"""The engine: one iteration = schedule, run, update, collect.

Single-threaded and clock-agnostic: the step loop drives it on its own
thread with ``perf_counter_ns``; the simulator drives it with a virtual clock.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from stallfree.core.sched.batch import Batch, IterationRecord, Logprobs, NewToken
from stallfree.core.sched.block_manager import BlockManager
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.cost import Chunks, IterationCost
from stallfree.core.sched.deadline import Forecast
from stallfree.core.sched.drafts import Drafter
from stallfree.core.sched.request import FinishReason, Request, RequestEnd, SamplingParams
from stallfree.core.sched.runner import Runner
from stallfree.core.sched.scheduler import ScheduleFailed, Scheduler

log = structlog.get_logger(__name__)


class RequestRejected(ValueError):
    """A request that can never run, refused before any work is queued."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class RequestOutput:
    """What one request got in one iteration."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    end: RequestEnd | None = None  # set once finished
    stalled: bool = False  # the gap before this token was stalled: another request's prefill ran in it
    logprobs: list[Logprobs] | None = None  # one per new token, when the request asked


@dataclass(slots=True, frozen=True)
class Counts:
    """Queue lengths and KV blocks after a step (gauges stay current without iterations)."""

    running: int
    waiting: int
    partial_prefills: int
    kv_used_blocks: int
    kv_free_blocks: int
    kv_cached_blocks: int
    forecast: Forecast | None = None  # the queue as admission reads it (None: no pace known yet)


@dataclass(slots=True, frozen=True)
class EngineSnapshot:
    """What other threads may read of the engine: its settings and KV counts
    as the step thread last published them (never the live objects)."""

    config: SchedulerConfig
    counts: Counts
    kv_blocks: int
    kv_block_size: int
    vocab_size: int
    warnings: tuple[str, ...]  # start-up clamps of the settings


@dataclass(slots=True)
class StepOutput:
    iteration: IterationRecord | None  # None when only aborts or failures are reported
    outputs: list[RequestOutput]
    counts: Counts
    emit_ns: int | None = None  # when the outputs were produced, if not by ``iteration`` here (a replica's)


def check_request(num_prompt_tokens: int, sampling: SamplingParams, max_model_len: int, vocab_size: int) -> None:
    """Refuse what can never run (``RequestRejected``, or ValueError naming a
    sampling field). The gateway's ``EngineClient`` calls it, once, before a
    request goes to any engine: the engine runs what it is given."""
    sampling.validate()
    if sampling.top_k > vocab_size:
        raise RequestRejected("invalid_request", f"top_k must be at most the vocabulary size ({vocab_size})")
    if any(not 0 <= token < vocab_size for token, _ in sampling.logit_bias):
        raise RequestRejected("invalid_request", f"logit_bias keys must be token ids in [0, {vocab_size})")
    if num_prompt_tokens < 1:
        raise RequestRejected("invalid_request", "prompt is empty")
    if num_prompt_tokens >= max_model_len:
        raise RequestRejected(
            "prompt_too_long", f"prompt has {num_prompt_tokens} tokens; the context limit is {max_model_len}"
        )


class Engine:
    MAX_FAILED_ITERATIONS = 5  # failed iterations in a row after which the engine is broken

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        runner: Runner,
        clock: Callable[[], int] = time.perf_counter_ns,
        cost: IterationCost | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        """``cost`` predicts each iteration's time (recorded beside the measured
        one, which it then observes); the TBT target and dynamic chunking need
        it, and draft tokens are weighed with it. ``drafter``: where draft
        tokens come from when the config speculates (default: prompt lookup)."""
        config, self.warnings = scheduler_config.validated()
        _check_cost(config, cost)
        if config.max_model_len > cache_config.num_tokens:
            # one sequence of the full context must fit, or a lone request could never grow
            self.warnings.append(
                f"max_model_len {config.max_model_len} exceeds the KV cache ({cache_config.num_tokens} tokens); "
                f"clamped to {cache_config.num_tokens}"
            )
            config = dataclasses.replace(config, max_model_len=cache_config.num_tokens)
        self.kv = BlockManager(cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv, runner.eos_token_ids, cost, drafter)
        self.cost = cost
        self.runner = runner
        self.clock = clock
        self._unreported: list[Request] = []  # finished outside an iteration (aborts, failures)
        self.failed_in_a_row = 0
        self.broken: str | None = None  # why the engine cannot go on, once it cannot
        # told each batch's predicted time before it runs (the step loop publishes it for the watchdog)
        self.scheduled: Callable[[float], None] | None = None

    @property
    def config(self) -> SchedulerConfig:
        return self.scheduler.config

    def snapshot(self, counts: Counts | None = None) -> EngineSnapshot:
        """What other threads may read; ``counts``: a step's own, when just taken."""
        kv, warnings = self.kv, tuple(self.warnings)
        counts = counts or self.counts()
        return EngineSnapshot(self.config, counts, kv.num_blocks, kv.block_size, self.runner.vocab_size, warnings)

    # -- requests ----------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue req, which its caller has checked (``check_request``)."""
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> bool:
        req = self.scheduler.abort(request_id, self.clock())
        if req is not None:
            self._unreported.append(req)
        return req is not None

    def reconfigure(self, changes: dict[str, Any]) -> list[str]:
        """Apply live settings between iterations; returns warnings (clamps)."""
        config, warnings = self.config.with_changes(changes)
        _check_cost(config, self.cost)
        self.scheduler.config = config
        return warnings

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._unreported)

    # -- the iteration -----------------------------------------------------
    def step(self) -> StepOutput | None:
        """One iteration. Whatever raises in it (scheduler, block manager,
        runner, sampler, update) fails only the requests it touched; two
        failed iterations in a row also fail everything queued (a request
        that breaks every schedule goes with them); ``MAX_FAILED_ITERATIONS``
        in a row mean the engine cannot go on: ``broken`` says why."""
        start_ns = self.clock()
        batch: Batch | None = None
        try:
            batch = self.scheduler.schedule(start_ns)
            if self.scheduled is not None:
                self.scheduled(batch.predicted_s)
            self._prepare(batch)
            if not batch.items:
                return self._collect(None, [])
            shape = batch.shape()
            sampled = self.runner.execute(batch)
            self._export(batch)
            end_ns = self.clock()
            emitted = self.scheduler.update(batch, sampled, start_ns, end_ns)
        except Exception as exc:
            self._failed(exc.batch if isinstance(exc, ScheduleFailed) else batch, exc)
            return self._collect(None, [])
        self.failed_in_a_row = 0
        if self.cost is not None:
            self.cost.observe(*shape, (end_ns - start_ns) / 1e9)
        return self._collect(self._record(batch, shape, start_ns, end_ns, emitted), emitted)

    def _prepare(self, batch: Batch) -> None:
        """What the runner does before any batch's items run, whichever runner it is."""
        self.runner.release(batch.finished)
        self.runner.copy_blocks(batch.copies)
        for kv in batch.imports:
            self.runner.import_kv(kv.block_ids, kv.num_tokens, kv.payload)

    def _export(self, batch: Batch) -> None:
        """The KV of prompts just computed whose requests asked for it (``KvHandoff.export``),
        before they finish and free their blocks."""
        for item in batch.items:
            req = item.request
            h = req.handoff
            if h is not None and h.export and h.payload is None and item.samples and not req.num_output_tokens:
                h.payload = self.runner.export_kv(req.block_ids, req.num_prompt_tokens - 1)

    def _failed(self, batch: Batch | None, exc: Exception) -> None:
        self.failed_in_a_row += 1
        if batch is not None:
            self.runner.release(batch.finished)  # again if it already was: the runner's state must not outlive them
        touched = [item.request for item in batch.items] if batch is not None else []
        log.error(
            "iteration_failed",
            iteration=batch.iteration if batch is not None else None,
            requests=len(touched),
            failed_in_a_row=self.failed_in_a_row,
            exc_info=exc,
        )
        if self.failed_in_a_row >= 2:
            touched += [*self.scheduler.waiting, *self.scheduler.running]
        if self.failed_in_a_row >= self.MAX_FAILED_ITERATIONS:
            self.broken = f"{self.failed_in_a_row} iterations in a row failed; last: {exc!r}"
        self.fail(touched)

    def fail(self, requests: list[Request]) -> None:
        """End requests with an error (KV freed) and report each once, however
        far its iteration got (update may already have finished it)."""
        now_ns = self.clock()
        seen = set()
        for req in requests:
            if req.request_id in seen:
                continue
            seen.add(req.request_id)
            self.scheduler.finish(req, FinishReason.ERROR, now_ns)
            self._unreported.append(req)

    def fail_all(self) -> None:
        """Every queued request ends with an error: the engine is shutting down broken."""
        self.fail([*self.scheduler.waiting, *self.scheduler.running])

    def step_output_of_failures(self) -> StepOutput | None:
        """Report what ended outside an iteration (after ``fail_all``), without iterating."""
        return self._collect(None, [])

    def _collect(self, record: IterationRecord | None, emitted: list[NewToken]) -> StepOutput | None:
        outputs: list[RequestOutput] = []
        for new in emitted:  # a speculating request's tokens come one after another: one output
            req, reason = new.request, new.request.finish_reason
            last = outputs[-1] if outputs and outputs[-1].request_id == req.request_id else None
            if last is not None:
                last.new_token_ids.append(new.token)
                if last.logprobs is not None and new.logprobs is not None:
                    last.logprobs.append(new.logprobs)
                continue
            end = req.end() if reason is not None else None
            logprobs = [new.logprobs] if new.logprobs is not None else None
            outputs.append(RequestOutput(req.request_id, [new.token], reason, end, new.stalled, logprobs))
        outputs += [RequestOutput(r.request_id, [], r.finish_reason, r.end()) for r in self._unreported]
        self._unreported = []
        if record is None and not outputs:
            return None
        return StepOutput(record, outputs, self.counts())

    def counts(self) -> Counts:
        s, kv = self.scheduler, self.kv
        return Counts(
            len(s.running),
            len(s.waiting),
            s.num_partial_prefills,
            kv.num_used_blocks,
            kv.num_free_blocks,
            kv.num_cached_blocks,
            s.forecast(self.clock()),
        )

    def _record(
        self, batch: Batch, shape: tuple[list[int], Chunks], start_ns: int, end_ns: int, emitted: list[NewToken]
    ) -> IterationRecord:
        s = self.scheduler
        target_ns = int(batch.target_s * 1e9)
        missed = (batch.over_target or "prediction") if target_ns and end_ns - start_ns > target_ns else None
        contexts, chunks = shape
        return IterationRecord(
            iteration=batch.iteration,
            start_ns=start_ns,
            end_ns=end_ns,
            decode_tokens=batch.decode_tokens,
            prefill_tokens=batch.prefill_tokens,
            chunks={i.request.request_id: i.num_tokens for i in batch.items if i.is_prefill},
            request_ids=[i.request.request_id for i in batch.items],
            token_budget=s.config.token_budget,
            chunking=s.config.chunking,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_partial_prefills=s.num_partial_prefills,
            kv_used_blocks=self.kv.num_used_blocks,
            kv_free_blocks=self.kv.num_free_blocks,
            kv_cached_blocks=self.kv.num_cached_blocks,
            preemptions=len(batch.preempted) + len(batch.yielded),
            draft_tokens=batch.draft_tokens,
            accepted_tokens=sum(new.draft for new in emitted),
            drafts_declined=batch.drafts_declined,
            tbt_slo_ms=s.config.tbt_slo_ms,
            tbt_aim=s.aim.value,
            predicted_ns=int(batch.predicted_s * 1e9),
            decode_context_tokens=sum(contexts),
            chunk_prefix_tokens=sum(prefix for prefix, _ in chunks),
            correction=self.cost.correction(bool(batch.prefill_tokens)) if self.cost is not None else 1.0,
            target_missed=missed,
        )


def _check_cost(config: SchedulerConfig, cost: IterationCost | None) -> None:
    for name in ("tbt_slo_ms", "ttft_slo_ms"):
        if getattr(config, name) and cost is None:
            raise ValueError(f"{name} needs a cost model (this engine was built without one)")
