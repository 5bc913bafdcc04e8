"""One engine replica: the engine and its step thread inside a Ray Serve replica.

``generate`` is a streaming method: one message per iteration that produced
something for the request (a ``RequestOutput``: that iteration's token, or
the finish), never one per token. When the ingress cancels the stream (the
client left, or asked to cancel), the generator is cancelled here and the
request is aborted in the engine, which frees its KV blocks.

Serve calls ``record_routing_stats`` periodically: the router's view of this
replica (``ReplicaStats``) plus the iterations since the last call, which the
ingress feeds to its metrics and dashboard.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from typing import Any

import structlog

from core.cluster.stats import engine_stats
from core.sched.batch import IterationRecord
from core.sched.engine import Engine, RequestOutput, StepOutput
from core.sched.request import Timeline
from core.sched.step_loop import StepLoop
from scaleout.clock import shift, wall_offset_ns
from scaleout.spec import Job, ReplicaSpec

log = structlog.get_logger(__name__)


def build(spec: ReplicaSpec) -> Engine:
    if spec.sim:
        from core.build import build_sim_engine

        engine, _ = build_sim_engine(
            spec.scheduler, None, spec.kv_cache_gib, time_scale=spec.sim_time_scale, read_context=False
        )
        return engine
    from core.build import ModelSettings, build_engine

    settings = ModelSettings(spec.model, spec.dtype, spec.device, spec.threads, spec.kv_cache_gib)
    engine, _ = build_engine(settings, spec.scheduler)
    return engine


class EngineReplica:
    def __init__(self, spec: ReplicaSpec) -> None:
        from ray import serve
        from ray.serve.exceptions import RayServeException

        try:
            self.name = serve.get_replica_context().replica_id.unique_id
        except RayServeException:  # constructed outside Serve
            self.name = "local"
        self.engine = build(spec)
        self.wall_offset = wall_offset_ns()
        self.config_version = 0
        self.fatal: str | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._iterations: collections.deque[IterationRecord] = collections.deque(maxlen=2048)
        self._reports = 0
        self._aio: asyncio.AbstractEventLoop | None = None
        self.step_loop = StepLoop(self.engine, self._on_step, self._on_fatal)
        self.step_loop.start()
        log.info("replica_started", replica=self.name, kv_blocks=self.engine.kv.num_blocks)

    # -- requests (the replica's event loop) --------------------------------
    async def generate(self, job: Job) -> AsyncIterator[RequestOutput]:
        self._aio = asyncio.get_running_loop()
        if job.config_version > self.config_version:
            self.config_version = job.config_version
            await asyncio.wrap_future(self.step_loop.call(lambda: self._set_config(job)))
        req = job.request
        req.arrival_ns = time.perf_counter_ns()  # this replica's clock; the ingress restores its own arrival
        req.timeline = Timeline(arrival_ns=req.arrival_ns)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[req.request_id] = queue
        finished = False
        try:
            await asyncio.wrap_future(self.step_loop.submit(req))
            while True:
                out = await queue.get()
                if out.request is not None:
                    shift(out.request.timeline, self.wall_offset)  # onto the wall clock for the trip
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(req.request_id, None)
            if not finished:  # cancelled across the hop: free its KV here
                self.step_loop.abort(req.request_id)

    def _set_config(self, job: Job) -> None:
        self.engine.scheduler.config = job.config
        self.step_loop.snapshot = self.engine.snapshot()

    # -- step thread -> replica event loop ----------------------------------
    def _on_step(self, out: StepOutput) -> None:
        if out.iteration is not None:
            self._iterations.append(out.iteration)
        if self._aio is not None and not self._aio.is_closed():
            self._aio.call_soon_threadsafe(self._fan_out, out.outputs)

    def _fan_out(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            queue = self._queues.get(o.request_id)
            if queue is not None:
                queue.put_nowait(o)

    def _on_fatal(self, reason: str) -> None:
        self.fatal = reason  # check_health fails: Serve replaces this replica

    # -- Serve's hooks -------------------------------------------------------
    async def record_routing_stats(self) -> dict[str, Any]:
        self._reports += 1
        seq = self._reports
        stats = await asyncio.wrap_future(self.step_loop.call(lambda: engine_stats(self.name, self.engine, seq)))
        iterations = list(self._iterations)
        self._iterations.clear()
        for it in iterations:  # onto the wall clock, as timelines are
            it.start_ns += self.wall_offset
            it.end_ns += self.wall_offset
        return {"stats": stats, "iterations": iterations, "kv_used_blocks": self.engine.kv.num_used_blocks}

    def check_health(self) -> None:
        if self.fatal is not None or not self.step_loop.alive:
            raise RuntimeError(f"engine stopped: {self.fatal}")

    def __del__(self) -> None:
        if hasattr(self, "step_loop"):
            self.step_loop.stop(timeout=2.0)
