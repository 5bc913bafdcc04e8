"""Incremental detokenization with stop strings, for streaming.

A single token can end mid UTF-8 character: bytes are fed through an
incremental decoder, so text is released only when complete. When stop
strings are set, the last ``len(longest stop) - 1`` characters are held back
(they may be the start of a stop string) until more text rules that out.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable


class Detokenizer:
    def __init__(self, token_bytes: list[bytes], stop: Iterable[str] = ()) -> None:
        self._bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        self.stopped = False

    def push(self, token_ids: Iterable[int]) -> str:
        """Feed new tokens; return the text now safe to show (maybe empty).

        After a stop string appears, returns the text before it and sets
        ``stopped``; later calls return nothing.
        """
        if self.stopped:
            return ""
        for token_id in token_ids:
            self._pending += self._utf8.decode(self._bytes[token_id])
        if not self._stop:
            out, self._pending = self._pending, ""
            return out
        hits = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            out, self._pending = self._pending[: min(hits)], ""
            return out
        cut = max(0, len(self._pending) - self._hold)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """The held-back tail, once the stream has ended without a stop string."""
        if self.stopped:
            return ""
        out = self._pending + self._utf8.decode(b"", final=True)
        self._pending = ""
        return out
