"""An engine in a process of its own: the gateway's side (the ``EngineBackend``).

Nothing here waits on the engine. Commands go into an outbox that the event
loop writes to the pipe when the pipe can take them (``add_writer``); a
submit or a settings change that finds ``outbox_bytes`` already waiting is
refused at once (``EngineBusy``: the engine is not reading), while aborts
and pings always go. The engine's messages are read when they arrive
(``add_reader``), each handled on its own, so that one that fails (a reply
nobody waits for any more, an observer's bug) drops no other.

The engine's side and the wire: ``core.sched.engine_process``, ``core.sched.wire``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import select
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import structlog

from stallfree.core.sched.engine import EngineSnapshot
from stallfree.core.sched.engine_process import BuiltEngine, engine_main
from stallfree.core.sched.request import Request
from stallfree.core.sched.step_loop import TIMES, EngineStopped
from stallfree.core.sched.wire import (
    Abort,
    Command,
    Fatal,
    Frames,
    Message,
    Ping,
    Ready,
    Reconfigure,
    Reply,
    StartFailed,
    Step,
    Stop,
    Submit,
    decode,
    frame,
)
from stallfree.gateway.engine.backend import EngineBusy, EngineListener

log = structlog.get_logger(__name__)

_READ_SIZE = 1 << 20
OUTBOX_BYTES = 32 << 20  # commands the engine has not read yet; a submit past it is refused


class EngineStartFailed(RuntimeError):
    """The engine process could not build its engine (the reason is the message)."""


class EngineProcess:
    """The ``EngineBackend`` of an engine in a process of its own.

    ``factory`` (picklable: a module-level function or a partial of one) builds
    the engine in that process. Construction starts the process and waits
    until its engine is built: ``facts`` then holds what it reported, and a
    factory that raised raises ``EngineStartFailed`` here. ``switch_interval_s``
    is the interpreter's switch interval in that process, where the step
    thread runs (``sys.setswitchinterval``; None keeps Python's 5 ms)."""

    def __init__(
        self,
        factory: Callable[[], BuiltEngine],
        start_timeout_s: float = 900.0,
        outbox_bytes: int = OUTBOX_BYTES,
        switch_interval_s: float | None = None,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")  # fork copies threads' locks mid-use
        commands, commands_end = ctx.Pipe(duplex=False)
        out_end, out = ctx.Pipe(duplex=False)
        self._times = ctx.RawArray("q", TIMES)  # the step loop's: busy_since_ns, last_step_ns, predicted ns
        self.process = ctx.Process(
            target=engine_main,
            args=(factory, commands, out, self._times, switch_interval_s),
            name="stallfree-engine",
            daemon=True,
        )
        self.process.start()
        commands.close()
        out.close()
        self._ends = (commands_end, out_end)  # they own the two descriptors below
        self._write_fd, self._read_fd = commands_end.fileno(), out_end.fileno()
        os.set_blocking(self._write_fd, False)
        os.set_blocking(self._read_fd, False)
        self._frames = Frames()
        self._outbox: deque[memoryview] = deque()  # frames not yet written, the first perhaps in part
        self._outbox_bytes = 0
        self._outbox_limit = outbox_bytes
        self._writing = False  # the loop writes the outbox when the pipe can take it
        self.listener: EngineListener | None = None
        self.fatal: str | None = None
        self._tags = itertools.count()
        self._pending: dict[int, tuple[Future[Any], int]] = {}  # tag -> the caller's future, when it was sent
        self._loop: asyncio.AbstractEventLoop | None = None
        first = self._first_message(start_timeout_s)
        if isinstance(first, StartFailed):
            self.process.join(10)
            raise EngineStartFailed(first.reason)
        self._snapshot, self.name, self.facts = first.snapshot, first.name, first.facts

    def _first_message(self, timeout_s: float) -> Ready | StartFailed:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill()
                raise EngineStartFailed(f"the engine process did not start within {timeout_s:g} s")
            if select.select([self._read_fd], [], [], left)[0]:
                data = os.read(self._read_fd, _READ_SIZE)
                if not data:
                    self.process.join(10)
                    raise EngineStartFailed(
                        f"the engine process exited while starting (exit code {self.process.exitcode})"
                    )
                frames = self._frames.feed(data)
                if frames:
                    first: Ready | StartFailed = decode(frames[0])[0]
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

    @property
    def busy_predicted_s(self) -> float:
        return self._times[2] / 1e9 if self._times[0] else 0.0

    @property
    def owed_since_ns(self) -> int:
        """When the oldest command the engine has not answered was sent (0: none)."""
        return next(iter(self._pending.values()))[1] if self._pending else 0

    def replica_counts(self) -> None:
        """One engine, on this machine."""
        return None

    def start(self, listener: EngineListener) -> None:
        """Called on the event loop, which from now on reads the engine's messages
        and writes its commands."""
        self.listener = listener
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._read_fd, self._readable)
        self._flush()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine to stop, wait up to ``timeout`` for its commands to be
        read and for it to exit, then kill it."""
        self._quiet()
        if self.process.is_alive():
            deadline = time.monotonic() + timeout
            self._queue(Stop())
            while self._outbox and (left := deadline - time.monotonic()) > 0:
                if select.select([], [self._write_fd], [], left)[1] and not self._write():
                    break
            self.process.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        self._fail_pending("the engine process stopped")

    def submit(self, req: Request) -> Future[None]:
        """Queue req (checked by the caller: ``core.sched.engine.check_request``).
        Raises ``EngineBusy`` when the engine has not read what it was sent."""
        return self._command(lambda tag: Submit(tag, req), refusable=True)

    def abort(self, request_id: str) -> Future[bool]:
        return self._command(lambda tag: Abort(tag, request_id))

    def reconfigure(self, changes: dict[str, Any]) -> Future[list[str]]:
        return self._command(lambda tag: Reconfigure(tag, changes), refusable=True)

    def ping(self) -> Future[None]:
        """Answered by the step thread between two iterations."""
        return self._command(Ping)

    # -- commands out -----------------------------------------------------------
    def _command(self, make: Callable[[int], Command], refusable: bool = False) -> Future[Any]:
        future: Future[Any] = Future()
        if self.fatal is not None:
            future.set_exception(EngineStopped(self.fatal))
            return future
        if refusable and self._outbox_bytes >= self._outbox_limit:
            raise EngineBusy(f"the engine has not read the last {self._outbox_bytes >> 10} KiB of commands")
        tag = next(self._tags)
        self._pending[tag] = (future, time.perf_counter_ns())
        self._queue(make(tag))
        self._flush()
        return future

    def _queue(self, command: Command) -> None:
        data = frame([command])
        self._outbox.append(memoryview(data))
        self._outbox_bytes += len(data)

    def _flush(self) -> None:
        """Write what the pipe takes now; the loop writes the rest when it can."""
        if not self._write():
            return
        wants = bool(self._outbox) and self._loop is not None
        if wants and not self._writing:
            assert self._loop is not None
            self._loop.add_writer(self._write_fd, self._flush)
        elif not wants and self._writing:
            assert self._loop is not None
            self._loop.remove_writer(self._write_fd)
        self._writing = wants

    def _write(self) -> bool:
        """Write what the pipe takes without blocking; False: the engine is gone."""
        try:
            while self._outbox:
                head = self._outbox[0]
                n = os.write(self._write_fd, head)
                self._outbox_bytes -= n
                if n < len(head):
                    self._outbox[0] = head[n:]
                    break
                self._outbox.popleft()
        except BlockingIOError:
            pass
        except OSError as exc:
            self._outbox.clear()
            self._outbox_bytes = 0
            self._died(f"the engine process stopped reading commands ({exc!r})")
            return False
        return True

    # -- messages in ----------------------------------------------------------
    def _readable(self) -> None:
        """Event loop: what the engine wrote, every message in order."""
        try:
            data = os.read(self._read_fd, _READ_SIZE)
        except BlockingIOError:
            return
        except OSError as exc:
            data, why = b"", repr(exc)
        else:
            why = "its pipe closed"
        if not data:
            self._quiet()
            self.process.join(1.0)
            self._died(f"the engine process exited (exit code {self.process.exitcode}; {why})")
            return
        for raw in self._frames.feed(data):
            try:
                messages = decode(raw)
            except Exception as exc:  # nothing after it can be trusted to be in order
                log.exception("engine_message_unreadable")
                self._died(f"an unreadable message from the engine process ({exc!r})")
                return
            for message in messages:
                try:
                    self._handle(message)
                except Exception:  # one message's failure never drops the others
                    log.exception("engine_message_failed", message=type(message).__name__)

    def _handle(self, message: Message) -> None:
        assert self.listener is not None, "started"
        if isinstance(message, Step):
            self._snapshot = replace(self._snapshot, counts=message.output.counts)
            self.listener.on_step(message.output)
        elif isinstance(message, Reply):
            if message.snapshot is not None:
                self._snapshot = message.snapshot  # before the caller hears back
            future, _ = self._pending.pop(message.tag, (None, 0))
            if future is None or future.done():  # cancelled by its caller
                return
            if message.error is not None:
                future.set_exception(message.error)
            else:
                future.set_result(message.result)
        elif isinstance(message, Fatal):
            self._died(message.reason)

    def _died(self, reason: str) -> None:
        if self.fatal is not None:
            return
        self.fatal = reason
        log.critical("engine_process_stopped", reason=reason, pid=self.process.pid)
        self._fail_pending(reason)
        if self.listener is not None:
            self.listener.on_fatal(reason)

    def _fail_pending(self, reason: str) -> None:
        pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            if not future.done():
                future.set_exception(EngineStopped(reason))

    def _quiet(self) -> None:
        """The loop stops watching both pipes."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._read_fd)
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_writer(self._write_fd)
        self._writing = False

    def _kill(self) -> None:
        """The engine process ignores SIGTERM (``core.sched.engine_process.engine_main``):
        what does not stop when asked is killed."""
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
