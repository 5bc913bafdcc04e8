"""stallfree's router inside Ray Serve's request-router API.

Serve runs the router in the process holding the deployment handle, i.e. the
gateway. A feed or an abort names its replica and goes there. For a request,
``choose_replicas`` hashes the prompt's blocks and asks the policy
(``core.cluster.router``) for a replica, using each replica's latest
``record_routing_stats``, which it also posts on the process's board
(``scaleout.board``) for ``/metrics``, ``/readyz`` and the dashboard.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from stallfree.core.analysis.cost_model import CostModel
from stallfree.core.cluster.router import Prompt, make_router
from stallfree.core.cluster.stats import ReplicaStats, prompt_hashes
from stallfree.scaleout.board import Board
from stallfree.scaleout.spec import Abort, Feed


def _board(pool: str) -> Board:
    """The gateway process's board, looked up when called: Serve ships this
    class to the handle by value, with its own copy of this module's globals."""
    from stallfree.scaleout import board

    return board.BOARDS[pool]


class StallfreeRequestRouter(RequestRouter):
    """No FIFOMixin: it hands a chosen replica to the oldest waiting call,
    which breaks calls routed to one named replica (a feed, an abort)."""

    def initialize_state(
        self, router: str = "cost", cost: CostModel | None = None, pool: str = "engine", **_: Any
    ) -> None:
        self.pool = pool
        # a report taken before a request reached the replica does not count it yet
        self.policy = _board(pool).router = make_router(router, cost or CostModel(), settle_reports=2)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        _board(self.pool).report(replicas)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None or not pending_request.args or not candidate_replicas:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True
        call = pending_request.args[0]
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        if isinstance(call, Feed | Abort):  # for one replica only: wait while it is unavailable
            return [[by_name[call.replica]]] if call.replica in by_name else []
        board = _board(self.pool)
        head = call.request.prefill_after
        if head is not None and board.placed.get(head) in by_name:  # choices of one prompt share its KV
            name = board.placed[head]
        else:
            stats = [board.stats.get(n) or ReplicaStats(n) for n in by_name]
            tokens, salt = call.request.prompt_token_ids, call.request.cache_salt
            name = self.policy.choose(Prompt(len(tokens), prompt_hashes(tokens, stats[0].block_size, salt)), stats)
        board.place(call.request.request_id, name)
        chosen = by_name[name]
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]
