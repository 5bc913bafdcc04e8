"""The one seam between the gateway and whatever runs the engine.

``EngineClient`` drives an ``EngineBackend``, built whole before it: the
step thread of an engine process of its own (``gateway.engine.process.EngineProcess``,
``stallfree serve``'s default), this process's step thread
(``core.sched.step_loop.StepLoop``) or engines on Ray Serve replicas
(``scaleout.remote.RemoteEngine``). The backend reports back
to an ``EngineListener`` (the client), given when it starts.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Protocol

from stallfree.core.cluster.stats import ReplicaStats
from stallfree.core.sched.engine import EngineSnapshot
from stallfree.core.sched.request import Request
from stallfree.core.sched.step_loop import StepListener


class EngineBusy(RuntimeError):
    """A backend cannot take a command now (its engine has not read those it
    was sent): refused at once rather than waited for."""


class EngineListener(StepListener, Protocol):
    """What an ``EngineBackend`` reports to (the ``EngineClient``): a
    ``StepListener``'s ``on_step`` (an iteration's outputs, or requests that
    ended outside one) and ``on_fatal``, but called from any thread, as the
    backend has them: the step thread (``StepLoop``) or the event loop
    (``EngineProcess`` reading its pipe, ``RemoteEngine``). Adds
    ``on_replicas``, always on the event loop."""

    def on_replicas(self, stats: list[ReplicaStats]) -> None:
        """Each replica's latest report (replicas only), on the event loop."""


class EngineBackend(Protocol):
    @property
    def snapshot(self) -> EngineSnapshot:
        """Settings and KV counts as last published (safe to read from any thread)."""

    @property
    def alive(self) -> bool: ...

    @property
    def owed_since_ns(self) -> int:
        """perf_counter_ns when the oldest command the engine has not answered was
        given (0: none; the watchdog's view, with ``busy_predicted_s``)."""

    @property
    def busy_predicted_s(self) -> float:
        """The predicted time of the iteration the engine is running (0: none, or
        nothing predicts it): how long the engine may keep a command waiting."""

    def replica_counts(self) -> tuple[int, int] | None:
        """(ready, configured) replicas; None for one engine in this process."""

    def start(self, listener: EngineListener) -> None:
        """Begin; called on the event loop."""

    def stop(self, timeout: float = 10.0) -> None: ...

    def submit(self, req: Request) -> Future[None]:
        """Queue req, checked by the caller; may raise ``EngineBusy``."""

    def abort(self, request_id: str) -> Future[bool]: ...

    def reconfigure(self, changes: dict[str, Any]) -> Future[list[str]]:
        """Change live settings; may raise ``EngineBusy``."""

    def ping(self) -> Future[None]:
        """A command that does nothing: its answer shows the engine still answers."""
