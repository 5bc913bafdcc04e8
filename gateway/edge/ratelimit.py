"""Per-tenant token-rate limits: one token bucket per API key.

A request is refused (429 ``overloaded`` with ``Retry-After``) while its
key's bucket is empty, and, once tokenized, unless the bucket holds its
prompt: the prompt's tokens are taken in the same step as the check, so
concurrent requests cannot all pass one check before any is charged (a
prompt larger than the whole bucket needs a full one). Generated tokens are
charged when a request finishes, so a key may briefly run into debt and
then waits it off. The bucket holds ``burst_s`` seconds of tokens.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass(slots=True)
class _Bucket:
    level: float
    at: float


class TokenRateLimit:
    def __init__(self, tokens_per_s: float, burst_s: float = 10.0) -> None:
        self.rate = tokens_per_s
        self.capacity = tokens_per_s * burst_s
        self._buckets: dict[str, _Bucket] = {}

    def _bucket(self, tenant: str, now: float) -> _Bucket:
        b = self._buckets.setdefault(tenant, _Bucket(self.capacity, now))
        b.level = min(self.capacity, b.level + (now - b.at) * self.rate)
        b.at = now
        return b

    def retry_after_s(self, tenant: str, now: float | None = None) -> int:
        """0 if tenant may send a request now, else whole seconds until it may."""
        b = self._bucket(tenant, time.monotonic() if now is None else now)
        return 0 if b.level > 0 else max(1, math.ceil(-b.level / self.rate))

    def charge(self, tenant: str, tokens: int, now: float | None = None) -> None:
        self._bucket(tenant, time.monotonic() if now is None else now).level -= tokens

    def reserve(self, tenant: str, tokens: int, now: float | None = None) -> int:
        """Take a prompt's tokens if the bucket holds them (0), else take nothing
        and return whole seconds until it will."""
        b = self._bucket(tenant, time.monotonic() if now is None else now)
        need = min(tokens, self.capacity)
        if b.level >= need:
            b.level -= tokens
            return 0
        return max(1, math.ceil((need - b.level) / self.rate))
