"""The wire between the gateway and an engine process of its own: the typed
messages each side sends, and how they are framed.

Gateway -> engine: ``Submit``, ``Abort``, ``Reconfigure`` and ``Ping``, each
answered by one ``Reply`` with its tag, and ``Stop``. Engine -> gateway:
``Ready`` or ``StartFailed`` once, then each iteration's ``Step``, the
``Reply`` to every command and ``Fatal``, in the order the engine produced
them. A frame is the length (8 bytes, network order) of a pickled list of
messages, then that pickle: one write carries whatever piled up.

Both ends read without trusting a frame to arrive whole (``Frames``); the
gateway writes without blocking (``gateway.engine.process``), the engine
with (``core.sched.engine_process``).
"""

from __future__ import annotations

import os
import pickle
import struct
from dataclasses import dataclass, field
from typing import Any

from stallfree.core.sched.engine import EngineSnapshot, StepOutput
from stallfree.core.sched.request import Request

_HEADER = struct.Struct("!Q")


# -- gateway -> engine --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Submit:
    tag: int
    request: Request  # sent once: what comes back is each iteration's outputs and, at its end, a RequestEnd


@dataclass(frozen=True, slots=True)
class Abort:
    tag: int
    request_id: str


@dataclass(frozen=True, slots=True)
class Reconfigure:
    tag: int
    changes: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Ping:
    """Answered by the step thread between two iterations: its reply shows that
    the command reader, the step thread and the sender all still move."""

    tag: int


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Command = Submit | Abort | Reconfigure | Ping | Stop


# -- engine -> gateway --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ready:
    snapshot: EngineSnapshot
    name: str  # the model's, as the API reports it
    facts: dict[str, object] = field(default_factory=dict)  # what the start-up log says of the engine


@dataclass(frozen=True, slots=True)
class StartFailed:
    reason: str


@dataclass(frozen=True, slots=True)
class Step:
    output: StepOutput


@dataclass(frozen=True, slots=True)
class Reply:
    tag: int
    result: Any = None
    error: BaseException | None = None
    snapshot: EngineSnapshot | None = None  # after a settings change: the caller reads it once answered


@dataclass(frozen=True, slots=True)
class Fatal:
    reason: str


Message = Ready | StartFailed | Step | Reply | Fatal


# -- frames ---------------------------------------------------------------------
def frame(messages: list[Any]) -> bytes:
    """Messages as one frame: the pickle's length, then the pickle."""
    data = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def write_frame(fd: int, messages: list[Any]) -> None:
    """One frame on a blocking pipe, whole."""
    view = memoryview(frame(messages))
    while view:
        view = view[os.write(fd, view) :]


class Frames:
    """Whole frames out of whatever bytes have arrived on a pipe."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The frames ``data`` completes, still pickled (``decode`` each)."""
        self.buffer += data
        frames = []
        start = 0
        while len(self.buffer) - start >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self.buffer, start)
            if len(self.buffer) - start < _HEADER.size + n:
                break
            frames.append(bytes(self.buffer[start + _HEADER.size : start + _HEADER.size + n]))
            start += _HEADER.size + n
        del self.buffer[:start]
        return frames


def decode(data: bytes) -> list[Any]:
    """A frame's messages."""
    messages: list[Any] = pickle.loads(data)
    return messages


def portable(exc: BaseException | None) -> BaseException | None:
    """The exception as the other side can unpickle it (one whose constructor
    takes other arguments than its message cannot be: then a RuntimeError)."""
    if exc is None:
        return None
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc
