"""The step loop's stand-in at the gateway when engines run on Ray replicas.

``EngineClient`` drives it exactly as it drives ``StepLoop``: ``submit``,
``abort``, ``reconfigure``, ``snapshot``. A request goes to a replica by one
call (``submit``, placed by the router); its outputs come back over that
replica's feed, which this process opens once per replica and which carries
one message per iteration for all of its requests there, handed to the
client's fan-out as the step thread's output would be.

A replica that dies takes its feed down: its requests that had no token yet
are submitted again (to another replica), the others end with an error.

Disaggregated (a ``prefill`` handle too): a request's prompt is computed on
a prefill replica first (``EngineReplica.prefill``), whose ``Handoff``
(a ticket for the KV, not the KV) goes with the request to a decode replica.
The choices of one prompt (n > 1) share that prefill and each import its KV.
A prefill replica that dies is replaced by another for the same prompt; KV
that can no longer be fetched (its prefill replica died since) is computed
again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

import structlog
from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from stallfree.core.cluster.stats import ReplicaStats
from stallfree.core.sched.engine import Counts, EngineSnapshot, RequestOutput, StepOutput
from stallfree.core.sched.request import FinishReason, Request, RequestStatus
from stallfree.gateway.engine.backend import EngineListener
from stallfree.scaleout.board import BOARD, PREFILL_BOARD
from stallfree.scaleout.clock import shift, wall_offset_ns
from stallfree.scaleout.spec import Abort, Feed, FeedMessage, Handoff, Job, ReplicaSpec

log = structlog.get_logger(__name__)

RETRIES = 2  # submissions again of a request whose replica died before its first token
PUBLISH_PERIOD_S = 0.2  # replicas' iterations and counts to the observers; feeds opened


def _done(value: Any) -> Future[Any]:
    f: Future[Any] = Future()
    f.set_result(value)
    return f


@dataclass(slots=True)
class _Prefill:
    """A prompt being computed on a prefill replica, for its choices to take over."""

    task: asyncio.Task[Handoff]
    choices: set[str]


@dataclass(slots=True)
class _InFlight:
    request: Request  # as this process has it: arrival_ns is when the client's request came in
    replica: str | None = None  # where it was accepted
    tokens: int = 0
    attempts: int = 0
    cancelled: bool = False
    prefill: _Prefill | None = None  # disaggregated: its KV, until its first token


class RemoteEngine:
    def __init__(
        self,
        handle: DeploymentHandle,
        spec: ReplicaSpec,
        replicas: int,
        vocab_size: int,
        traceparent: Callable[[str], str | None] = lambda request_id: None,
        prefill: DeploymentHandle | None = None,
    ) -> None:
        self.handle = handle
        self.prefill = prefill  # disaggregated: prompts are computed there first
        self.replicas = replicas  # all of them, prefill ones included
        self.config, self.warnings = spec.scheduler.validated()
        self.config_version = 0
        self.vocab_size = vocab_size
        self.listener: EngineListener | None = None  # given at start
        self.traceparent = traceparent  # the request's root span, which the replica's span joins
        self.ingress = uuid.uuid4().hex  # this gateway, to the replicas
        # iterations run on the replicas, which answer for themselves (``_replica_lost``): this
        # process is never owed an answer the watchdog could wait for
        self.owed_since_ns = 0
        self.busy_predicted_s = 0.0
        self.alive = True
        self._offset = wall_offset_ns()
        self._inflight: dict[str, _InFlight] = {}
        self._feeds: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._publisher: asyncio.Task[None] | None = None

    # -- the EngineBackend surface ------------------------------------------
    def start(self, listener: EngineListener) -> None:
        self.listener = listener
        self._publisher = asyncio.get_running_loop().create_task(self._publish())

    def replica_counts(self) -> tuple[int, int]:
        return self.ready_replicas, self.replicas

    def _on_step(self, out: StepOutput) -> None:
        assert self.listener is not None, "started"
        self.listener.on_step(out)

    def stop(self, timeout: float = 10.0) -> None:
        self.alive = False
        for task in [*self._feeds.values(), *self._tasks, *([self._publisher] if self._publisher else [])]:
            task.cancel()

    @staticmethod
    def _stats() -> list[ReplicaStats]:
        return [*BOARD.stats.values(), *PREFILL_BOARD.stats.values()]

    @property
    def snapshot(self) -> EngineSnapshot:
        stats = self._stats()
        blocks = sum(s.kv_blocks for s in stats)
        size = stats[0].block_size if stats else 16
        return EngineSnapshot(self.config, self.counts(), blocks, size, self.vocab_size, tuple(self.warnings))

    @property
    def ready_replicas(self) -> int:
        """Replicas reporting whose feed is open (prefill replicas have none)."""
        streaming = sum(1 for s in BOARD.stats.values() if s.seq > 0 and s.replica in self._feeds)
        return streaming + sum(1 for s in PREFILL_BOARD.stats.values() if s.seq > 0)

    def counts(self) -> Counts:
        stats = self._stats()
        return Counts(
            sum(s.running for s in stats),
            sum(s.waiting for s in stats),
            sum(s.partial_prefills for s in stats),
            sum(s.kv_used_blocks for s in stats),
            sum(s.kv_free_blocks for s in stats),
            sum(s.kv_cached_blocks for s in stats),
        )

    def submit(self, req: Request) -> Future[None]:
        f = self._inflight[req.request_id] = _InFlight(req)
        if self.prefill is not None and req.num_prompt_tokens > 1:  # (a 1-token prompt has no KV to hand over)
            head = self._inflight.get(req.prefill_after or "")
            f.prefill = head.prefill if head is not None and head.prefill is not None else self._start_prefill(req)
            f.prefill.choices.add(req.request_id)
            req.prefill_after = None  # each choice imports the prompt's KV onto its own blocks
        self._spawn(self._submit(req.request_id))
        return _done(None)

    def abort(self, request_id: str) -> Future[bool]:
        f = self._inflight.get(request_id)
        if f is None:
            return _done(False)
        f.cancelled = True
        if f.replica is not None:  # else: aborted as soon as a replica accepts it
            self._spawn(self._abort(request_id, f.replica))
        elif f.prefill is not None and all(
            c.cancelled for c in (self._inflight.get(rid) for rid in f.prefill.choices) if c is not None
        ):  # nobody waits for that prompt any more
            f.prefill.task.cancel()
        return _done(True)

    def reconfigure(self, changes: dict[str, Any]) -> Future[list[str]]:
        self.config, warnings = self.config.with_changes(changes)
        self.config_version += 1  # each replica applies it before its next request
        return _done(warnings)

    def ping(self) -> Future[None]:
        """Answered here: replicas report on their own (``replica_counts``)."""
        return _done(None)

    # -- requests ------------------------------------------------------------
    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start_prefill(self, req: Request) -> _Prefill:
        return _Prefill(asyncio.get_running_loop().create_task(self._prefill(req)), set())

    async def _prefill(self, req: Request) -> Handoff:
        """The prompt's KV computed on a prefill replica (another one if that one dies)."""
        assert self.prefill is not None
        head = Request(req.request_id, req.prompt_token_ids, req.sampling, req.arrival_ns, req.priority, req.tenant)
        head.cache_salt = req.cache_salt  # the prefill replica's prefix cache keeps the tenant's scope too
        job = Job(head, self.ingress, self.config, self.config_version, self.traceparent(req.request_id))
        attempts = 0
        while True:
            response = self.prefill.options(method_name="prefill").remote(job)
            try:
                handoff: Handoff = await response
                return handoff
            except asyncio.CancelledError:
                response.cancel()  # its KV freed there
                raise
            except (RayActorError, DeploymentUnavailableError) as exc:
                if attempts >= RETRIES:
                    raise
                attempts += 1
                log.warning("prefill_replica_lost_retrying", request_id=req.request_id, error=repr(exc))
                await asyncio.sleep(0.2 * attempts)

    async def _submit(self, request_id: str) -> None:
        f = self._inflight[request_id]
        job = Job(f.request, self.ingress, self.config, self.config_version, self.traceparent(request_id))
        if f.prefill is not None:
            try:
                job.kv = await asyncio.shield(f.prefill.task)
            except asyncio.CancelledError:
                if not f.prefill.task.cancelled():
                    raise  # this process is stopping
                return self._end(request_id, FinishReason.ABORT, "cancelled while its prompt was computed")
            except Exception as exc:
                return self._end(request_id, FinishReason.ERROR, f"its prompt's prefill failed: {exc!r}")
            if f.cancelled:
                return self._end(request_id, FinishReason.ABORT, "cancelled while its prompt was computed")
        while True:
            try:
                f.replica = await self.handle.options(method_name="submit").remote(job)
                break
            except (RayActorError, DeploymentUnavailableError) as exc:
                if f.attempts >= RETRIES:
                    return self._end(request_id, FinishReason.ERROR, f"no replica took it: {exc!r}")
                f.attempts += 1
                await asyncio.sleep(0.2 * f.attempts)
            except Exception as exc:
                if job.kv is not None and f.attempts < RETRIES:  # its KV is gone with its prefill replica
                    f.attempts += 1
                    log.warning("kv_lost_computing_again", request_id=request_id, error=repr(exc))
                    f.prefill = self._start_prefill(f.request)
                    f.prefill.choices.add(request_id)
                    return await self._submit(request_id)
                # refused there (a bug: the checks here passed)
                return self._end(request_id, FinishReason.ERROR, f"the replica refused it: {exc!r}")
        if f.cancelled:
            await self._abort(request_id, f.replica)

    async def _abort(self, request_id: str, replica: str) -> None:
        try:
            await self.handle.options(method_name="abort").remote(Abort(request_id, replica))
        except Exception as exc:  # the replica is gone: its feed's end settles the request
            log.warning("abort_failed", request_id=request_id, replica=replica, error=repr(exc))

    def _end(self, request_id: str, reason: FinishReason, why: str) -> None:
        """The request ends here, not on a replica (its replica failed)."""
        f = self._inflight.pop(request_id, None)
        if f is None:
            return
        if reason == FinishReason.ERROR:
            log.error("replica_request_failed", request_id=request_id, tokens=f.tokens, reason=why)
        req = f.request
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        req.timeline.finished_ns = time.perf_counter_ns()
        self._on_step(StepOutput(None, [RequestOutput(request_id, [], reason, req.end())], self.counts()))

    # -- feeds -----------------------------------------------------------------
    async def _feed(self, replica: str) -> None:
        try:
            stream = cast(
                DeploymentResponseGenerator[FeedMessage],
                self.handle.options(stream=True, method_name="feed").remote(Feed(self.ingress, replica)),
            )
            async for message in stream:
                for outputs, emit_wall_ns in message:
                    self._deliver(outputs, emit_wall_ns - self._offset)
            reason = "its feed ended"
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = repr(exc)
        finally:
            self._feeds.pop(replica, None)
        self._replica_lost(replica, reason)

    def _deliver(self, outputs: list[RequestOutput], emit_ns: int) -> None:
        known = []
        for out in outputs:
            f = self._inflight.get(out.request_id)
            if f is None:
                continue
            f.tokens += len(out.new_token_ids)
            if f.tokens:
                f.prefill = None  # its KV, kept for a retry until now, can go
            if out.finish_reason is not None:
                del self._inflight[out.request_id]
                if out.end is not None:  # its timeline onto this process's clock
                    tl = out.end.timeline
                    shift(tl, -self._offset)
                    tl.arrival_ns = f.request.arrival_ns  # the client's wait includes the hop
            known.append(out)
        if known:
            self._on_step(StepOutput(None, known, self.counts(), emit_ns))

    def _replica_lost(self, replica: str, reason: str) -> None:
        log.warning("replica_lost", replica=replica, reason=reason)
        BOARD.forget(replica)
        for request_id, f in list(self._inflight.items()):
            if f.replica != replica:
                continue
            if f.tokens == 0 and not f.cancelled and f.attempts < RETRIES:
                f.replica, f.attempts = None, f.attempts + 1
                log.warning("replica_lost_retrying", request_id=request_id, attempt=f.attempts)
                self._spawn(self._submit(request_id))
            else:
                self._end(request_id, FinishReason.ERROR, f"replica {replica} lost: {reason}")

    async def _ping(self, handle: DeploymentHandle) -> None:
        try:
            await handle.options(method_name="ping").remote()
        except Exception as exc:
            log.warning("replicas_unreachable", error=repr(exc))

    # -- the replicas' reports -------------------------------------------------
    async def _publish(self) -> None:
        while True:
            # Serve starts a handle's router, which posts the reports, on its first call
            if not BOARD.stats:
                self._spawn(self._ping(self.handle))
            if self.prefill is not None and not PREFILL_BOARD.stats:
                self._spawn(self._ping(self.prefill))
            for replica in BOARD.stats:
                if replica not in self._feeds:
                    self._feeds[replica] = asyncio.get_running_loop().create_task(self._feed(replica))
            for replica in set(self._feeds) - set(BOARD.stats):  # gone without its feed noticing
                self._feeds.pop(replica).cancel()
                self._replica_lost(replica, "no longer reported")
            iterations = BOARD.iterations + PREFILL_BOARD.iterations
            BOARD.iterations, PREFILL_BOARD.iterations = [], []
            counts = self.counts()
            for _, it in iterations:
                it = dataclasses.replace(it, start_ns=it.start_ns - self._offset, end_ns=it.end_ns - self._offset)
                self._on_step(StepOutput(it, [], counts))
            assert self.listener is not None
            self.listener.on_replicas(sorted(self._stats(), key=lambda s: s.replica))
            await asyncio.sleep(PUBLISH_PERIOD_S)
