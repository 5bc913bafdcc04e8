"""Per-request output streams on the event loop.

Each request has a bounded queue of deltas. The event loop's once-per-iteration
fan-out puts one ``Delta`` per request per iteration and calls ``on_put``,
which wakes the request's consumer (one task per connection drains many
streams). When the consumer has fallen behind and the queue is full, new
tokens coalesce into a single pending delta instead of blocking anybody, and
a consumer whose pending tokens stay unread for ``slow_consumer_s`` is cut off.

A plain deque, not an anyio memory stream: put and get are the fan-out's
per-token cost (a memory stream's send was 1.8 us of it, a deque's append
0.1), and there are no channel ends to close however a request ends.

Beside its tokens a stream carries word of the engine itself (a ``Notice``):
that it has stopped answering, and that it answers again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from stallfree.core.sched.batch import Logprobs
from stallfree.core.sched.deadline import Verdict
from stallfree.core.sched.request import FinishReason, RequestEnd


@dataclass(slots=True)
class Delta:
    token_ids: list[int]
    first_index: int  # index of token_ids[0] in the completion
    emit_ns: int  # engine time (perf_counter_ns) the last of these tokens was produced
    finish_reason: FinishReason | None = None
    end: RequestEnd | None = None  # on finish: the request's timeline and usage
    logprobs: list[Logprobs] | None = None  # one per token, when the request asked


@dataclass(slots=True, frozen=True)
class Notice:
    """Word of the engine, for every open stream: ``stalled`` (it has answered
    nothing for ``silent_ms``) or ``resumed`` (it answers again, after ``silent_ms``)."""

    kind: str
    silent_ms: int


class RequestStream:
    def __init__(self, request_id: str, capacity: int, slow_consumer_s: float) -> None:
        self.request_id = request_id
        self.notice: Notice | None = None  # the latest word of the engine, not yet taken
        self.verdict: Verdict | None = None  # admission's prediction of its first token, under a TTFT target
        # up to ``capacity`` deltas, then one more that coalesces the overflow (the pending one)
        self._deltas: deque[Delta] = deque()
        self._capacity = capacity
        self._pending_since = 0  # when the overflow began (0: none); reset once the consumer catches up
        self._slow_ns = int(slow_consumer_s * 1e9)
        self.num_tokens = 0
        self.finished = False  # the final delta is queued, or the consumer has gone
        self.last_emit_ns = 0  # engine time of the previous tokens (for inter-token gaps)
        # called after every put: wakes the consumer
        self.on_put: Callable[[], None] | None = None

    def put(
        self,
        token_ids: list[int],
        emit_ns: int,
        finish_reason: FinishReason | None,
        end: RequestEnd | None,
        logprobs: list[Logprobs] | None = None,
    ) -> bool:
        """Called on the event loop; never blocks. False: the consumer is hopelessly behind."""
        if self.finished:
            return True  # includes a consumer that has gone (close())
        ok = self._enqueue(Delta(token_ids, self.num_tokens, emit_ns, finish_reason, end, logprobs))
        if self.on_put is not None:
            self.on_put()
        return ok

    def _enqueue(self, delta: Delta) -> bool:
        self.num_tokens += len(delta.token_ids)
        self.finished = delta.finish_reason is not None
        if len(self._deltas) < self._capacity:
            self._deltas.append(delta)
            return True
        now = time.perf_counter_ns()
        if not self._pending_since:
            self._pending_since = now
        if len(self._deltas) == self._capacity:
            self._deltas.append(delta)  # the pending delta
            return True
        p = self._deltas[-1]
        p.token_ids = p.token_ids + delta.token_ids
        if delta.logprobs is not None:
            p.logprobs = (p.logprobs or []) + delta.logprobs
        p.emit_ns, p.finish_reason, p.end = delta.emit_ns, delta.finish_reason, delta.end
        return self.finished or now - self._pending_since < self._slow_ns

    def fail(self, reason: FinishReason) -> None:
        """End the stream now (unsent overflow dropped): the consumer sees reason next."""
        if self.finished:
            return
        self.finished = True
        if len(self._deltas) > self._capacity:
            self._deltas.pop()
        self._deltas.append(Delta([], self.num_tokens, time.perf_counter_ns(), reason))
        if self.on_put is not None:
            self.on_put()

    def tell(self, notice: Notice) -> None:
        """Word of the engine for the consumer. A stall and its end, neither yet
        taken, cancel out: the consumer is told nothing it no longer needs."""
        if self.finished:
            return
        pending = self.notice
        self.notice = None if pending is not None and pending.kind != notice.kind else notice
        if self.on_put is not None:
            self.on_put()

    def take_notice(self) -> Notice | None:
        notice, self.notice = self.notice, None
        return notice

    def get_nowait(self) -> Delta | None:
        """The next delta, or None if there is none yet (or the final one has been taken)."""
        if not self._deltas:
            return None
        delta = self._deltas.popleft()
        if not self._deltas:
            self._pending_since = 0  # caught up
        if delta.finish_reason is not None:
            self.close()
        return delta

    def close(self) -> None:
        """The consumer has its final delta or has gone: later puts are ignored."""
        self.finished = True
        self._deltas.clear()
