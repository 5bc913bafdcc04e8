"""Where each waiting prompt stands in admission's forecast
(``core.sched.deadline.Forecast``), kept as prompts come and go: the forecast
is built every iteration under a TTFT target, and reading every queued
request for it cost the step 20-25 ms with 10,000 waiting
(bench.simulator.scheduling_cost).

A waiting prompt's place is its policy class and its deadline, or infinity
(``Scheduler.forecast``). A prompt is in one of three states here:

- fresh: it has a TTFT target and its deadline is not yet past, so it may
  still meet it: its slack is taken at every forecast. Few are fresh: those
  that arrived within a target's time.
- standing: it has no target, or its deadline is past and it has waited past
  the starvation ceiling: its place is (class, infinity) for as long as it
  waits. Standing prompts are summed per class, so a forecast reads one
  entry per class, however many there are (``Forecast.ahead`` counts the
  tokens of equal places together, summed or not).
- lapsed: its deadline is past (no slack is left) and it has not yet waited
  past the ceiling: left out (late prompts go after any newcomer) until it has.

A waiting prompt's deadline and arrival do not change while it waits, and
time only moves forward, so a prompt moves fresh
-> standing or fresh -> lapsed -> standing, each step once, taken in deadline
order and in arrival order from two heaps. A change of policy or ceiling, or
a clock that goes back, rebuilds the states from the prompts. A prompt's tokens
still to prefill can drop as it leaves (admission records its cached prefix
before the queue lets it go), so a standing prompt leaves its class's sum
by the key and tokens it was summed under.

Sibling choices of one prompt (``prefill_after``) count differently while
their sibling computes, so they are kept apart and read one by one.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from stallfree.core.sched.config import Policy
from stallfree.core.sched.deadline import Pace, Place, deadline_ns, slack_s
from stallfree.core.sched.policy import class_rank, overdue_before
from stallfree.core.sched.request import Request


def forecast_entry(
    r: Request, now_ns: int, pace: Pace, cutoff: int, policy: Policy, served: Mapping[str, int], tokens: int
) -> tuple[Place, int] | None:
    """A queued prompt's entry in the forecast, with the ``tokens`` it counts for:
    its class and deadline while it can meet it; its class and infinity with no
    target, or late but past the starvation ceiling (arrived before ``cutoff``);
    None when it is late (it goes after any newcomer)."""
    due = deadline_ns(r)
    on_time = due is not None and slack_s(r, now_ns, pace) >= 0
    if due is not None and not on_time and r.arrival_ns >= cutoff:
        return None
    rank = class_rank(policy, r.priority, r.tenant, r.num_pending_tokens, served)
    return (rank, due if on_time and due is not None else math.inf), tokens


@dataclass(slots=True)
class ClassSum:
    """The standing prompts of one class: their tokens, how many, and what gives the class
    (priority, tenant, tokens to prefill: the first one's, the same for each as far as the policy looks)."""

    tokens: int
    prompts: int
    looks: tuple[int, str, int]


class WaitingPlaces:
    def __init__(self) -> None:
        self.siblings: dict[str, Request] = {}  # read one by one
        self._fresh: dict[str, Request] = {}
        self._lapsed: dict[str, Request] = {}
        self._standing: dict[str, Request] = {}
        self._stamp: dict[str, int] = {}  # request id -> its heap entries' stamp
        self._stamps = itertools.count()
        self._by_due: list[tuple[int, int, str]] = []  # fresh, (deadline, stamp, id)
        self._by_arrival: list[tuple[int, int, str]] = []  # lapsed, (arrival, stamp, id)
        self._sums: dict[object, ClassSum] = {}  # standing prompts per class key
        # what each standing prompt was summed under (class key, tokens): a prompt's tokens to
        # prefill can drop while it waits (its prefix found in the cache), so removal reads these
        self._summed: dict[str, tuple[object, int]] = {}
        self._policy: Policy | None = None
        self._max_defer_s: float | None = None
        self._now_ns = -math.inf

    def add(self, req: Request) -> None:
        rid = req.request_id
        if req.prefill_after is not None:
            self.siblings[rid] = req
            return
        due = deadline_ns(req)
        if due is None:
            self._stand(req)
            return
        stamp = self._stamp[rid] = next(self._stamps)
        self._fresh[rid] = req
        heapq.heappush(self._by_due, (due, stamp, rid))
        if len(self._by_due) > 2 * len(self._fresh) + 64:  # mostly prompts gone before their deadline
            self._by_due = [e for e in self._by_due if e[2] in self._fresh and self._stamp.get(e[2]) == e[1]]
            heapq.heapify(self._by_due)

    def remove(self, req: Request) -> None:
        rid = req.request_id
        self.siblings.pop(rid, None)
        self._fresh.pop(rid, None)
        self._lapsed.pop(rid, None)
        self._stamp.pop(rid, None)
        self._standing.pop(rid, None)
        if (summed := self._summed.pop(rid, None)) is not None:
            key, tokens = summed
            entry = self._sums[key]
            entry.tokens -= tokens
            entry.prompts -= 1
            if not entry.prompts:
                del self._sums[key]

    def places(
        self, now_ns: int, pace: Pace, policy: Policy, max_defer_s: float, served: Mapping[str, int]
    ) -> list[tuple[Place, int]]:
        """(place, tokens still to prefill) of the waiting prompts that are not
        siblings, standing ones summed per class, as ``Scheduler.forecast`` counts them."""
        if (policy, max_defer_s) != (self._policy, self._max_defer_s) or now_ns < self._now_ns:
            self._rebuild(policy, max_defer_s)
        self._now_ns = now_ns
        cutoff = overdue_before(now_ns, max_defer_s)
        self._advance(now_ns, cutoff)
        out = [((class_rank(policy, *entry.looks, served), math.inf), entry.tokens) for entry in self._sums.values()]
        for r in self._fresh.values():
            entry = forecast_entry(r, now_ns, pace, cutoff, policy, served, r.num_pending_tokens)
            if entry is not None:
                out.append(entry)
        return out

    def _advance(self, now_ns: int, cutoff: int) -> None:
        """Fresh prompts whose deadline has passed lapse (or stand, past the ceiling);
        lapsed ones past the ceiling stand."""
        while self._by_due and self._by_due[0][0] < now_ns:
            _, stamp, rid = heapq.heappop(self._by_due)
            req = self._fresh.pop(rid, None) if self._stamp.get(rid) == stamp else None
            if req is None:
                continue
            if req.arrival_ns < cutoff:
                self._stand(req)
            else:
                self._lapsed[rid] = req
                heapq.heappush(self._by_arrival, (req.arrival_ns, stamp, rid))
        while self._by_arrival and self._by_arrival[0][0] < cutoff:
            _, stamp, rid = heapq.heappop(self._by_arrival)
            req = self._lapsed.pop(rid, None) if self._stamp.get(rid) == stamp else None
            if req is not None:
                self._stand(req)

    def _stand(self, req: Request) -> None:
        self._standing[req.request_id] = req
        if self._policy is None:
            return
        key, tokens = self._key(req), req.num_pending_tokens
        entry = self._sums.setdefault(key, ClassSum(0, 0, (req.priority, req.tenant, tokens)))
        entry.tokens += tokens
        entry.prompts += 1
        self._summed[req.request_id] = (key, tokens)

    def _key(self, req: Request) -> object:
        """What the policy's class depends on (``class_rank``)."""
        if self._policy == Policy.SJF:
            return req.num_pending_tokens
        if self._policy == Policy.PRIORITY:
            return req.priority
        if self._policy == Policy.FAIR:
            return req.tenant
        return None

    def _rebuild(self, policy: Policy, max_defer_s: float) -> None:
        members = [*self._fresh.values(), *self._lapsed.values(), *self._standing.values()]
        self._fresh.clear()
        self._lapsed.clear()
        self._standing.clear()
        self._stamp.clear()
        self._by_due.clear()
        self._by_arrival.clear()
        self._sums.clear()
        self._summed.clear()
        self._policy, self._max_defer_s = policy, max_defer_s
        self._now_ns = -math.inf
        for req in members:
            self.add(req)
