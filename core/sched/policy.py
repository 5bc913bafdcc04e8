"""Order of the waiting queue: which prompt is admitted next.

Every policy honours the starvation ceiling: a request that has waited longer
than ``max_defer_s`` goes ahead of everything else (oldest first), so
``sjf``/``lpm``/``priority``/``fair`` can reorder but never starve. Under TTFT
targets, everything but the prompts that can still make their targets: those
are bounded by their deadlines, and another key's flood, once it has waited
past the ceiling, does not go ahead of them (``deadline_order``).

``fair`` shares the engine across tenants (API keys): the tenant served the
fewest tokens so far goes first, a virtual token counter as in the VTC paper
(Sheng et al., OSDI '24), so one key flooding long prompts cannot take
everybody else's time to first token.

With TTFT targets (``slack`` given: ``core.sched.deadline``), the deadline
replaces arrival time as the order within each policy's classes: ``fcfs``
becomes earliest deadline first, ``priority`` and ``fair`` order by deadline
within a priority or a tenant's turn, ``sjf`` and ``lpm`` break ties by it;
and in each, a prompt whose slack says it can no longer meet its target goes
after those that can (``deadline_order``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from stallfree.core.sched.config import Policy
from stallfree.core.sched.deadline import deadline_ns
from stallfree.core.sched.request import Request

# Past this queue length lpm falls back to fcfs, as SGLang does: matching
# every waiting prompt against the cache each iteration would cost more than
# the reordering gains.
LPM_MAX_QUEUE = 128


def order_waiting(
    waiting: Collection[Request],
    policy: Policy,
    now_ns: int,
    max_defer_s: float,
    cached_prefix_tokens: Callable[[Request], int],
    served: Mapping[str, int],
    slack: Callable[[Request], float] | None = None,
) -> list[Request]:
    deadline = overdue_before(now_ns, max_defer_s)
    lpm = policy == Policy.LPM and len(waiting) <= LPM_MAX_QUEUE

    def rank(r: Request) -> float:
        return (
            -cached_prefix_tokens(r) if lpm else class_rank(policy, r.priority, r.tenant, r.num_pending_tokens, served)
        )

    if slack is not None:  # the ceiling is part of the deadline order
        return sorted(waiting, key=lambda r: ordered_by_deadline(r, rank(r), slack, deadline))
    overdue = sorted((r for r in waiting if r.arrival_ns < deadline), key=lambda r: r.arrival_ns)
    rest = sorted((r for r in waiting if r.arrival_ns >= deadline), key=lambda r: (rank(r), r.arrival_ns))
    return overdue + rest


def overdue_before(now_ns: int, max_defer_s: float) -> int:
    """The starvation ceiling as a time: whatever arrived before it has waited too long."""
    return now_ns - int(max_defer_s * 1e9)


def ordered_by_deadline(
    r: Request, rank: float, slack: Callable[[Request], float], overdue_before: float
) -> tuple[float, ...]:
    """A waiting prompt's key under TTFT targets (``deadline_order``, with the
    policy's class ``rank``): the class first among the prompts that can still
    make their targets, and among the rest but for the overdue, who go first of
    those, oldest first."""
    group, *within = deadline_order(r, slack, overdue_before)
    if group == 0:
        return (0, rank, *within)
    if r.arrival_ns < overdue_before:
        return (1, 0, *within)
    return (2, rank, *within)


def class_rank(policy: Policy, priority: int, tenant: str, pending_tokens: int, served: Mapping[str, int]) -> float:
    """A prompt's class in the policy's order, the key before its deadline
    (lower runs first): its tokens still to prefill (``sjf``), its priority,
    its tenant's tokens served so far (``fair``); one class for ``fcfs`` and
    ``lpm`` (the forecast cannot know a newcomer's cache match: it counts lpm
    as fcfs, erring long)."""
    if policy == Policy.SJF:
        return pending_tokens
    if policy == Policy.PRIORITY:
        return priority
    if policy == Policy.FAIR:
        return served.get(tenant, 0)
    return 0.0


def newcomer_place(
    policy: Policy, priority: int, tenant: str, prompt_tokens: int, served: Mapping[str, int], due_ns: float
) -> tuple[float, float]:
    """Where a prompt not yet queued will stand (``core.sched.deadline.Place``):
    under ``fair`` a tenant with nothing queued starts level with the least
    served one (``Scheduler.add``'s lift; what it was served before is not known
    here), with ``served`` the queued tenants' counts."""
    if policy == Policy.FAIR and tenant not in served:
        served = {tenant: min(served.values(), default=0)}
    return class_rank(policy, priority, tenant, prompt_tokens, served), due_ns


def deadline_order(r: Request, slack: Callable[[Request], float], overdue_before: float) -> tuple[float, ...]:
    """The TTFT targets' order: prompts that can still meet theirs (slack >= 0)
    first, earliest deadline first; then, oldest first, whatever has waited
    past the starvation ceiling (arrived before ``overdue_before``), then
    those with no target, then those that can no longer meet theirs, so that
    they do not make everybody miss. Not least slack first: two prompts with
    equal deadlines would take turns chunk by chunk (each chunk raises the
    slack of the one that got it), delaying both first tokens; the deadline
    keeps one at a time."""
    due = deadline_ns(r)
    if due is not None and slack(r) >= 0:
        return (0, due, r.arrival_ns)
    if r.arrival_ns < overdue_before:
        return (1, 0, r.arrival_ns)
    return (1, 1 if due is None else 2, r.arrival_ns)
