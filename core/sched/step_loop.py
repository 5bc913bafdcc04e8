"""The engine's dedicated thread.

Other threads never touch the engine: they put commands on a thread-safe
inbox, which the thread empties between iterations, and read only
``snapshot``, which the thread replaces after every iteration and settings change.
Each iteration's outputs go to one callback call, never one call per token.

The thread never dies silently: an engine that reports itself broken, or
anything raised outside an iteration, fails every request (their outputs
still go out), stops the loop and calls ``on_fatal`` with the reason.
"""

from __future__ import annotations

import gc
import queue
import resource
import threading
import time
from collections.abc import Callable, MutableSequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

import structlog

from stallfree.core.sched.batch import IterationRecord
from stallfree.core.sched.engine import Engine, EngineSnapshot, StepOutput
from stallfree.core.sched.request import Request

log = structlog.get_logger(__name__)
T = TypeVar("T")

# When requests exist but none can be scheduled, wait this long for a command.
_UNSCHEDULABLE_WAIT_S = 0.002
TIMES = 3  # busy_since_ns, last_step_ns, the running iteration's predicted ns


def on_own_thread(fn: Callable[[], T]) -> T:
    """fn's result (or its exception), computed on a thread that ends when fn returns.

    Build the engine with it. Why: the OpenMP runtime keeps a team of worker
    threads for every thread that has run a parallel region, for as long as
    that thread lives. A model loaded and profiled on one thread and stepped on
    another leaves two teams, and libgomp, once its teams' threads outnumber the
    cores, stops its workers spinning between parallel regions: they sleep in
    the kernel and every region waits for them to wake. Built on a thread that
    ends, the step thread's team is the only one: on the 2-core Xeon at 2
    threads, 32 streams through the server stepped in 36.8 ms, not 54.6, the
    engine process on 1.90 cores, not 1.52 (bench/results/server_overhead-2026-12-05-5).
    """
    box: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # raised again on the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="stallfree-build")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return box[0]


class CollectorTime:
    """How long the garbage collector has run in this process, from any thread
    (a ``gc.callbacks`` entry): a collection holds the interpreter lock, so it
    stops the step thread wherever it was started."""

    def __init__(self) -> None:
        self.total_ns = 0
        self._started_ns = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started_ns = time.perf_counter_ns()
        else:
            self.total_ns += time.perf_counter_ns() - self._started_ns


COLLECTOR = CollectorTime()  # in gc.callbacks once a step loop has started


def thread_use(record: IterationRecord, before: resource.struct_rusage, after: resource.struct_rusage) -> None:
    """The step thread's CPU time, context switches and page faults between
    two readings of its ``getrusage(RUSAGE_THREAD)``, into ``record``."""
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    record.thread_cpu_ns = int(cpu_s * 1e9)
    record.thread_preempted = after.ru_nivcsw - before.ru_nivcsw
    record.thread_waits = after.ru_nvcsw - before.ru_nvcsw
    record.page_faults = after.ru_minflt + after.ru_majflt - before.ru_minflt - before.ru_majflt


class EngineStopped(RuntimeError):
    """The engine cannot run commands any more (the reason is the message)."""


class StepListener(Protocol):
    """What a ``StepLoop`` reports to, always from its step thread: the
    gateway's ``EngineClient`` when the loop runs in the server's process, the
    forwarder to the pipe in an engine process, a scale-out replica.
    ``gateway.engine.backend.EngineListener`` extends it for every engine
    backend: the same two calls, but from whichever thread the backend reports
    on, and the replicas' reports besides."""

    def on_step(self, out: StepOutput) -> None:
        """An iteration's outputs (on the step thread)."""

    def on_fatal(self, reason: str) -> None:
        """The engine stopped for good (on the step thread)."""


class StepLoop:
    def __init__(self, engine: Engine, times: MutableSequence[int] | None = None) -> None:
        """``times``: where busy_since_ns, last_step_ns and the running
        iteration's predicted ns are kept (``TIMES`` of them: shared memory,
        when another process watches this loop)."""
        self.engine = engine
        self.snapshot: EngineSnapshot = engine.snapshot()  # replaced whole, never changed: safe to read anywhere
        self.listener: StepListener | None = None  # given at start
        self.iterations = 0
        self._times = times if times is not None else [0] * TIMES
        engine.scheduled = self._scheduled
        self.fatal: str | None = None
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders call() against _die(): no future is left pending
        self._pending: dict[Future[Any], int] = {}  # commands not yet run -> when they were given
        self._running = False
        self._thread = threading.Thread(target=self._run, name="stallfree-step", daemon=True)

    # -- any thread --------------------------------------------------------
    def start(self, listener: StepListener) -> None:
        if COLLECTOR not in gc.callbacks:
            gc.callbacks.append(COLLECTOR)
        self.listener = listener
        self._running = True
        self._thread.start()

    @property
    def busy_since_ns(self) -> int:
        """perf_counter_ns when the running iteration began; 0 between iterations."""
        return self._times[0]

    @property
    def last_step_ns(self) -> int:
        """perf_counter_ns when the last iteration ended."""
        return self._times[1]

    @property
    def busy_predicted_s(self) -> float:
        """The running iteration's predicted time (0: none runs, or nothing predicts it)."""
        return self._times[2] / 1e9 if self._times[0] else 0.0

    @property
    def owed_since_ns(self) -> int:
        """When the oldest command not yet run was given (0: none waits)."""
        with self._lock:
            return next(iter(self._pending.values()), 0)

    def replica_counts(self) -> None:
        """One engine, in this process."""
        return None

    def stop(self, timeout: float = 10.0) -> None:
        def halt() -> None:
            self._running = False

        self._inbox.put(halt)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run fn on the step thread between iterations; its result or error comes back in the Future."""
        future: Future[T] = Future()

        def command() -> None:
            with self._lock:
                self._pending.pop(future, None)
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:  # reported to the caller, not raised here
                    future.set_exception(exc)

        with self._lock:
            if self.fatal is not None:
                future.set_exception(EngineStopped(self.fatal))
                return future
            self._pending[future] = time.perf_counter_ns()
        self._inbox.put(command)
        return future

    def submit(self, req: Request) -> Future[None]:
        """Queue req (checked by its caller: ``core.sched.engine.check_request``)."""
        return self.call(lambda: self.engine.add_request(req))

    def ping(self) -> Future[None]:
        """Answered between two iterations: the step thread still moves."""
        return self.call(lambda: None)

    def abort(self, request_id: str) -> Future[bool]:
        return self.call(lambda: self.engine.abort_request(request_id))

    def reconfigure(self, changes: dict[str, Any]) -> Future[list[str]]:
        def apply() -> list[str]:
            warnings = self.engine.reconfigure(changes)
            self.snapshot = self.engine.snapshot()  # before the caller hears back
            return warnings

        return self.call(apply)

    # -- the step thread ---------------------------------------------------
    def _run_commands(self, wait_s: float | None) -> None:
        """Run every queued command, first waiting up to wait_s for one
        (None: until one comes; 0: not at all)."""
        try:
            command = self._inbox.get_nowait() if wait_s == 0 else self._inbox.get(timeout=wait_s)
            while True:
                command()
                command = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _run(self) -> None:
        try:
            self._iterate()
        except BaseException as exc:  # a bug outside any iteration: nobody may be left waiting
            self._die(f"step loop failed: {exc!r}", exc)

    def _iterate(self) -> None:
        unschedulable = False  # the last step had requests but could run none of them
        while self._running:
            if not self.engine.has_work:
                self._run_commands(None)
            else:
                self._run_commands(_UNSCHEDULABLE_WAIT_S if unschedulable else 0)
            if not self._running:
                break
            self._times[2] = 0  # until the engine has scheduled the batch
            self._times[0] = time.perf_counter_ns()
            before, collected_ns = resource.getrusage(resource.RUSAGE_THREAD), COLLECTOR.total_ns
            out = self.engine.step()
            self._times[0] = 0
            if out is not None and out.iteration is not None:
                thread_use(out.iteration, before, resource.getrusage(resource.RUSAGE_THREAD))
                out.iteration.collector_ns = COLLECTOR.total_ns - collected_ns
            if out is not None:
                self.snapshot = self.engine.snapshot(out.counts)
                self.iterations += 1
                self._times[1] = time.perf_counter_ns()
                self._publish(out)
            if self.engine.broken is not None:
                self._die(self.engine.broken)
                return
            unschedulable = out is None

    def _scheduled(self, predicted_s: float) -> None:
        self._times[2] = int(predicted_s * 1e9)

    def _publish(self, out: StepOutput) -> None:
        try:
            assert self.listener is not None
            self.listener.on_step(out)
        except Exception:
            log.exception("on_step_failed")

    def _die(self, reason: str, exc: BaseException | None = None) -> None:
        with self._lock:
            self.fatal = reason
            pending, self._pending = list(self._pending), {}
        for future in pending:  # commands that will never run
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineStopped(reason))
        self._running = False
        log.critical("engine_stopped", reason=reason, exc_info=exc)
        try:
            self.engine.fail_all()
            out = self.engine.step_output_of_failures()
            if out is not None:
                self._publish(out)
        finally:
            if self.listener is not None:
                self.listener.on_fatal(reason)
