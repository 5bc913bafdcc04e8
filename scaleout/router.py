"""stallfree's router inside Ray Serve's request-router API.

Serve runs the router in the process holding the deployment handle, i.e. the
gateway: ``choose_replicas`` hashes the prompt's blocks and asks the policy
(``core.cluster.router``) for a replica, using each replica's latest
``record_routing_stats``, which it also posts on the process's board
(``scaleout.board``) for ``/metrics``, ``/readyz`` and the dashboard.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from core.analysis.cost_model import CostModel
from core.cluster.router import Prompt, make_router
from core.cluster.stats import ReplicaStats, prompt_hashes
from scaleout.board import Board


def _board() -> Board:
    """The gateway process's board, looked up when called: Serve ships this
    class to the handle by value, with its own copy of this module's globals."""
    from scaleout import board

    return board.BOARD


class StallfreeRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, router: str = "cost", cost: CostModel | None = None, **_: Any) -> None:
        # a report taken before a request reached the replica does not count it yet
        self.policy = _board().router = make_router(router, cost or CostModel(), settle_reports=2)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        _board().report(replicas)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        _board().report(list(self.curr_replicas.values()))
        if pending_request is None or not pending_request.args or not candidate_replicas:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True
        job = pending_request.args[0]
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        head = job.request.prefill_after
        if head is not None and _board().placed.get(head) in by_name:  # choices of one prompt share its KV
            name = _board().placed[head]
        else:
            stats = [_board().stats.get(n) or ReplicaStats(n) for n in by_name]
            block_size = stats[0].block_size
            tokens = job.request.prompt_token_ids
            name = self.policy.choose(Prompt(len(tokens), prompt_hashes(tokens, block_size)), stats)
        _board().place(job.request.request_id, name)
        chosen = by_name[name]
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]
