"""What a request passes before the engine sees it, cheapest check first.

The per-key token rate (a glance at the bucket), then the waiting room
(``max_waiting`` counts requests still being tokenized and those queued
without a first token, so a burst cannot all slip in while tokenizing), then
tokenizing in a worker thread (``tokenizer_threads`` at a time: the event
loop and the step thread keep their cores), then the prompt's tokens
reserved in the bucket (concurrent prompts cannot overdraw it). ``/tokenize``
and ``/detokenize`` take the same waiting room and threads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio

from gateway.protocol import ProtocolError
from gateway.ratelimit import TokenRateLimit
from gateway.settings import GatewaySettings

T = TypeVar("T")


class Admission:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        rate = settings.key_token_rate
        self.rate_limit = TokenRateLimit(rate, settings.key_token_burst_s) if rate > 0 else None
        self.unstarted: set[str] = set()  # queued in the engine, no first token yet
        self._tokenizing = 0  # admitted, still being tokenized
        self._threads = anyio.CapacityLimiter(settings.tokenizer_threads)

    def check_rate(self, tenant: str) -> None:
        """Refuse a key whose bucket is empty, before any work."""
        if self.rate_limit is not None and (wait_s := self.rate_limit.retry_after_s(tenant)):
            raise ProtocolError("overloaded", f"token rate limit of this API key; retry in {wait_s} s", None, wait_s)

    async def tokenize(self, work: Callable[[], T]) -> T:
        """Run CPU work (templates, tokenizing) in the waiting room and a worker thread."""
        if len(self.unstarted) + self._tokenizing >= self.settings.max_waiting:
            raise ProtocolError("overloaded", f"too many waiting requests ({self.settings.max_waiting})")
        self._tokenizing += 1
        try:
            return await anyio.to_thread.run_sync(work, limiter=self._threads)
        finally:
            self._tokenizing -= 1

    def reserve(self, tenant: str, prompt_tokens: int) -> None:
        """Take the prompt's tokens from the key's bucket, or refuse."""
        if self.rate_limit is not None and (wait_s := self.rate_limit.reserve(tenant, prompt_tokens)):
            why = f"token rate limit of this API key: {prompt_tokens} prompt tokens; retry in {wait_s} s"
            raise ProtocolError("overloaded", why, None, wait_s)

    def charge(self, tenant: str, tokens: int) -> None:
        """Tokens generated (or, negative, a reservation given back because nothing ran)."""
        if self.rate_limit is not None:
            self.rate_limit.charge(tenant, tokens)
