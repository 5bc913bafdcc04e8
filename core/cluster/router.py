"""Which replica gets a prompt.

``cost`` predicts each replica's TTFT for this prompt with the fitted cost
model: the prefill work already queued there plus this prompt's tokens that
its prefix cache does not hold, at the chunk size its running decodes leave
in the token budget. The lowest prediction wins, ties go to more free KV, and
a replica without KV room for the prompt comes last. ``prefix`` is plain
cache affinity (the longest cached prefix, ties to the least loaded), as
SGLang's and Ray Serve's prefix routers do. ``least_loaded`` and
``round_robin`` ignore the cache.

Stats arrive periodically, so each router also counts what it sent since a
replica's last report (load, prompt tokens, block hashes) until the reports
include it. When loads grow too uneven (stale stats can herd every prompt
onto one replica) ``cost`` and ``prefix`` fall back to power of two choices.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from stallfree.core.analysis.cost_model import CostModel
from stallfree.core.cluster.stats import ReplicaStats


class RouterName(StrEnum):
    COST = "cost"
    PREFIX = "prefix"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


ROUTERS = tuple(r.value for r in RouterName)


@dataclass(slots=True, frozen=True)
class Prompt:
    num_tokens: int
    hashes: Sequence[bytes]  # its full blocks' chain hashes (``prompt_hashes``)


@dataclass(slots=True)
class _Sent:
    seq: int  # the replica's report sequence number when this was sent
    tokens: int  # prompt tokens its cache did not hold
    blocks: int
    hashes: Sequence[bytes]


@dataclass(slots=True)
class View:
    """A replica's last report plus what this router sent it since."""

    stats: ReplicaStats
    sent: list[_Sent] = field(default_factory=list)

    @property
    def load(self) -> int:
        return self.stats.load + len(self.sent)

    @property
    def queued_tokens(self) -> int:
        return self.stats.queued_prefill_tokens + sum(s.tokens for s in self.sent)

    @property
    def free_blocks(self) -> int:
        return self.stats.kv_free_blocks - sum(s.blocks for s in self.sent)

    def matched_blocks(self, hashes: Sequence[bytes]) -> int:
        n = self.stats.matched_blocks(hashes)
        for s in self.sent:  # prompts on their way there share prefixes too
            m = 0
            for a, b in zip(hashes, s.hashes, strict=False):
                if a != b:
                    break
                m += 1
            n = max(n, m)
        return n


class Router:
    """Base: the bookkeeping of sent work and the imbalance fallback."""

    name: RouterName

    def __init__(
        self,
        seed: int = 0,
        settle_reports: int = 1,
        imbalance_requests: int = 32,
        imbalance_ratio: float = 2.0,
    ) -> None:
        self.rng = random.Random(seed)
        self.settle_reports = settle_reports  # reports after a send before they include it
        self.imbalance_requests = imbalance_requests
        self.imbalance_ratio = imbalance_ratio
        self.fallbacks = 0  # decisions made by power of two choices
        self._views: dict[str, View] = {}

    def choose(self, prompt: Prompt, replicas: Sequence[ReplicaStats]) -> str:
        """The name of the replica that gets ``prompt``; it is counted as sent there."""
        if not replicas:
            raise LookupError("no replica is available")
        views = [self._view(s) for s in replicas]
        if len(views) > 1 and self.name in (RouterName.COST, RouterName.PREFIX) and self._imbalanced(views):
            self.fallbacks += 1
            a, b = self.rng.sample(views, 2)
            pick = a if a.load <= b.load else b
        else:
            pick = self._pick(prompt, views)
        bs = pick.stats.block_size
        matched = pick.matched_blocks(prompt.hashes)
        uncached = max(1, prompt.num_tokens - matched * bs)
        pick.sent.append(_Sent(pick.stats.seq, uncached, -(-uncached // bs), prompt.hashes))
        return pick.stats.replica

    def forget(self, replica: str) -> None:
        """A replica left (died or scaled down)."""
        self._views.pop(replica, None)

    def _view(self, stats: ReplicaStats) -> View:
        view = self._views.get(stats.replica)
        if view is None:
            view = self._views[stats.replica] = View(stats)
        view.stats = stats
        view.sent = [s for s in view.sent if stats.seq - s.seq < self.settle_reports]
        return view

    def _imbalanced(self, views: list[View]) -> bool:
        loads = [v.load for v in views]
        lo, hi = min(loads), max(loads)
        return hi - lo > self.imbalance_requests and hi > self.imbalance_ratio * lo

    def _least_loaded(self, views: list[View]) -> View:
        low = min(v.load for v in views)
        return self.rng.choice([v for v in views if v.load == low])

    def _pick(self, prompt: Prompt, views: list[View]) -> View:
        raise NotImplementedError


class RoundRobin(Router):
    name = RouterName.ROUND_ROBIN

    def __init__(self, seed: int = 0, settle_reports: int = 1) -> None:
        super().__init__(seed, settle_reports)
        self._next = 0

    def _pick(self, prompt: Prompt, views: list[View]) -> View:
        self._next += 1
        return views[(self._next - 1) % len(views)]


class LeastLoaded(Router):
    name = RouterName.LEAST_LOADED

    def _pick(self, prompt: Prompt, views: list[View]) -> View:
        return self._least_loaded(views)


class PrefixAffinity(Router):
    name = RouterName.PREFIX

    def _pick(self, prompt: Prompt, views: list[View]) -> View:
        matched = {id(v): v.matched_blocks(prompt.hashes) for v in views}
        best = max(matched.values())
        if best == 0:
            return self._least_loaded(views)
        return self._least_loaded([v for v in views if matched[id(v)] == best])


class CostAware(Router):
    name = RouterName.COST

    def __init__(self, cost: CostModel, seed: int = 0, settle_reports: int = 1) -> None:
        super().__init__(seed, settle_reports)
        self.cost = cost

    def predict_ttft_s(self, prompt: Prompt, view: View) -> float:
        """Prefill time of the work queued ahead plus this prompt's uncached
        tokens, in chunks of what the running decodes leave of the budget."""
        s = view.stats
        uncached = max(1, prompt.num_tokens - view.matched_blocks(prompt.hashes) * s.block_size)
        work = view.queued_tokens + uncached
        decoding = s.decoding
        chunk = max(1, s.token_budget - decoding)
        iteration = self.cost.iteration_s([s.mean_context] * decoding, [(0, min(work, chunk))])
        return math.ceil(work / chunk) * iteration

    def _pick(self, prompt: Prompt, views: list[View]) -> View:
        def key(v: View) -> tuple[bool, float, int, int, float]:
            need = -(-prompt.num_tokens // v.stats.block_size) - v.matched_blocks(prompt.hashes)
            return (need > v.free_blocks, self.predict_ttft_s(prompt, v), v.load, -v.free_blocks, self.rng.random())

        return min(views, key=key)


def make_router(name: str, cost: CostModel | None = None, seed: int = 0, settle_reports: int = 1) -> Router:
    if name == RouterName.COST:
        return CostAware(cost or CostModel(), seed, settle_reports)
    kinds: dict[str, type[Router]] = {
        RouterName.PREFIX: PrefixAffinity,
        RouterName.LEAST_LOADED: LeastLoaded,
        RouterName.ROUND_ROBIN: RoundRobin,
    }
    if name not in kinds:
        raise ValueError(f"unknown router {name!r} ({', '.join(ROUTERS)})")
    return kinds[name](seed, settle_reports)
