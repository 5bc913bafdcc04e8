"""The step loop's stand-in at the gateway when engines run on Ray replicas.

``EngineClient`` drives it exactly as it drives ``StepLoop``: ``submit``,
``abort``, ``reconfigure``, ``snapshot``. Each request becomes one task that
streams its replica's per-iteration messages into the client's fan-out. A
replica that dies before the request's first token gets it retried on
another; after that the stream ends with an error. Cancelling a request
cancels its stream, which aborts it on the replica (KV freed there).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, cast

import structlog
from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from core.cluster.stats import ReplicaStats
from core.sched.engine import Counts, EngineSnapshot, RequestOutput, StepOutput, check_request
from core.sched.request import FinishReason, Request, RequestStatus
from scaleout.board import BOARD
from scaleout.clock import shift, wall_offset_ns
from scaleout.spec import Job, ReplicaSpec

log = structlog.get_logger(__name__)

RETRIES = 2  # replicas tried again for a request whose replica died before its first token
PUBLISH_PERIOD_S = 0.2  # replicas' iterations and counts to the observers


def _done(value: Any) -> Future[Any]:
    f: Future[Any] = Future()
    f.set_result(value)
    return f


class RemoteEngine:
    def __init__(
        self,
        handle: DeploymentHandle,
        spec: ReplicaSpec,
        replicas: int,
        vocab_size: int,
        on_step: Callable[[StepOutput], None],
        on_replicas: Callable[[list[ReplicaStats]], None],
    ) -> None:
        self.handle = handle.options(stream=True, method_name="generate")
        self.replicas = replicas
        self.config, self.warnings = spec.scheduler.validated()
        self.config_version = 0
        self.vocab_size = vocab_size
        self.on_step = on_step
        self.on_replicas = on_replicas
        self.last_step_ns = 0
        self.busy_since_ns = 0  # iterations run on the replicas; none ever hangs this process
        self.alive = True
        self._offset = wall_offset_ns()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._publisher: asyncio.Task[None] | None = None

    # -- the StepLoop surface ----------------------------------------------
    def start(self) -> None:
        self._publisher = asyncio.get_running_loop().create_task(self._publish())

    def stop(self, timeout: float = 10.0) -> None:
        self.alive = False
        for task in [*self._tasks.values(), *([self._publisher] if self._publisher else [])]:
            task.cancel()

    @property
    def snapshot(self) -> EngineSnapshot:
        stats = list(BOARD.stats.values())
        blocks = sum(s.kv_blocks for s in stats)
        size = stats[0].block_size if stats else 16
        return EngineSnapshot(self.config, self.counts(), blocks, size, self.vocab_size, tuple(self.warnings))

    @property
    def ready_replicas(self) -> int:
        return sum(1 for s in BOARD.stats.values() if s.seq > 0)

    def counts(self) -> Counts:
        stats = list(BOARD.stats.values())
        return Counts(
            sum(s.running for s in stats),
            sum(s.waiting for s in stats),
            sum(s.partial_prefills for s in stats),
            sum(BOARD.kv_used.get(s.replica, 0) for s in stats),
            sum(s.kv_free_blocks for s in stats),
            sum(s.kv_cached_blocks for s in stats),
        )

    def submit(self, req: Request) -> Future[None]:
        check_request(req.num_prompt_tokens, req.sampling, self.config.max_model_len, self.vocab_size)
        self._tasks[req.request_id] = asyncio.get_running_loop().create_task(self._stream(req))
        return _done(None)

    def abort(self, request_id: str) -> Future[bool]:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()
        return _done(task is not None)

    def reconfigure(self, changes: dict[str, Any]) -> Future[list[str]]:
        self.config, warnings = self.config.with_changes(changes)
        self.config_version += 1  # each replica applies it before its next request
        return _done(warnings)

    # -- one request ---------------------------------------------------------
    async def _stream(self, req: Request) -> None:
        arrival = req.arrival_ns
        job = Job(req, self.config, self.config_version)
        tokens = 0
        stream: DeploymentResponseGenerator[RequestOutput] | None = None
        try:
            for attempt in range(RETRIES + 1):
                try:
                    stream = cast(DeploymentResponseGenerator, self.handle.remote(job))
                    async for out in stream:
                        tokens += len(out.new_token_ids)
                        self._deliver(out, arrival)
                        if out.finish_reason is not None:
                            return
                    raise RuntimeError("the replica's stream ended without a finish")
                except (RayActorError, DeploymentUnavailableError) as exc:
                    if tokens or attempt == RETRIES:
                        raise
                    log.warning(
                        "replica_lost_retrying", request_id=req.request_id, attempt=attempt + 1, error=repr(exc)
                    )
                    await asyncio.sleep(0.2 * (attempt + 1))
        except asyncio.CancelledError:
            if stream is not None:
                stream.cancel()  # the replica's generator is cancelled: it aborts the request there
            self._end(req, FinishReason.ABORT)
        except Exception as exc:
            log.error("replica_stream_failed", request_id=req.request_id, tokens=tokens, error=repr(exc))
            self._end(req, FinishReason.ERROR)
        finally:
            self._tasks.pop(req.request_id, None)

    def _deliver(self, out: RequestOutput, arrival_ns: int) -> None:
        if out.request is not None:  # finished: its timeline onto this process's clock
            tl = out.request.timeline
            shift(tl, -self._offset)
            tl.arrival_ns = arrival_ns  # the client's wait includes the hop
        self.last_step_ns = time.perf_counter_ns()
        self.on_step(StepOutput(None, [out], self.counts()))

    def _end(self, req: Request, reason: FinishReason) -> None:
        """The request ends here, not on a replica (cancelled, or its replica failed)."""
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        req.timeline.finished_ns = time.perf_counter_ns()
        self.on_step(StepOutput(None, [RequestOutput(req.request_id, [], reason, req)], self.counts()))

    # -- the replicas' reports -------------------------------------------------
    async def _publish(self) -> None:
        while True:
            await asyncio.sleep(PUBLISH_PERIOD_S)
            iterations, BOARD.iterations = BOARD.iterations, []
            counts = self.counts()
            for _, it in iterations:
                it = dataclasses.replace(it, start_ns=it.start_ns - self._offset, end_ns=it.end_ns - self._offset)
                self.on_step(StepOutput(it, [], counts))
            self.on_replicas(sorted(BOARD.stats.values(), key=lambda s: s.replica))
