"""One engine replica: the engine and its step thread inside a Ray Serve replica.

An ingress (the gateway) opens one ``feed`` per replica: a stream carrying,
per iteration, every output of its requests there (``RequestOutput``s: that
iteration's tokens, or finishes), with the wall-clock time the iteration
ended: one message per iteration, never one per token or per request.
Requests come in by ``submit`` and leave early by ``abort`` (KV freed here);
a feed that closes (the ingress went away) aborts its requests.

Disaggregated serving uses two pools of these. A prefill replica's
``prefill`` computes a prompt, exports its KV and returns a ``Handoff``
(the transport's ticket, not the KV); a decode replica's ``submit`` with a
handoff fetches the KV, writes it into fresh blocks and decodes from there.

With an OTLP endpoint in its environment, a replica adds one
``engine.replica`` span per request under the request's root span (its
traceparent comes with the request), so a trace shows where it ran.

Serve calls ``record_routing_stats`` periodically: the router's view of this
replica (``ReplicaStats``) plus the iterations since the last call, which the
ingress feeds to its metrics and dashboard.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import structlog

from stallfree.core.cluster.stats import engine_stats
from stallfree.core.sched.batch import IterationRecord
from stallfree.core.sched.engine import Engine, RequestOutput, StepOutput
from stallfree.core.sched.handoff import KvHandoff
from stallfree.core.sched.request import Request, SamplingParams, Timeline
from stallfree.core.sched.step_loop import StepLoop, on_own_thread
from stallfree.core.sched.timings import request_timings
from stallfree.scaleout.clock import shift, wall_offset_ns
from stallfree.scaleout.spec import Abort, Feed, FeedMessage, Handoff, Job, ReplicaSpec
from stallfree.scaleout.transfer import KvTransport, ObjectStoreTransport

log = structlog.get_logger(__name__)


def replica_tracer() -> Any:
    """A tracer exporting where the gateway's does (the OTEL_* variables), or None."""
    from stallfree.gateway.observe.tracing import exporter_from_env

    exporter = exporter_from_env()
    if exporter is None:
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    service = os.environ.get("OTEL_SERVICE_NAME", "stallfree")
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: f"{service}-replica"}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider.get_tracer("stallfree.replica")


def build(spec: ReplicaSpec) -> Engine:
    if spec.sim:
        from stallfree.core.build import build_sim_engine

        engine, _ = build_sim_engine(
            spec.scheduler,
            None,
            spec.kv_cache_gib,
            time_scale=spec.sim_time_scale,
            read_context=spec.sim_read_context,
        )
        return engine
    from stallfree.core.build import ModelSettings, build_engine

    settings = ModelSettings(
        spec.model,
        spec.dtype,
        spec.device,
        spec.threads,
        spec.kv_cache_gib,
        compute=spec.compute,
        kv_dtype=spec.kv_dtype,
    )
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
        self.engine = on_own_thread(lambda: build(spec))  # the step thread's OpenMP team the only one
        self.wall_offset = wall_offset_ns()
        self.config_version = 0
        self.fatal: str | None = None
        self._feeds: dict[str, asyncio.Queue[tuple[list[RequestOutput], int]]] = {}  # by ingress
        self._jobs: dict[str, Job] = {}  # running here, by request id
        self._prefills: dict[str, asyncio.Future[RequestOutput]] = {}  # prompts computed for a decode replica
        self.transport: KvTransport = ObjectStoreTransport()
        self._iterations: collections.deque[IterationRecord] = collections.deque(maxlen=2048)
        self._reports = 0
        self._aio: asyncio.AbstractEventLoop | None = None
        self.tracer = replica_tracer()
        self.step_loop = StepLoop(self.engine)
        self.step_loop.start(self)
        log.info("replica_started", replica=self.name, kv_blocks=self.engine.kv.num_blocks)

    # -- the ingress's calls (the replica's event loop) -----------------------
    async def feed(self, feed: Feed) -> AsyncIterator[FeedMessage]:
        """The ingress's outputs from here on, one message per iteration (or
        what piled up since the last one). When the ingress goes away its
        requests here are aborted."""
        self._aio = asyncio.get_running_loop()
        queue = self._feeds.setdefault(feed.ingress, asyncio.Queue())
        try:
            while True:
                message = [await queue.get()]
                while not queue.empty():
                    message.append(queue.get_nowait())
                yield message
        finally:
            if self._feeds.get(feed.ingress) is queue:  # not replaced by a newer feed of the same ingress
                del self._feeds[feed.ingress]
                for job in [j for j in self._jobs.values() if j.ingress == feed.ingress]:
                    self.step_loop.abort(job.request.request_id)

    async def submit(self, job: Job) -> str:
        """Queue a request; its outputs go to its ingress's feed. Returns this replica's name."""
        self._aio = asyncio.get_running_loop()
        self._feeds.setdefault(job.ingress, asyncio.Queue())
        await self._catch_up(job)
        req = job.request
        if job.kv is not None:  # its prompt's KV, from a prefill replica (raises if that is lost)
            start = time.perf_counter()
            req.handoff = KvHandoff(imported_tokens=job.kv.tokens, payload=await self.transport.receive(job.kv.ticket))
            job.kv_fetch_ms = (time.perf_counter() - start) * 1e3
            job.kv = dataclasses.replace(job.kv, ticket=None)  # not pinning the payload while this decodes
        self._arrived(req)
        self._jobs[req.request_id] = job
        try:
            await asyncio.wrap_future(self.step_loop.submit(req))
        except BaseException:
            self._jobs.pop(req.request_id, None)
            raise
        return self.name

    async def prefill(self, job: Job) -> Handoff:
        """Compute the prompt here, export its KV and hand it off (a decode
        replica samples the first token). Cancelling the call aborts it."""
        self._aio = asyncio.get_running_loop()
        await self._catch_up(job)
        req = job.request
        req.sampling, req.handoff = SamplingParams(max_tokens=1, ignore_eos=True), KvHandoff(export=True)
        self._arrived(req)
        done = self._prefills[req.request_id] = self._aio.create_future()
        try:
            await asyncio.wrap_future(self.step_loop.submit(req))
            out = await done
        except asyncio.CancelledError:
            self.step_loop.abort(req.request_id)
            raise
        finally:
            self._prefills.pop(req.request_id, None)
        payload = req.handoff.payload if req.handoff is not None else None
        if payload is None:
            raise RuntimeError(f"the prefill ended ({out.finish_reason}) without its KV")
        shift(req.timeline, self.wall_offset)
        self._trace(req, job.traceparent, "engine.prefill")
        ticket = await self.transport.send(payload)
        return Handoff(self.name, req.num_prompt_tokens - 1, ticket, req.timeline)

    async def _catch_up(self, job: Job) -> None:
        """Apply the ingress's settings first if this replica has older ones."""
        if job.config_version > self.config_version:
            self.config_version = job.config_version
            await asyncio.wrap_future(self.step_loop.call(lambda: self._set_config(job)))

    def _arrived(self, req: Request) -> None:
        req.timeline = Timeline(arrival_ns=time.perf_counter_ns())  # this replica's clock; the ingress keeps its own

    async def ping(self) -> str:
        """A call any replica answers: it makes the gateway's handle start its router."""
        return self.name

    async def abort(self, abort: Abort) -> bool:
        """Abort a request here (its KV freed); the finish goes out on the feed."""
        return await asyncio.wrap_future(self.step_loop.abort(abort.request_id))

    # -- step thread -> replica event loop ----------------------------------
    def on_step(self, out: StepOutput) -> None:
        if out.iteration is not None:
            self._iterations.append(out.iteration)
        emit_ns = out.iteration.end_ns if out.iteration is not None else time.perf_counter_ns()
        if self._aio is not None and not self._aio.is_closed():
            self._aio.call_soon_threadsafe(self._fan_out, out.outputs, emit_ns + self.wall_offset)

    def _fan_out(self, outputs: list[RequestOutput], emit_wall_ns: int) -> None:
        """One iteration's outputs, split by ingress onto their feeds."""
        by_ingress: dict[str, list[RequestOutput]] = {}
        for o in outputs:
            if o.finish_reason is not None and (prefill := self._prefills.get(o.request_id)) is not None:
                if not prefill.done():
                    prefill.set_result(o)
                continue
            job = self._jobs.get(o.request_id)
            if job is None:
                continue
            if o.finish_reason is not None:
                del self._jobs[o.request_id]
                if o.end is not None:
                    tl = o.end.timeline  # the job's request's, which the step loop ran here
                    shift(tl, self.wall_offset)  # onto the wall clock for the trip
                    self._trace(job.request, job.traceparent, "engine.replica", job)
                    if job.kv is not None:  # its prompt's phases happened on the prefill replica
                        tl.scheduled_ns, tl.chunks = job.kv.timeline.scheduled_ns, job.kv.timeline.chunks + tl.chunks
            by_ingress.setdefault(job.ingress, []).append(o)
        for ingress, outs in by_ingress.items():
            queue = self._feeds.get(ingress)
            if queue is not None:
                queue.put_nowait((outs, emit_wall_ns))

    def _trace(self, req: Request, traceparent: str | None, name: str, job: Job | None = None) -> None:
        """This replica's span of the request (its timeline is on the wall clock by now)."""
        if self.tracer is None or traceparent is None:
            return
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        tl = req.timeline
        parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
        span = self.tracer.start_span(name, parent, start_time=tl.arrival_ns)
        span.set_attributes(
            {
                "stallfree.replica": self.name,
                "stallfree.chunks": len(tl.chunks),
                "stallfree.cached_tokens": req.num_cached_tokens,
                "gen_ai.usage.output_tokens": req.num_output_tokens,
            }
        )
        if job is not None and job.kv is not None:  # took over from a prefill replica
            span.set_attributes(
                {
                    "stallfree.prefill_replica": job.kv.replica,
                    "stallfree.prefill_ms": request_timings(job.kv.timeline).e2e_ms,
                    "stallfree.kv_fetch_ms": job.kv_fetch_ms,
                }
            )
        span.end(tl.finished_ns or tl.arrival_ns)

    def _set_config(self, job: Job) -> None:
        self.engine.scheduler.config = job.config
        self.step_loop.snapshot = self.engine.snapshot()

    def on_fatal(self, reason: str) -> None:
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
        return {"stats": stats, "iterations": iterations}

    def check_health(self) -> None:
        if self.fatal is not None or not self.step_loop.alive:
            raise RuntimeError(f"engine stopped: {self.fatal}")

    def __del__(self) -> None:
        if hasattr(self, "step_loop"):
            self.step_loop.stop(timeout=2.0)
