"""The engine's dedicated thread.

Other threads never touch the engine: they put commands on a thread-safe
inbox, which the thread drains between iterations. Each iteration's outputs
go to one callback call, never one call per token.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import structlog

from core.engine import Engine, StepOutput
from core.request import Request

log = structlog.get_logger(__name__)
T = TypeVar("T")

# When requests exist but none can be scheduled, wait this long for a command.
_STALLED_WAIT_S = 0.002


class StepLoop:
    def __init__(self, engine: Engine, on_step: Callable[[StepOutput], None]) -> None:
        self.engine = engine
        self.on_step = on_step
        self.iterations = 0
        self.last_step_ns = 0
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._running = False
        self._thread = threading.Thread(target=self._run, name="stallfree-step", daemon=True)

    # -- any thread --------------------------------------------------------
    def start(self) -> None:
        self._running = True
        self._thread.start()

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
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:  # reported to the caller, not raised here
                    future.set_exception(exc)

        self._inbox.put(command)
        return future

    def submit(self, req: Request) -> Future[None]:
        """Queue req. What can never run is refused here, in the caller's thread."""
        self.engine.check(req.num_prompt_tokens, req.sampling)
        return self.call(lambda: self.engine.add_request(req))

    def abort(self, request_id: str) -> Future[bool]:
        return self.call(lambda: self.engine.abort_request(request_id))

    def reconfigure(self, changes: dict[str, Any]) -> Future[list[str]]:
        return self.call(lambda: self.engine.reconfigure(changes))

    # -- the step thread ---------------------------------------------------
    def _drain(self, wait_s: float | None) -> None:
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
        stalled = False
        while self._running:
            if not self.engine.has_work:
                self._drain(None)
            else:
                self._drain(_STALLED_WAIT_S if stalled else 0)
            if not self._running:
                break
            out = self.engine.step()
            stalled = out is None
            if out is None:
                continue
            self.iterations += 1
            self.last_step_ns = time.perf_counter_ns()
            try:
                self.on_step(out)
            except Exception:
                log.exception("on_step_failed")
