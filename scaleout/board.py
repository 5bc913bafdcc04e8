"""The gateway process's view of the replicas, as their last reports said.

Serve's router (``scaleout.request_router``) posts each replica's routing report
on its pool's board; ``RemoteEngine`` reads the boards for counts,
readiness, metrics and the dashboard's iterations.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import RunningReplica

from stallfree.core.cluster.router import Router
from stallfree.core.cluster.stats import ReplicaStats
from stallfree.core.sched.batch import IterationRecord

PLACED_KEPT = 65536  # request -> replica entries kept (choices of one prompt must meet on one replica)


@dataclass(slots=True)
class Board:
    """Reports, and where each request went (for choices that must meet on one replica)."""

    stats: dict[str, ReplicaStats] = field(default_factory=dict)
    iterations: list[tuple[str, IterationRecord]] = field(default_factory=list)  # not yet shown
    placed: OrderedDict[str, str] = field(default_factory=OrderedDict)  # request id -> replica
    router: Router | None = None

    def report(self, replicas: list[RunningReplica]) -> None:
        names = set()
        for r in replicas:
            name = r.replica_id.unique_id
            names.add(name)
            rs: dict[str, Any] = r.routing_stats or {}
            stats = rs.get("stats")
            if not isinstance(stats, ReplicaStats):
                self.stats.setdefault(name, ReplicaStats(name))
                continue
            if stats.seq > self.stats.get(name, ReplicaStats(name)).seq:
                self.stats[name] = stats
                self.iterations += [(name, it) for it in rs.get("iterations", ())]
        for gone in set(self.stats) - names:
            self.forget(gone)

    def forget(self, replica: str) -> None:
        """A replica is gone (until a new report says otherwise)."""
        self.stats.pop(replica, None)
        if self.router is not None:
            self.router.forget(replica)

    def clear(self) -> None:
        """Forget everything (the replicas are gone: Serve was shut down)."""
        self.stats.clear()
        self.iterations.clear()
        self.placed.clear()
        self.router = None

    def place(self, request_id: str, replica: str) -> None:
        self.placed[request_id] = replica
        self.placed.move_to_end(request_id)
        while len(self.placed) > PLACED_KEPT:
            self.placed.popitem(last=False)


# one per pool: "engine", the replicas whose feeds stream tokens (colocated, or
# the decode pool), and "prefill", disaggregated serving's prefill pool
BOARDS = {"engine": Board(), "prefill": Board()}
BOARD, PREFILL_BOARD = BOARDS["engine"], BOARDS["prefill"]
