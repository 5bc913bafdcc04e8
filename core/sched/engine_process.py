"""The engine process's side of ``gateway.engine.process.EngineProcess``: the
step loop in a process of its own (vLLM V1's EngineCore shape).

Why: in one process the step thread and the event loop share one interpreter
lock. Every torch op hands the lock back and takes it again, and while the
loop fans out tokens, encodes and writes frames, the step thread waits for it.
Here the engine's process runs the same ``StepLoop`` on its own core and lock,
whatever the gateway is doing; the gateway's process keeps the event loop and
the per-user queues. On the 2-core Zen 4 both ways ran decode iterations at
0.94-1.19x the engine's alone (bench/results/server_overhead-*.md).

The wire: two pipes (one each way) of length-prefixed, pickled lists of messages. Gateway → engine: ``submit``,
``abort``, ``reconfigure``, ``stop``. Engine → gateway: each iteration's
``StepOutput`` (one message an iteration), the replies to commands and
``fatal``, in the order the step thread produced them. A sender thread in the
engine writes them, so a slow gateway never holds up an iteration: what piles
up meanwhile goes out in one write. The gateway reads the pipe on its event
loop (``add_reader``), with no thread of its own; ``Frames`` cuts what it
reads into messages.

Failure: the engine process that exits or crashes closes the pipe, and the
gateway hears ``on_fatal`` (every stream gets its error, the server exits
non-zero); a hung iteration shows in ``busy_since_ns`` (shared memory), which
the gateway's watchdog reads as for a thread. The engine process dies with
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
import pickle
import queue
import signal
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import structlog

from stallfree.core.sched.engine import Engine, StepOutput
from stallfree.core.sched.step_loop import StepLoop

log = structlog.get_logger(__name__)

_PR_SET_PDEATHSIG = 1
_HEADER = struct.Struct("!Q")


@dataclass(slots=True)
class BuiltEngine:
    """What an engine factory returns in the engine process: the engine and
    what the gateway's start-up log says of it."""

    engine: Engine
    name: str  # the model's, as the API reports it
    facts: dict[str, object] = field(default_factory=dict)


# -- the engine's process ----------------------------------------------------------
class _Sender:
    """Writes the engine's messages to the pipe on a thread of its own: what
    piles up while the gateway is slow goes out in one write."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.box: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="stallfree-engine-send", daemon=True)
        self.thread.start()

    def put(self, message: tuple[Any, ...]) -> None:
        self.box.put(message)

    def close(self) -> None:
        self.box.put(None)
        self.thread.join(10)

    def _run(self) -> None:
        while True:
            batch = [self.box.get()]
            while True:
                try:
                    batch.append(self.box.get_nowait())
                except queue.Empty:
                    break
            last = batch[-1] is None
            messages = [m for m in batch if m is not None]
            try:
                data = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # a bug: die loudly, and the gateway fails every stream
                log.critical("engine_message_unpicklable", exc_info=True)
                os._exit(1)
            try:
                if messages:
                    _write_frame(self.fd, data)
            except OSError:  # the gateway is gone: so is the reason to run
                os._exit(0)
            if last:
                return


def _write_frame(fd: int, data: bytes) -> None:
    """One message on the engine's pipe: its length, then its bytes (blocking)."""
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


class Frames:
    """The gateway's end of the engine's pipe, read without blocking: whole
    messages out of whatever bytes have arrived."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self.buffer += data
        frames = []
        while len(self.buffer) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self.buffer)
            if len(self.buffer) < _HEADER.size + n:
                break
            frames.append(bytes(self.buffer[_HEADER.size : _HEADER.size + n]))
            del self.buffer[: _HEADER.size + n]
        return frames


class _Forward:
    """The step loop's listener in the engine process: everything to the sender."""

    def __init__(self, sender: _Sender) -> None:
        self.sender = sender

    def on_step(self, out: StepOutput) -> None:
        self.sender.put(("step", out))

    def on_fatal(self, reason: str) -> None:
        self.sender.put(("fatal", reason))


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
) -> None:
    """The engine process's target: build, report ready, then run ``commands``
    until told to stop; every message back goes on ``out``."""
    out_fd = out.fileno()
    _die_with_parent()
    # Ctrl-C and a supervisor's SIGTERM reach the whole group: the gateway drains, then stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        built = factory()
    except BaseException as exc:
        _write_frame(out_fd, pickle.dumps([("failed", f"{type(exc).__name__}: {exc}")]))
        return
    loop = StepLoop(built.engine, times)
    gc.collect()
    gc.freeze()  # the model and tables out of the collector's way, as in the gateway
    _write_frame(out_fd, pickle.dumps([("ready", loop.snapshot, built.name, built.facts)]))
    sender = _Sender(out_fd)
    loop.start(_Forward(sender))
    try:
        while True:
            try:
                messages = pickle.loads(commands.recv_bytes())
            except (EOFError, OSError):
                break
            if not all(_run_command(loop, sender, m) for m in messages):
                break
    finally:
        loop.stop()
        sender.close()


def _run_command(loop: StepLoop, sender: _Sender, message: tuple[Any, ...]) -> bool:
    """One gateway command; False: stop."""
    kind = message[0]
    if kind == "stop":
        return False
    tag = message[1]
    if kind == "submit":
        future: Future[Any] = loop.submit(message[2])
    elif kind == "abort":
        future = loop.abort(message[2])
    elif kind == "reconfigure":
        future = loop.reconfigure(message[2])
    else:
        raise ValueError(f"unknown command {kind!r}")

    def reply(f: Future[Any]) -> None:
        exc = _portable(f.exception())
        snapshot = loop.snapshot if kind == "reconfigure" else None
        sender.put(("reply", tag, exc, None if exc is not None else f.result(), snapshot))

    future.add_done_callback(reply)
    return True


def _portable(exc: BaseException | None) -> BaseException | None:
    """The exception as the gateway can unpickle it (one whose constructor
    takes other arguments than its message cannot be: then a RuntimeError)."""
    if exc is None:
        return None
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc
