"""Per-request output streams on the event loop.

Each request has a bounded anyio memory object stream. The step thread's
once-per-iteration fan-out puts one ``Delta`` per request per iteration;
when the consumer has fallen behind and the stream is full, new tokens
coalesce into a single pending delta instead of blocking anybody, and a
consumer whose pending tokens stay unread for ``slow_consumer_s`` is cut off.

Both ends of the memory stream are closed once the final delta is through
(anyio warns about every unclosed end); a consumer that gives up early
calls ``close()``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from core.sched.batch import Logprobs
from core.sched.request import FinishReason, Request


@dataclass(slots=True)
class Delta:
    token_ids: list[int]
    first_index: int  # index of token_ids[0] in the completion
    emit_ns: int  # engine time (perf_counter_ns) the last of these tokens was produced
    finish_reason: FinishReason | None = None
    request: Request | None = None  # on finish: the request's timeline and usage
    logprobs: list[Logprobs] | None = None  # one per token, when the request asked


class RequestStream:
    def __init__(self, request_id: str, capacity: int, slow_consumer_s: float) -> None:
        self.request_id = request_id
        self._send, self._recv = anyio.create_memory_object_stream[Delta](capacity)
        self._pending: Delta | None = None  # coalesced overflow
        self._pending_since = 0
        self._slow_ns = int(slow_consumer_s * 1e9)
        self.num_tokens = 0
        self.finished = False
        self.last_emit_ns = 0  # engine time of the previous tokens (for inter-token gaps)
        # called after every put: lets one task per connection drain many streams
        self.on_put: Callable[[], None] | None = None

    def put(
        self,
        token_ids: list[int],
        emit_ns: int,
        finish_reason: FinishReason | None,
        request: Request | None,
        logprobs: list[Logprobs] | None = None,
    ) -> bool:
        """Called on the event loop; never blocks. False: the consumer is hopelessly behind."""
        if self.finished:
            return True  # includes a consumer that has gone (close())
        ok = self._enqueue(Delta(token_ids, self.num_tokens, emit_ns, finish_reason, request, logprobs))
        if self.on_put is not None:
            self.on_put()
        return ok

    def _enqueue(self, delta: Delta) -> bool:
        self.num_tokens += len(delta.token_ids)
        self.finished = delta.finish_reason is not None
        ok = True
        if self._pending is None:
            try:
                self._send.send_nowait(delta)
            except anyio.WouldBlock:
                self._pending, self._pending_since = delta, time.perf_counter_ns()
        else:
            p = self._pending
            p.token_ids = p.token_ids + delta.token_ids
            if delta.logprobs is not None:
                p.logprobs = (p.logprobs or []) + delta.logprobs
            p.emit_ns, p.finish_reason, p.request = delta.emit_ns, delta.finish_reason, delta.request
            ok = self.finished or time.perf_counter_ns() - self._pending_since < self._slow_ns
        if self.finished:
            self._send.close()  # nothing follows the final delta
        return ok

    def fail(self, reason: FinishReason) -> None:
        """End the stream now (unsent overflow dropped): the consumer sees reason next."""
        if self.finished:
            return
        self.finished = True
        delta = Delta([], self.num_tokens, time.perf_counter_ns(), reason)
        if self._pending is not None:
            self._pending = delta
        else:
            try:
                self._send.send_nowait(delta)
            except anyio.WouldBlock:
                self._pending = delta
        self._send.close()
        if self.on_put is not None:
            self.on_put()

    def get_nowait(self) -> Delta | None:
        """The next delta, or None if there is none yet."""
        delta: Delta | None
        try:
            delta = self._recv.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream):  # EndOfStream: the final delta may be pending
            delta, self._pending = self._pending, None
        return self._taken(delta) if delta is not None else None

    async def get(self) -> Delta:
        delta = self.get_nowait()
        return delta if delta is not None else self._taken(await self._recv.receive())

    def _taken(self, delta: Delta) -> Delta:
        if delta.finish_reason is not None:
            self.close()
        return delta

    def close(self) -> None:
        """The consumer has its final delta or has gone: release both ends; later puts are ignored."""
        self.finished = True
        self._send.close()
        self._recv.close()
