"""What an API key may ask of the scheduler: the bounds on a request's own
``priority`` and ``ttft_slo_ms``, as the operator grants them per key.

A request's priority and TTFT target buy it precedence over other keys'
requests (the scheduler runs the lower priority, then the nearer deadline,
first), so without a bound one key could take from every other what the
server promises them. With API keys set, a key's requests may ask for no
more than the server gives everybody unless the operator grants it more
(``--key-grant key-2:priority=-5,ttft_slo_ms=500``): a priority of 0 or
above (lower runs earlier), and a TTFT target no tighter than the server's
(none while the server has none). Looser is always allowed: a later
deadline or a higher priority only lets others go first. Operator keys
(``--admin-key``) and a server without keys (one tenant: its operator) are
not bounded.
"""

from __future__ import annotations

from dataclasses import dataclass

from stallfree.core.sched.config import RANGES
from stallfree.gateway.inputs.protocol import GenerateRequest, ProtocolError

ADMIN_PREFIX = "admin-"  # an operator key's tenant id: admin-<n> (gateway.edge.auth.tenant_of)


@dataclass(frozen=True, slots=True)
class Grant:
    """The most a key's requests may ask for."""

    priority: int = 0  # the lowest (most urgent) priority they may set
    ttft_slo_ms: float | None = None  # the tightest TTFT target they may set (None: the server's)


def parse_grant(text: str) -> tuple[str, Grant]:
    """``key-<n>:priority=<int>,ttft_slo_ms=<ms>`` (either part may be left out):
    the key's tenant id and its grant. Raises ValueError naming what is wrong."""
    tenant, sep, terms = text.partition(":")
    if not sep or not tenant.startswith("key-") or not tenant[4:].isdigit():
        raise ValueError("a grant reads key-<n>:priority=<int>,ttft_slo_ms=<ms> (key-<n>: the n-th --api-key)")
    fields: dict[str, str] = {}
    for term in terms.split(","):
        name, eq, value = term.partition("=")
        if not eq or name not in ("priority", "ttft_slo_ms") or name in fields:
            raise ValueError("a grant's terms are priority=<int> and ttft_slo_ms=<ms>, each at most once")
        fields[name] = value
    try:
        priority = int(fields.get("priority", "0"))
        ttft = float(fields["ttft_slo_ms"]) if "ttft_slo_ms" in fields else None
    except ValueError:
        raise ValueError("a grant's priority is an integer and its ttft_slo_ms a number") from None
    _, low, high = RANGES["ttft_slo_ms"]
    if ttft is not None and not low <= ttft <= high:
        raise ValueError(f"a grant's ttft_slo_ms is in [{low:g}, {high:g}]")
    return tenant, Grant(priority, ttft)


def check_grant(gen: GenerateRequest, grant: Grant | None, server_ttft_ms: float) -> None:
    """Refuse (400, naming the field) a request that asks more than its key's
    grant; None: not bounded (an operator's key, or no keys at all)."""
    if grant is None:
        return
    if gen.priority < grant.priority:
        raise ProtocolError(
            "invalid_request",
            f"priority below {grant.priority} is not granted to this API key (the operator grants it: --key-grant)",
            param="priority",
        )
    own = gen.ttft_slo_ms
    if not own:  # none of its own: the server's target, or none
        return
    tightest = grant.ttft_slo_ms if grant.ttft_slo_ms is not None else server_ttft_ms
    if not tightest:
        why = "a TTFT target of its own is not granted to this API key while the server sets none"
    elif own < tightest:
        why = f"a TTFT target under {tightest:g} ms is not granted to this API key"
    else:
        return
    raise ProtocolError(
        "invalid_request", f"ttft_slo_ms: {why} (the operator grants it: --key-grant)", param="ttft_slo_ms"
    )
