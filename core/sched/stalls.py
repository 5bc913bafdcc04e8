"""Stall attribution: was a decode's gap stretched by another request's prefill?

The scheduler remembers which requests each recent iteration chunked; a token's
gap is stalled if another's prefill ran after the request's previous token, up
to now. In stall_free mode that is a chunk in this very iteration; unchunked,
it is the whole-prompt iteration the decodes sat out.
"""

from __future__ import annotations

from collections import deque

from stallfree.core.sched.batch import Batch


class PrefillLog:
    def __init__(self, size: int = 4096) -> None:
        # recent iterations that ran prefill chunks: (iteration, ids of the requests chunked)
        self._log: deque[tuple[int, frozenset[str]]] = deque(maxlen=size)

    def record(self, batch: Batch) -> None:
        """Remember who batch chunked."""
        chunked = frozenset(item.request.request_id for item in batch.items if item.is_prefill)
        if chunked:
            self._log.append((batch.iteration, chunked))

    def overlapped(self, request_id: str, since: int) -> bool:
        """Did a request other than that one have a prefill chunk in an iteration after ``since``?"""
        for it, ids in reversed(self._log):
            if it <= since:
                return False
            if len(ids) > (request_id in ids):
                return True
        return False
