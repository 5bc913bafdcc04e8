"""The waiting queue: requests given to the scheduler and not yet admitted (or
preempted back), in the order they joined it.

Each iteration asks it two questions before any ordering: is any prompt
waiting longer than the starvation ceiling (its oldest arrival), and is any
longer than one iteration takes (its most tokens still to prefill). With
thousands waiting, a scan for each cost an iteration milliseconds
(bench.simulator.scheduling_cost), so both are answered from heaps kept as
requests join, in O(log n) amortised: an entry whose request has left is
dropped when it reaches the top. A waiting request's arrival and tokens
still to prefill do not change while it waits (a preempted one's computed
tokens are zeroed before it joins).

Removal is by request id, in O(1). The policies' orders are computed from
this order (``core.sched.policy.order_waiting``): a stable sort keeps it
among equals, so a request joining at the front (``add_first``: a partial
prefill that yielded its slot) goes before those it ties with.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator

from stallfree.core.sched.forecast import WaitingPlaces
from stallfree.core.sched.request import Request


class WaitingQueue:
    def __init__(self) -> None:
        self._front: dict[str, Request] = {}  # joined at the front: the latest first
        self._back: dict[str, Request] = {}  # joined at the back: the earliest first
        self._stamp: dict[str, int] = {}  # request id -> its entries' stamp while it waits
        self._stamps = itertools.count()
        self._by_arrival: list[tuple[int, int, str]] = []  # (arrival_ns, stamp, id), min first
        self._by_pending: list[tuple[int, int, str]] = []  # (-tokens to prefill, stamp, id), most first
        self.places = WaitingPlaces()  # where each stands in admission's forecast

    def add(self, req: Request) -> None:
        """Join at the back."""
        self._back[req.request_id] = req
        self._track(req)

    def add_first(self, req: Request) -> None:
        """Join at the front, ahead of everyone waiting."""
        self._front[req.request_id] = req
        self._track(req)

    def remove(self, req: Request) -> None:
        """Leave (admitted, finished); nothing if it was not waiting."""
        rid = req.request_id
        self.places.remove(req)
        if self._back.pop(rid, None) is None:
            self._front.pop(rid, None)
        self._stamp.pop(rid, None)

    def remove_all(self, reqs: Iterable[Request]) -> None:
        for req in reqs:
            self.remove(req)

    def oldest_arrival_ns(self) -> int | None:
        """The earliest arrival among the waiting (None: nobody waits)."""
        return self._top(self._by_arrival)

    def most_pending_tokens(self) -> int:
        """The most tokens any waiting request has still to prefill (0: nobody waits)."""
        top = self._top(self._by_pending)
        return -top if top is not None else 0

    def __contains__(self, req: object) -> bool:
        return isinstance(req, Request) and req.request_id in self._stamp

    def __len__(self) -> int:
        return len(self._stamp)

    def __iter__(self) -> Iterator[Request]:
        yield from reversed(self._front.values())
        yield from self._back.values()

    def _track(self, req: Request) -> None:
        rid = req.request_id
        self.places.add(req)
        stamp = self._stamp[rid] = next(self._stamps)
        heapq.heappush(self._by_arrival, (req.arrival_ns, stamp, rid))
        heapq.heappush(self._by_pending, (-req.num_pending_tokens, stamp, rid))
        if len(self._by_arrival) > 2 * len(self._stamp) + 64:  # mostly departed entries: rebuild
            self._by_arrival = [e for e in self._by_arrival if self._stamp.get(e[2]) == e[1]]
            self._by_pending = [e for e in self._by_pending if self._stamp.get(e[2]) == e[1]]
            heapq.heapify(self._by_arrival)
            heapq.heapify(self._by_pending)

    def _top(self, heap: list[tuple[int, int, str]]) -> int | None:
        """The key of the heap's first entry whose request still waits, dropping those that left."""
        while heap:
            key, stamp, rid = heap[0]
            if self._stamp.get(rid) == stamp:
                return key
            heapq.heappop(heap)
        return None
