"""The bridge between the event loop and the engine, wherever it runs.

``submit`` passes the request through ``Admission`` (rate, waiting room,
tokenizing off the loop, the TTFT forecast) and the key's grant, checks it
once (``check_request``), hands it to the engine backend and returns its
``RequestStream``. The backend reports each iteration in one call
(``on_step``); on the loop, ``_fan_out`` spreads that iteration's tokens
over the streams and tells the observers (metrics, telemetry, traces,
request log) what happened.

The watchdog keeps a ``ping`` out to the engine, and judges the engine by
the oldest command it has not answered: past ``stall_grace_s`` +
``STALL_FACTOR`` x the running iteration's predicted time it is stalled
(``/readyz`` false, every open stream told, new requests refused with 503
until it answers again); stalled for ``hung_engine_s``, it is hung: every
stream gets its error and the server exits non-zero.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import anyio
import structlog

from stallfree.core import faults
from stallfree.core.cluster.stats import ReplicaStats
from stallfree.core.model.tokenizer import Tokenizer
from stallfree.core.sched.deadline import Place, Verdict
from stallfree.core.sched.engine import EngineSnapshot, RequestOutput, RequestRejected, StepOutput, check_request
from stallfree.core.sched.policy import newcomer_place
from stallfree.core.sched.request import FinishReason, Request, RequestEnd
from stallfree.core.sched.step_loop import EngineStopped
from stallfree.gateway.edge.grants import ADMIN_PREFIX, Grant, check_grant
from stallfree.gateway.engine.admission import Admission
from stallfree.gateway.engine.backend import EngineBackend, EngineBusy
from stallfree.gateway.engine.streams import Notice, RequestStream
from stallfree.gateway.inputs.prompts import prompt_ids
from stallfree.gateway.inputs.protocol import GenerateRequest, ProtocolError
from stallfree.gateway.observe.metrics import Metrics
from stallfree.gateway.observe.observers import Emitted, Observer, RequestLog, TargetLog
from stallfree.gateway.observe.telemetry import Telemetry
from stallfree.gateway.observe.tracing import Tracing
from stallfree.gateway.settings import GatewaySettings

log = structlog.get_logger(__name__)

# An iteration may run this many times its predicted time before the engine counts as
# stalled: the online-corrected prediction ran 1.2-1.75x at worst (core.sched.scheduler.AIM_PERCENTILE)
STALL_FACTOR = 4.0


class EngineClient:
    """Drives one ``EngineBackend``, built whole before it (the engine process,
    this process's step loop, or replicas on Ray: ``gateway.engine.backend``),
    and is the ``EngineListener`` it reports to once started."""

    def __init__(
        self,
        backend: EngineBackend,
        tokenizer: Tokenizer,
        settings: GatewaySettings,
        tracing: Tracing | None = None,
        log_text: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.settings = settings
        self.metrics = Metrics()
        self.telemetry = Telemetry()
        self.tracing = tracing
        self.observers: list[Observer] = [self.metrics, self.telemetry, RequestLog(tokenizer, log_text), TargetLog()]
        if tracing is not None:
            self.observers.append(tracing)
        self.backend = backend
        self.accepting = False
        self.fatal: str | None = None  # why the engine stopped for good, once it has
        self.stalled_s = 0.0  # while the engine is stalled: how long it has not answered
        self.on_engine_failed: Callable[[str], None] | None = None  # the server exits non-zero
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        self._requests: dict[str, Request] = {}  # as sent, until the engine reports their end
        self._aborted: set[str] = set()  # aborts sent whose end the engine has not reported yet
        self.admission = Admission(settings)
        self._ids = itertools.count()
        self._ping: Future[None] | None = None

    # -- lifecycle ---------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.backend.start(self)
        self.accepting = True

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting; give in-flight requests timeout_s to finish (none while
        the engine is stalled: waiting would not help them), then cancel the
        rest; what a stalled engine cannot end is ended here."""
        self.accepting = False
        with anyio.move_on_after(timeout_s):
            while self._streams and not self.stalled_s:
                await anyio.sleep(0.05)
        for request_id in list(self._streams):
            self.cancel(request_id)
        with anyio.move_on_after(2.0):
            while self._streams and not self.stalled_s:
                await anyio.sleep(0.02)
        for request_id in list(self._streams):
            self._fail(request_id, FinishReason.ABORT)

    def stop(self) -> None:
        self.accepting = False
        self._stopping = True
        # an engine that does not stop within what its running iteration may take is killed
        # (it holds nothing to save); a stalled one at once
        allowed_s = self.settings.stall_grace_s + STALL_FACTOR * self.backend.busy_predicted_s
        self.backend.stop(timeout=0.5 if self.stalled_s else allowed_s)
        if self.tracing is not None:
            self.tracing.shutdown()

    @property
    def snapshot(self) -> EngineSnapshot:
        """The engine's settings and KV counts as the engine last published them."""
        return self.backend.snapshot

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def replicas(self) -> tuple[int, int] | None:
        """(ready, configured) engine replicas when they run elsewhere; None for one local engine."""
        return self.backend.replica_counts()

    def on_replicas(self, stats: list[ReplicaStats]) -> None:
        """The replicas' latest reports (scale-out), for the observers."""
        self._observe(lambda obs: obs.on_replicas(stats))

    @property
    def ready(self) -> bool:
        """The engine runs and answers (not stalled); with replicas, at least one reports."""
        if self.fatal is not None or not self.backend.alive or self.stalled_s:
            return False
        return self.replicas is None or self.replicas[0] > 0

    # -- requests ----------------------------------------------------------
    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    async def submit(self, gen: GenerateRequest, request_id: str) -> tuple[RequestStream, int]:
        """Queue a request; returns its stream and prompt length. Raises ProtocolError."""
        streams, prompt_tokens = await self.submit_choices(gen, request_id, 1)
        return streams[0], prompt_tokens

    async def submit_choices(self, gen: GenerateRequest, request_id: str, n: int) -> tuple[list[RequestStream], int]:
        """Queue n choices of one prompt (OpenAI's ``n``): tokenized once; the
        first choice's prompt is computed and the others share its KV blocks
        (``Request.prefill_after``). Choice i > 0 is ``<request_id>-<i>``, with
        its own seed when one is given. Returns their streams and the prompt length."""
        arrival_ns = time.perf_counter_ns()
        self._check_open()
        check_grant(gen, self._grant(gen.tenant), self.snapshot.config.ttft_slo_ms)
        self.admission.check_rate(gen.tenant)
        ids = await self.admission.tokenize(lambda: prompt_ids(self.tokenizer, gen), gen.tenant)
        self._check_open()  # again: tokenizing took a while
        sampling = gen.sampling
        limit = self.snapshot.config.max_model_len
        if not gen.max_tokens_given:
            sampling.max_tokens = max(1, limit - len(ids))
        try:
            check_request(len(ids), sampling, limit, self.snapshot.vocab_size)
        except RequestRejected as exc:
            raise ProtocolError(exc.code, str(exc)) from None
        except ValueError as exc:
            raise ProtocolError("invalid_request", str(exc)) from None
        self.admission.reserve(gen.tenant, len(ids))
        verdict, place = self._forecast(gen, arrival_ns, len(ids))
        streams: list[RequestStream] = []
        for i in range(n):
            choice_id = request_id if i == 0 else f"{request_id}-{i}"
            choice_sampling = sampling
            if i and sampling.seed is not None:  # the same seed would draw the same tokens n times
                choice_sampling = dataclasses.replace(sampling, seed=hash((sampling.seed, i)) & (2**63 - 1))
            req = Request(choice_id, ids, choice_sampling, arrival_ns, gen.priority, gen.tenant)
            req.cache_salt = "" if self.settings.share_prefix_cache else gen.tenant  # each key hits its own blocks
            req.prefill_after = request_id if i else None
            req.ttft_slo_ms = gen.ttft_slo_ms
            try:
                streams.append(self._queue(req, gen))
                streams[-1].verdict = verdict
            except ProtocolError:  # the choices already queued have nobody to read them
                for stream in streams:
                    self.cancel(stream.request_id)
                    stream.close()
                self.admission.charge(gen.tenant, -len(ids))  # nothing ran: the prompt's tokens go back
                raise
        self.admission.sent(n, place, len(ids))  # one prefill, whatever n
        return streams, len(ids)

    def _check_open(self) -> None:
        """Refuse new work while the engine cannot take it."""
        if self.fatal is not None:
            raise ProtocolError("unavailable", f"the engine stopped: {self.fatal}")
        if not self.accepting:
            raise ProtocolError("overloaded", "server is shutting down")
        if self.stalled_s:
            why = f"the engine has not answered for {self.stalled_s:.1f} s; retry shortly"
            raise ProtocolError("unavailable", why, None, max(1, math.ceil(self.settings.stall_grace_s)))

    def _grant(self, tenant: str) -> Grant | None:
        """What the key may ask (None: not bounded: no keys are set, or an operator's key)."""
        if not self.settings.api_keys or tenant.startswith(ADMIN_PREFIX):
            return None
        return self.settings.key_grants.get(tenant, Grant())

    def _forecast(self, gen: GenerateRequest, arrival_ns: int, prompt_tokens: int) -> tuple[Verdict | None, Place]:
        """Admission's prediction of the first token under a TTFT target, and the
        prompt's place in the queue's order; with ``shed_load``, a prompt only
        the queue ahead makes late is refused here, before it costs any KV or
        prefill (429, Retry-After from the forecast). A prompt that opts out of
        the server's target (``ttft_slo_ms`` 0) is ordered as having none but
        judged by the server's: the queue ahead of it is no shorter for that."""
        snapshot = self.snapshot
        cfg, forecast = snapshot.config, snapshot.counts.forecast
        own = gen.ttft_slo_ms if gen.ttft_slo_ms is not None else cfg.ttft_slo_ms
        due = arrival_ns + own * 1e6 if own else math.inf
        served = forecast.served if forecast is not None else {}
        place = newcomer_place(cfg.policy, gen.priority, gen.tenant, prompt_tokens, served, due)
        target = own or cfg.ttft_slo_ms
        verdict = self.admission.predict(forecast, prompt_tokens, target, place)
        if verdict is None:
            return None, place
        shed = verdict.refusable and self.settings.shed_load
        self.metrics.on_admission("on_time" if verdict.on_time else "shed" if shed else "late")
        if shed:
            self.admission.charge(gen.tenant, -prompt_tokens)  # nothing ran: the prompt's tokens go back
            why = (
                f"predicted time to first token {verdict.predicted_s * 1e3:.0f} ms exceeds the TTFT target "
                f"{target:g} ms; retry in {verdict.retry_after_s} s"
            )
            raise ProtocolError("overloaded", why, None, verdict.retry_after_s)
        return verdict, place

    def _queue(self, req: Request, gen: GenerateRequest) -> RequestStream:
        """Hand req to the engine."""
        request_id = req.request_id
        try:
            future = self.backend.submit(req)
        except EngineBusy as exc:
            raise ProtocolError("unavailable", f"{exc}; retry shortly", None, 1) from None
        stream = RequestStream(request_id, self.settings.stream_queue_frames, self.settings.slow_consumer_s)
        self._streams[request_id] = stream
        self._requests[request_id] = req
        self.admission.queued(request_id, req.tenant)
        operation = "chat" if gen.messages is not None else "text_completion"
        self._observe(lambda obs: obs.on_submit(req, operation, self.settings.model_name, gen.traceparent))
        future.add_done_callback(lambda f: self._submit_failed(request_id, f.exception()) if f.exception() else None)
        return stream

    def _submit_failed(self, request_id: str, exc: BaseException | None) -> None:
        """Any thread: the engine stopped before it took the request (its
        backend said why, once), or refused one that passed the checks (a bug)."""
        if isinstance(exc, EngineStopped):
            log.warning("request_lost_with_the_engine", request_id=request_id, reason=str(exc))
        else:
            log.error("engine_refused_request", request_id=request_id, error=repr(exc))
        self._call_soon(self._fail, request_id, FinishReason.ERROR)

    def cancel(self, request_id: str) -> None:
        """Abort in the engine (KV freed there); the stream ends with reason 'abort'."""
        if request_id in self._streams:
            self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        """One abort per request, however often its client cancels it."""
        if request_id in self._requests and request_id not in self._aborted:
            self._aborted.add(request_id)
            self.backend.abort(request_id)

    def cut_off(self, request_id: str, **why: object) -> None:
        """A reader too slow for its stream: it ends with ``slow_consumer``, its KV is freed."""
        if request_id in self._streams:
            log.warning("slow_consumer", request_id=request_id, **why)
            self._observe(lambda obs: obs.on_cut_off(request_id))
            self._fail(request_id, FinishReason.SLOW_CONSUMER)

    def report_error(self, code: str) -> None:
        """An error answered to a client, for the observers (the errors metric)."""
        self._observe(lambda obs: obs.on_error(code))

    # -- health --------------------------------------------------------------
    async def watchdog(self, period_s: float = 0.25) -> None:
        """Keeps a ping out, and judges the engine by what it has not answered."""
        while True:
            await anyio.sleep(period_s)
            if self.fatal is not None or self._stopping:
                continue
            if not self.backend.alive:
                self._fail_engine("the engine stopped running")
                continue
            self._judge_silence()
            if self._ping is None or self._ping.done():
                self._ping = self.backend.ping()

    def _judge_silence(self) -> None:
        """Stalled: the oldest command unanswered for longer than ``stall_grace_s``
        + ``STALL_FACTOR`` x the running iteration's predicted time; every open
        stream is told when the engine stalls and when it answers again."""
        owed = self.backend.owed_since_ns
        silent_s = (time.perf_counter_ns() - owed) / 1e9 if owed else 0.0
        allowed_s = self.settings.stall_grace_s + STALL_FACTOR * self.backend.busy_predicted_s
        if silent_s > allowed_s:
            if not self.stalled_s:
                log.warning("engine_stalled", silent_s=round(silent_s, 2), allowed_s=round(allowed_s, 2))
                self._tell(Notice("stalled", round(silent_s * 1e3)))
            self.stalled_s = silent_s
            if silent_s > self.settings.hung_engine_s:
                self._fail_engine(f"the engine has answered nothing for {silent_s:.0f} s")
        elif self.stalled_s:
            log.info("engine_resumed", stalled_s=round(self.stalled_s, 2))
            self._tell(Notice("resumed", round(self.stalled_s * 1e3)))
            self.stalled_s = 0.0

    def _tell(self, notice: Notice) -> None:
        for stream in self._streams.values():
            stream.tell(notice)

    def on_fatal(self, reason: str) -> None:
        """Any thread: the engine stopped for good."""
        self._call_soon(self._fail_engine, reason)

    def _fail_engine(self, reason: str) -> None:
        """Loop: every stream gets its error, new requests get 503, the server exits non-zero."""
        if self.fatal is not None:
            return
        self.fatal = reason
        self.accepting = False
        log.critical("engine_failed", reason=reason, in_flight=len(self._streams))
        for request_id in list(self._streams):
            self._fail(request_id, FinishReason.ERROR)
        if self.on_engine_failed is not None:
            self.on_engine_failed(reason)

    # -- engine -> loop -----------------------------------------------------
    def _call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def on_step(self, out: StepOutput) -> None:
        """Any thread: one thread-safe call per iteration."""
        self._call_soon(self._fan_out, out)

    def _observe(self, event: Callable[[Observer], None]) -> None:
        """Tell every observer; one that fails is logged and skipped: observers
        must never cost anybody their tokens."""
        for observer in self.observers:
            try:
                event(observer)
            except Exception:
                log.exception("observer_failed", observer=type(observer).__name__)

    def _fan_out(self, out: StepOutput) -> None:
        it = out.iteration
        emit_ns = out.emit_ns or (it.end_ns if it is not None else time.perf_counter_ns())
        self._observe(lambda obs: obs.on_counts(out.counts))
        if it is not None:
            self._observe(lambda obs: obs.on_iteration(it))
        emitted: list[Emitted] = []
        ended: list[tuple[Request, RequestEnd]] = []
        for o in out.outputs:
            try:
                self._deliver(o, emit_ns, emitted)
            except Exception:  # one request's failure must not stall everybody's delivery
                log.exception("fan_out_failed", request_id=o.request_id)
                self._fail(o.request_id, FinishReason.ERROR)
            if o.end is not None:
                self._aborted.discard(o.request_id)
                req = self._requests.pop(o.request_id, None)
                if req is not None:
                    ended.append((req, o.end))
        if emitted:  # before the ends, which free what observers hold per request
            self._observe(lambda obs: obs.on_tokens(emitted))
        for req, end in ended:
            self._ended(req, end)

    def _deliver(self, o: RequestOutput, emit_ns: int, emitted: list[Emitted]) -> None:
        faults.point("fan_out")
        stream = self._streams.get(o.request_id)
        if stream is None:
            return
        if o.new_token_ids:
            gap_ns = emit_ns - stream.last_emit_ns if stream.last_emit_ns else None
            emitted.append(Emitted(o.request_id, o.new_token_ids, emit_ns, gap_ns, o.stalled))
            stream.last_emit_ns = emit_ns
        self.admission.started(o.request_id)
        if not stream.put(o.new_token_ids, emit_ns, o.finish_reason, o.end, o.logprobs):
            self.cut_off(o.request_id)
        elif o.finish_reason is not None:
            del self._streams[o.request_id]

    def _ended(self, req: Request, end: RequestEnd) -> None:
        """The rate limit's charge for what was generated (admission), then the observers."""
        self.admission.charge(req.tenant, end.num_output_tokens)
        self._observe(lambda obs: obs.on_finish(req, end))

    def _fail(self, request_id: str, reason: FinishReason) -> None:
        """End the stream here, now; the engine is told to abort (its end, when
        it reports it, still reaches the observers)."""
        stream = self._streams.pop(request_id, None)
        self.admission.started(request_id)
        if stream is not None:
            stream.fail(reason)
            self._abort(request_id)
