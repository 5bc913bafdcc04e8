"""Order of the waiting queue: which prompt is admitted next.

Every policy honours the starvation ceiling: a request that has waited longer
than ``max_defer_s`` goes ahead of everything else (oldest first), so
``sjf``/``lpm``/``priority``/``fair`` can reorder but never starve.

``fair`` shares the engine across tenants (API keys): the tenant served the
fewest tokens so far goes first, a virtual token counter as in the VTC paper
(Sheng et al., OSDI '24), so one key flooding long prompts cannot take
everybody else's time to first token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from core.sched.config import Policy
from core.sched.request import Request

# Past this queue length lpm falls back to fcfs, as SGLang does: matching
# every waiting prompt against the cache each iteration would cost more than
# the reordering gains.
LPM_MAX_QUEUE = 128


def order_waiting(
    waiting: list[Request],
    policy: Policy,
    now_ns: int,
    max_defer_s: float,
    cached_prefix_tokens: Callable[[Request], int],
    served: Mapping[str, int],
) -> list[Request]:
    deadline = now_ns - int(max_defer_s * 1e9)
    overdue = sorted((r for r in waiting if r.arrival_ns < deadline), key=lambda r: r.arrival_ns)
    rest = [r for r in waiting if r.arrival_ns >= deadline]
    if policy == Policy.SJF:
        rest.sort(key=lambda r: (r.num_tokens - r.num_computed_tokens, r.arrival_ns))
    elif policy == Policy.LPM and len(waiting) <= LPM_MAX_QUEUE:
        rest.sort(key=lambda r: (-cached_prefix_tokens(r), r.arrival_ns))
    elif policy == Policy.PRIORITY:
        rest.sort(key=lambda r: (r.priority, r.arrival_ns))
    elif policy == Policy.FAIR:
        rest.sort(key=lambda r: (served.get(r.tenant, 0), r.arrival_ns))
    else:
        rest.sort(key=lambda r: r.arrival_ns)
    return overdue + rest
