"""The fair policy's virtual token counter (the VTC paper: Sheng et al., OSDI '24):
tokens computed per tenant (API key) so far, which orders ``fair``'s queue, the
least served tenant first (``core.sched.policy.class_rank``).

A tenant coming back, with nothing in the engine, starts level with the least
served active one: idle time banks no credit (VTC's counter lift), or a key
idle for an hour would take the engine from everybody when it returns.
"""

from __future__ import annotations

from collections import Counter


class TenantCounters:
    def __init__(self) -> None:
        self.served: dict[str, int] = {}  # tenant -> tokens computed for it
        self._active: Counter[str] = Counter()  # tenant -> its requests in the engine

    def join(self, tenant: str) -> None:
        """A request of the tenant's enters the engine."""
        if tenant not in self._active:
            floor = min((self.served.get(t, 0) for t in self._active), default=0)
            self.served[tenant] = max(self.served.get(tenant, 0), floor)
        self._active[tenant] += 1

    def leave(self, tenant: str) -> None:
        """A request of the tenant's has ended."""
        self._active[tenant] -= 1
        if not self._active[tenant]:
            del self._active[tenant]

    def serve(self, tenant: str, tokens: int) -> None:
        self.served[tenant] = self.served.get(tenant, 0) + tokens

    def active(self) -> dict[str, int]:
        """Tokens served to each tenant with requests in the engine."""
        return {t: self.served.get(t, 0) for t in self._active}
