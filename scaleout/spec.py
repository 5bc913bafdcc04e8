"""What the ingress and the replicas send each other."""

from __future__ import annotations

from dataclasses import dataclass

from stallfree.core.sched.config import SchedulerConfig
from stallfree.core.sched.engine import RequestOutput
from stallfree.core.sched.request import Request, Timeline


@dataclass(slots=True, frozen=True)
class ReplicaSpec:
    """How each replica builds its engine (plain values: the ingress imports no torch)."""

    scheduler: SchedulerConfig
    sim: bool = False  # the cost-model runner, in real time (tests, and routers without a model)
    sim_time_scale: float = 1.0
    sim_read_context: bool = False  # sampled tokens hash the KV read back (tests of KV transfer)
    model: str | None = None
    dtype: str = "auto"
    compute: str = "float"  # --compute
    kv_dtype: str = "auto"  # --kv-dtype
    device: str = "auto"
    threads: int = 1  # torch threads per replica
    kv_cache_gib: float = 2.0
    stats_period_s: float = 0.25  # how often Serve collects each replica's routing stats


@dataclass(slots=True)
class Job:
    """One request for a replica. ``config``: the settings the ingress last
    set (``PUT /api/config``), applied first if the replica lags behind."""

    request: Request
    ingress: str  # whose feed carries its outputs
    config: SchedulerConfig
    config_version: int
    traceparent: str | None = None  # the request's root span, for the replica's own span
    kv: Handoff | None = None  # disaggregated: its prompt's KV, computed on a prefill replica
    kv_fetch_ms: float = 0.0  # (set by the decode replica: how long fetching that KV took)


@dataclass(slots=True, frozen=True)
class Handoff:
    """A prompt's KV, computed on a prefill replica: what a decode replica
    needs to take the request over (the KV of all but its last prompt token)."""

    replica: str  # the prefill replica
    tokens: int  # whose KV the payload holds: the prompt's first ``tokens``
    ticket: object  # the payload's, from the transport (``scaleout.transfer``)
    timeline: Timeline  # there, on the wall clock: its queue wait and chunks join the decode replica's


@dataclass(slots=True, frozen=True)
class Feed:
    """Open an ingress's output stream on one replica (the router sends it there)."""

    ingress: str
    replica: str


@dataclass(slots=True, frozen=True)
class Abort:
    request_id: str
    replica: str  # where it runs (the router sends it there)


# What a feed carries, one message per iteration (or a few, when the ingress
# fell behind): each iteration's outputs for this ingress and when, on the
# wall clock, the iteration ended.
FeedMessage = list[tuple[list[RequestOutput], int]]
