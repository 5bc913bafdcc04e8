"""What a request passes before the engine sees it, cheapest check first.

The per-key token rate (a glance at the bucket), then the waiting room
(``max_waiting`` counts requests still being tokenized and those queued
without a first token, so a burst cannot all slip in while tokenizing; one
API key holds at most ``max_waiting_per_key`` of it, so a key that floods
the room cannot lock every other key out of it), then
tokenizing in a worker thread (``tokenizer_threads`` at a time: the event
loop and the engine's compute threads keep their cores), then the prompt's tokens
reserved in the bucket (concurrent prompts cannot overdraw it). ``/tokenize``
and ``/detokenize`` take the same waiting room and threads.

Under a TTFT target, ``predict`` then reads the engine's latest queue
forecast (``core.sched.deadline``) plus the prompts sent since it was taken,
counting only those that will run ahead of the newcomer: a prompt that only
the queue ahead makes late is refused with ``shed_load`` (the caller's 429),
else admitted best-effort and told so. The choices of one prompt (``n``)
count as one prefill: they share it.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import TypeVar

import anyio

from stallfree.core.sched.deadline import Forecast, Place, Verdict, verdict
from stallfree.gateway.edge.ratelimit import TokenRateLimit
from stallfree.gateway.inputs.protocol import ProtocolError
from stallfree.gateway.settings import GatewaySettings

T = TypeVar("T")


class Admission:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        rate = settings.key_token_rate
        self.rate_limit = TokenRateLimit(rate, settings.key_token_burst_s) if rate > 0 else None
        self.unstarted: dict[str, str] = {}  # queued in the engine, no first token yet: request id -> tenant
        self._tokenizing = 0  # admitted, still being tokenized
        self._waiting: Counter[str] = Counter()  # per tenant: tokenizing or unstarted
        self._threads = anyio.CapacityLimiter(settings.tokenizer_threads)
        self._num_sent = 0  # engine requests handed over (each choice of a prompt is one)
        # prompts not yet in a forecast: (the engine requests handed over up to its last
        # choice, its place, its prompt tokens); one per prompt, so at most the waiting room's
        self._unseen: deque[tuple[int, Place, int]] = deque(maxlen=settings.max_waiting)

    def sent(self, choices: int, place: Place, prompt_tokens: int) -> None:
        """A prompt's ``choices`` handed to the engine: it runs ahead of later
        newcomers placed behind it until a forecast counts it."""
        self._num_sent += choices
        self._unseen.append((self._num_sent, place, prompt_tokens))

    def predict(self, forecast: Forecast | None, prompt_tokens: int, target_ms: float, place: Place) -> Verdict | None:
        """When a prompt sent now at ``place`` is predicted its first token
        (None: no TTFT target, or no forecast yet: the engine has not run a
        prompt with one)."""
        while self._unseen and forecast is not None and self._unseen[0][0] <= forecast.seen:
            self._unseen.popleft()
        if not target_ms or forecast is None:
            return None
        unseen = sum(tokens for _, ahead, tokens in self._unseen if ahead <= place)
        return verdict(forecast, prompt_tokens, target_ms, place, unseen)

    def check_rate(self, tenant: str) -> None:
        """Refuse a key whose bucket is empty, before any work."""
        if self.rate_limit is not None and (wait_s := self.rate_limit.retry_after_s(tenant)):
            raise ProtocolError("overloaded", f"token rate limit of this API key; retry in {wait_s} s", None, wait_s)

    async def tokenize(self, work: Callable[[], T], tenant: str = "") -> T:
        """Run CPU work (templates, tokenizing) in the waiting room and a worker thread."""
        if len(self.unstarted) + self._tokenizing >= self.settings.max_waiting:
            raise ProtocolError("overloaded", f"too many waiting requests ({self.settings.max_waiting})")
        share = self.settings.max_waiting_per_key
        if tenant and share and self._waiting[tenant] >= share:
            raise ProtocolError("overloaded", f"too many waiting requests from this API key ({share})")
        self._tokenizing += 1
        self._waiting[tenant] += 1
        try:
            return await anyio.to_thread.run_sync(work, limiter=self._threads)
        finally:
            self._tokenizing -= 1
            self._left(tenant)

    def queued(self, request_id: str, tenant: str) -> None:
        """In the engine's queue, without a first token yet."""
        self.unstarted[request_id] = tenant
        self._waiting[tenant] += 1

    def started(self, request_id: str) -> None:
        """Its first token (or its end): out of the waiting room."""
        tenant = self.unstarted.pop(request_id, None)
        if tenant is not None:
            self._left(tenant)

    def _left(self, tenant: str) -> None:
        self._waiting[tenant] -= 1
        if not self._waiting[tenant]:
            del self._waiting[tenant]

    def reserve(self, tenant: str, prompt_tokens: int) -> None:
        """Take the prompt's tokens from the key's bucket, or refuse."""
        if self.rate_limit is not None and (wait_s := self.rate_limit.reserve(tenant, prompt_tokens)):
            why = f"token rate limit of this API key: {prompt_tokens} prompt tokens; retry in {wait_s} s"
            raise ProtocolError("overloaded", why, None, wait_s)

    def charge(self, tenant: str, tokens: int) -> None:
        """Tokens generated (or, negative, a reservation given back because nothing ran)."""
        if self.rate_limit is not None:
            self.rate_limit.charge(tenant, tokens)
