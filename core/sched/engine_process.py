"""The engine process's side of ``gateway.engine.process.EngineProcess``: the
step loop in a process of its own (vLLM V1's EngineCore shape).

Why: in one process the step thread and the event loop share one interpreter
lock. Every torch op hands the lock back and takes it again, and while the
loop fans out tokens, encodes and writes frames, the step thread waits for it.
Here the engine's process runs the same ``StepLoop`` on its own core and lock,
whatever the gateway is doing; the gateway's process keeps the event loop and
the per-user queues. On the 2-core Zen 4 both ways ran decode iterations at
0.94-1.19x the engine's alone (bench/results/server_overhead-*.md).

The wire (``core.sched.wire``): two pipes, one each way, of framed lists of
typed messages. A thread of the engine reads the gateway's commands and hands
them to the step loop; a sender thread writes the engine's messages, so a
slow gateway never holds up an iteration: what piles up meanwhile goes out in
few writes (at most ``FRAME_MESSAGES`` a frame). The sender holds at most
``SENDER_MESSAGES``; past that the step thread waits for the gateway to read,
so a gateway that reads nothing cannot make the engine's memory grow. The
gateway reads and writes its ends on its event loop without ever blocking
(``gateway.engine.process``).

Failure: the engine process that exits or crashes closes the pipe, and the
gateway hears ``on_fatal`` (every stream gets its error, the server exits
non-zero); one that stops answering (stopped, hung in an iteration, a thread
stuck) leaves a command (the watchdog's ping at least) unanswered past the
running iteration's predicted time, which the step loop keeps in shared
memory beside ``busy_since_ns``: the gateway's watchdog reads both. The engine process dies with
its parent (``PR_SET_PDEATHSIG``, and the pipe's end), ignores SIGINT and
SIGTERM (the gateway's to handle: it drains first) and is killed if it does
not stop when asked.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import structlog

from stallfree.core.sched.engine import Engine, StepOutput
from stallfree.core.sched.step_loop import StepLoop, on_own_thread
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
    portable,
    write_frame,
)

log = structlog.get_logger(__name__)

_PR_SET_PDEATHSIG = 1
_READ_SIZE = 1 << 20
SENDER_MESSAGES = 4096  # messages waiting for the pipe; past it the step thread waits
FRAME_MESSAGES = 256  # messages in one frame: the gateway unpickles a frame in one go


@dataclass(slots=True)
class BuiltEngine:
    """What an engine factory returns in the engine process: the engine and
    what the gateway's start-up log says of it."""

    engine: Engine
    name: str  # the model's, as the API reports it
    facts: dict[str, object] = field(default_factory=dict)


class _Sender:
    """Writes the engine's messages to the pipe on a thread of its own: what
    piles up while the gateway is slow goes out together, ``FRAME_MESSAGES``
    a frame; ``put`` waits while ``capacity`` messages are queued."""

    def __init__(self, fd: int, capacity: int = SENDER_MESSAGES) -> None:
        self.fd = fd
        self.box: queue.Queue[Message | None] = queue.Queue(capacity)
        self.thread = threading.Thread(target=self._run, name="stallfree-engine-send", daemon=True)
        self.thread.start()

    def put(self, message: Message) -> None:
        self.box.put(message)

    def close(self) -> None:
        self.box.put(None)
        self.thread.join(10)

    def _run(self) -> None:
        while True:
            batch = [self.box.get()]
            while len(batch) < FRAME_MESSAGES and batch[-1] is not None:
                try:
                    batch.append(self.box.get_nowait())
                except queue.Empty:
                    break
            messages = [m for m in batch if m is not None]
            try:
                if messages:
                    write_frame(self.fd, messages)
            except OSError:  # the gateway is gone: so is the reason to run
                os._exit(0)
            except Exception:  # unpicklable: a bug; die loudly, and the gateway fails every stream
                log.critical("engine_message_unpicklable", exc_info=True)
                os._exit(1)
            if batch[-1] is None:
                return


class _Forward:
    """The step loop's listener in the engine process: everything to the sender."""

    def __init__(self, sender: _Sender) -> None:
        self.sender = sender

    def on_step(self, out: StepOutput) -> None:
        self.sender.put(Step(out))

    def on_fatal(self, reason: str) -> None:
        self.sender.put(Fatal(reason))


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the gateway's dies, however it dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # elsewhere the pipe's end stops it


def engine_main(
    factory: Callable[[], BuiltEngine],
    commands: multiprocessing.connection.Connection,
    out: multiprocessing.connection.Connection,
    times: Any,
    switch_interval_s: float | None = None,
) -> None:
    """The engine process's target: build, report ready, then run ``commands``
    until told to stop; every message back goes on ``out``. The switch
    interval is how long the step thread's Python holds the interpreter lock
    before the sender and the command reader may take it."""
    out_fd = out.fileno()
    _die_with_parent()
    if switch_interval_s is not None:
        sys.setswitchinterval(switch_interval_s)
    # Ctrl-C and a supervisor's SIGTERM reach the whole group: the gateway drains, then stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        built = on_own_thread(factory)  # the step thread's OpenMP team the only one
    except BaseException as exc:
        write_frame(out_fd, [StartFailed(f"{type(exc).__name__}: {exc}")])
        return
    loop = StepLoop(built.engine, times)
    gc.collect()
    gc.freeze()  # the model and tables out of the collector's way, as in the gateway
    write_frame(out_fd, [Ready(loop.snapshot, built.name, built.facts)])
    sender = _Sender(out_fd)
    loop.start(_Forward(sender))
    try:
        _read_commands(commands.fileno(), loop, sender)
    finally:
        loop.stop()
        sender.close()


def _read_commands(fd: int, loop: StepLoop, sender: _Sender) -> None:
    """Run the gateway's commands as they come, until ``Stop`` or the pipe's end."""
    frames = Frames()
    while True:
        try:
            data = os.read(fd, _READ_SIZE)
        except OSError:
            return
        if not data:
            return
        for raw in frames.feed(data):
            for command in decode(raw):
                if isinstance(command, Stop):
                    return
                _run_command(loop, sender, command)


def _run_command(loop: StepLoop, sender: _Sender, command: Command) -> None:
    """One gateway command; its reply goes back once the step thread has run it."""
    future: Future[Any]
    if isinstance(command, Submit):
        future = loop.submit(command.request)
    elif isinstance(command, Abort):
        future = loop.abort(command.request_id)
    elif isinstance(command, Reconfigure):
        future = loop.reconfigure(command.changes)
    elif isinstance(command, Ping):
        future = loop.ping()
    else:
        raise ValueError(f"unknown command {type(command).__name__}")
    tag, settings = command.tag, isinstance(command, Reconfigure)

    def reply(f: Future[Any]) -> None:
        error = portable(f.exception())
        result = f.result() if error is None else None
        sender.put(Reply(tag, result, error, loop.snapshot if settings else None))

    future.add_done_callback(reply)
