"""Fault injection for tests: raise at a named point on a chosen call.

Off unless a test arms a point; then ``point(name)`` costs one dict lookup.
The points: ``schedule`` and ``update`` (the scheduler), ``allocate`` (the
block manager), ``sample`` (the runners' sampling) and ``fan_out`` (the
gateway's delivery of one request's output). Tests use them to show that a
fault anywhere in an iteration fails only the requests it touched.

A server process is armed from the environment, for tests that need the
process itself: ``STALLFREE_FAULTS=sample:0:100`` (point:after:times, comma
separated).
"""

from __future__ import annotations

import os
import threading

POINTS = ("schedule", "update", "allocate", "sample", "fan_out")

_armed: dict[str, list[int]] = {}  # point -> [calls to let pass, times to raise]
_lock = threading.Lock()


class InjectedFault(RuntimeError):
    """Raised by an armed point; nothing in production raises it."""


def arm(name: str, after: int = 0, times: int = 1) -> None:
    """Let ``after`` calls of point ``name`` pass, then raise on the next ``times``."""
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}; one of {', '.join(POINTS)}")
    with _lock:
        _armed[name] = [after, times]


def disarm() -> None:
    with _lock:
        _armed.clear()


def point(name: str) -> None:
    if not _armed:
        return
    with _lock:
        state = _armed.get(name)
        if state is None:
            return
        if state[0] > 0:
            state[0] -= 1
            return
        state[1] -= 1
        if state[1] <= 0:
            del _armed[name]
    raise InjectedFault(f"injected fault at {name}")


def arm_from_env(value: str | None = None) -> None:
    value = os.environ.get("STALLFREE_FAULTS", "") if value is None else value
    for spec in filter(None, value.split(",")):
        name, after, times, *_ = [*spec.split(":"), "", ""]
        arm(name, int(after or 0), int(times or 1))


arm_from_env()
