"""An engine in a process of its own: the gateway's side (the ``EngineBackend``).

The engine's side, the wire and why: ``core.sched.engine_process``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import pickle
import select
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import structlog

from stallfree.core.sched.engine import EngineSnapshot, StepOutput, check_request
from stallfree.core.sched.engine_process import BuiltEngine, Frames, engine_main
from stallfree.core.sched.request import Request
from stallfree.core.sched.step_loop import EngineStopped
from stallfree.gateway.engine.backend import EngineListener

log = structlog.get_logger(__name__)

_READ_SIZE = 1 << 20


class EngineStartFailed(RuntimeError):
    """The engine process could not build its engine (the reason is the message)."""


class EngineProcess:
    """The ``EngineBackend`` of an engine in a process of its own.

    ``factory`` (picklable: a module-level function or a partial of one) builds
    the engine in that process. Construction starts the process and waits
    until its engine is built: ``facts`` then holds what it reported, and a
    factory that raised raises ``EngineStartFailed`` here."""

    def __init__(self, factory: Callable[[], BuiltEngine], start_timeout_s: float = 900.0) -> None:
        ctx = multiprocessing.get_context("spawn")  # fork copies threads' locks mid-use
        commands, self._commands = ctx.Pipe(duplex=False)
        self._out, out = ctx.Pipe(duplex=False)  # the engine's messages; read here by fd, without blocking
        self._times = ctx.RawArray("q", 2)  # the step loop's busy_since_ns, last_step_ns
        self.process = ctx.Process(
            target=engine_main,
            args=(factory, commands, out, self._times),
            name="stallfree-engine",
            daemon=True,
        )
        self.process.start()
        commands.close()
        out.close()
        self._fd = self._out.fileno()
        os.set_blocking(self._fd, False)
        self._frames = Frames()
        self.listener: EngineListener | None = None
        self.fatal: str | None = None
        self._tags = itertools.count()
        self._pending: dict[int, Future[Any]] = {}
        self._send_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        first = self._first_message(start_timeout_s)
        if first[0] == "failed":
            self.process.join(10)
            raise EngineStartFailed(first[1])
        _, self._snapshot, self.name, self.facts = first

    def _first_message(self, timeout_s: float) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill()
                raise EngineStartFailed(f"the engine process did not start within {timeout_s:g} s")
            if select.select([self._fd], [], [], left)[0]:
                data = os.read(self._fd, _READ_SIZE)
                if not data:
                    self.process.join(10)
                    raise EngineStartFailed(
                        f"the engine process exited while starting (exit code {self.process.exitcode})"
                    )
                frames = self._frames.feed(data)
                if frames:
                    first: tuple[Any, ...] = pickle.loads(frames[0])[0]
                    return first

    # -- EngineBackend ----------------------------------------------------------
    @property
    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    @property
    def alive(self) -> bool:
        return self.fatal is None and self.process.is_alive()

    @property
    def busy_since_ns(self) -> int:
        return int(self._times[0])

    @property
    def last_step_ns(self) -> int:
        return int(self._times[1])

    def replica_counts(self) -> None:
        """One engine, on this machine."""
        return None

    def start(self, listener: EngineListener) -> None:
        """Called on the event loop, which from now on reads the engine's messages."""
        self.listener = listener
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._readable)

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self._send(("stop",))
            self.process.join(timeout)
        self._kill()
        self._fail_pending("the engine process stopped")

    def submit(self, req: Request) -> Future[None]:
        """Queue req. What can never run is refused here, in the caller's thread."""
        s = self._snapshot
        check_request(req.num_prompt_tokens, req.sampling, s.config.max_model_len, s.vocab_size)
        return self._command("submit", req)

    def abort(self, request_id: str) -> Future[bool]:
        return self._command("abort", request_id)

    def reconfigure(self, changes: dict[str, Any]) -> Future[list[str]]:
        return self._command("reconfigure", changes)

    # -- the wire -------------------------------------------------------------
    def _command(self, kind: str, arg: Any) -> Future[Any]:
        future: Future[Any] = Future()
        if self.fatal is not None:
            future.set_exception(EngineStopped(self.fatal))
            return future
        tag = next(self._tags)
        self._pending[tag] = future
        try:
            self._send((kind, tag, arg))
        except OSError:
            self._pending.pop(tag, None)
            future.set_exception(EngineStopped("the engine process is gone"))
        return future

    def _send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps([message], protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._commands.send_bytes(data)

    def _readable(self) -> None:
        """Event loop: what the engine wrote, every message in order."""
        try:
            data = os.read(self._fd, _READ_SIZE)
        except BlockingIOError:
            return
        except OSError as exc:
            data, why = b"", repr(exc)
        else:
            why = "its pipe closed"
        if not data:
            assert self._loop is not None
            self._loop.remove_reader(self._fd)
            self.process.join(1.0)
            self._died(f"the engine process exited (exit code {self.process.exitcode}; {why})")
            return
        for frame in self._frames.feed(data):
            for message in pickle.loads(frame):
                self._handle(message)

    def _handle(self, message: tuple[Any, ...]) -> None:
        assert self.listener is not None, "started"
        kind = message[0]
        if kind == "step":
            out: StepOutput = message[1]
            self._snapshot = replace(self._snapshot, counts=out.counts)
            self.listener.on_step(out)
        elif kind == "reply":
            _, tag, exc, result, snapshot = message
            if snapshot is not None:
                self._snapshot = snapshot  # before the caller hears back
            future = self._pending.pop(tag)
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(result)
        elif kind == "fatal":
            self._died(message[1])

    def _died(self, reason: str) -> None:
        if self.fatal is not None:
            return
        self.fatal = reason
        log.critical("engine_process_stopped", reason=reason, pid=self.process.pid)
        self._fail_pending(reason)
        assert self.listener is not None
        self.listener.on_fatal(reason)

    def _fail_pending(self, reason: str) -> None:
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(EngineStopped(reason))

    def _kill(self) -> None:
        """The engine process ignores SIGTERM (``core.sched.engine_process.engine_main``):
        what does not stop when asked is killed."""
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
