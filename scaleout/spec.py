"""What the ingress sends a replica: how to build it, and each request."""

from __future__ import annotations

from dataclasses import dataclass

from core.sched.config import SchedulerConfig
from core.sched.request import Request


@dataclass(slots=True, frozen=True)
class ReplicaSpec:
    """How each replica builds its engine (plain values: the ingress imports no torch)."""

    scheduler: SchedulerConfig
    sim: bool = False  # the cost-model runner, in real time (tests, and routers without a model)
    sim_time_scale: float = 1.0
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    threads: int = 1  # torch threads per replica
    kv_cache_gib: float = 2.0
    stats_period_s: float = 0.25  # how often Serve collects each replica's routing stats


@dataclass(slots=True)
class Job:
    """One request for a replica. ``config``: the settings the ingress last
    set (``PUT /api/config``), applied first if the replica lags behind."""

    request: Request
    config: SchedulerConfig
    config_version: int
    traceparent: str | None = None  # the request's root span, for the replica's own span
