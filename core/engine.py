"""The engine: one iteration = schedule, run, update, collect.

Single-threaded and clock-agnostic: the step loop drives it on its own
thread with ``perf_counter_ns``; the simulator drives it with a virtual clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from core.batch import Batch, IterationRecord
from core.block_manager import BlockManager
from core.config import CacheConfig, SchedulerConfig
from core.request import Request, RequestStatus, SamplingParams
from core.runner import Runner
from core.scheduler import ChunkLimit, Scheduler

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
    finish_reason: str | None = None  # stop | length | abort | error
    request: Request | None = None  # set once finished: the engine no longer touches it
    stalled: bool = False  # another request's prefill ran since this request's previous token


@dataclass(slots=True)
class StepOutput:
    iteration: IterationRecord | None  # None when only aborts are reported
    outputs: list[RequestOutput]


class Engine:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        runner: Runner,
        clock: Callable[[], int] = time.perf_counter_ns,
        chunk_limit: ChunkLimit | None = None,
    ) -> None:
        config, self.warnings = scheduler_config.validated()
        if config.max_model_len > cache_config.num_tokens:
            # one sequence of the full context must fit, or a lone request could never grow
            self.warnings.append(
                f"max_model_len {config.max_model_len} exceeds the KV cache ({cache_config.num_tokens} tokens); "
                f"clamped to {cache_config.num_tokens}"
            )
            config.max_model_len = cache_config.num_tokens
        self.kv = BlockManager(cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv, runner.eos_token_ids, chunk_limit)
        self.runner = runner
        self.clock = clock
        self._unreported: list[Request] = []  # finished outside an iteration (aborts)

    @property
    def config(self) -> SchedulerConfig:
        return self.scheduler.config

    # -- requests ----------------------------------------------------------
    def check(self, num_prompt_tokens: int, sampling: SamplingParams) -> None:
        """Refuse what can never run. Reads only fixed settings: safe from any thread."""
        sampling.validate()
        limit = self.config.max_model_len
        if num_prompt_tokens < 1:
            raise RequestRejected("invalid_request", "prompt is empty")
        if num_prompt_tokens >= limit:
            raise RequestRejected(
                "prompt_too_long", f"prompt has {num_prompt_tokens} tokens; the context limit is {limit}"
            )

    def add_request(self, req: Request) -> None:
        self.check(req.num_prompt_tokens, req.sampling)
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> bool:
        req = self.scheduler.abort(request_id, self.clock())
        if req is not None:
            self._unreported.append(req)
        return req is not None

    def reconfigure(self, changes: dict[str, Any]) -> list[str]:
        """Apply live settings between iterations; returns warnings (clamps)."""
        config, warnings = self.config.with_changes(changes)
        self.scheduler.config = config
        return warnings

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._unreported)

    # -- the iteration -----------------------------------------------------
    def step(self) -> StepOutput | None:
        start_ns = self.clock()
        batch = self.scheduler.schedule(start_ns)
        if not batch.items:
            return self._collect(None, [])
        try:
            sampled = self.runner.execute(batch)
        except Exception:
            # the batch's requests fail; everybody else carries on
            log.exception("runner_failed", iteration=batch.iteration, requests=len(batch.items))
            end_ns = self.clock()
            for item in batch.items:
                self.scheduler.finish(item.request, RequestStatus.FINISHED_ERROR, end_ns)
                self._unreported.append(item.request)
            return self._collect(None, [])
        end_ns = self.clock()
        emitted = self.scheduler.update(batch, sampled, start_ns, end_ns)
        return self._collect(self._record(batch, start_ns, end_ns), emitted)

    def _collect(self, record: IterationRecord | None, emitted: list[tuple[Request, int, bool]]) -> StepOutput | None:
        outputs = []
        for req, token, stalled in emitted:
            done = req.status.finished
            outputs.append(RequestOutput(req.request_id, [token], req.finish_reason, req if done else None, stalled))
        outputs += [RequestOutput(r.request_id, [], r.finish_reason, r) for r in self._unreported]
        self._unreported = []
        if record is None and not outputs:
            return None
        return StepOutput(record, outputs)

    def _record(self, batch: Batch, start_ns: int, end_ns: int) -> IterationRecord:
        s = self.scheduler
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
            preemptions=len(batch.preempted),
        )
