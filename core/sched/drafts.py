"""Draft tokens for speculative decoding by prompt lookup: no second model.

A request that echoes its context (a code edit, a summary that quotes, an
answer over a document) repeats spans of it. The longest suffix of its
tokens (``ngram_max`` down to ``ngram_min`` tokens) found earlier in its own
prompt and output proposes the tokens that followed it there, the most
recent occurrence first.

The model checks the drafts in the decode's own pass: one row per draft
(``verified``); a draft is kept while it equals the token the sampler draws
at its position. A draft is a point mass, so that is rejection sampling
exactly: it is kept with the probability the model gives it, and a rejected
position's draw follows the model's distribution without it. Greedy output
is the output without drafts; sampled output keeps its distribution.

How many to propose follows what the request accepted: twice what its last
verification kept (at least 1), up to ``draft_tokens``. Its acceptance rate
(per draft, an exponentially weighted mean) is what the scheduler weighs
against a draft's cost (``paying_drafts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from stallfree.core.sched.cost import IterationCost
from stallfree.core.sched.request import Request

PRIOR_ACCEPTANCE = 0.5  # a request's acceptance rate before its first verification
ACCEPTANCE_WEIGHT = 0.3  # of the latest verification in the running rate


def verified(drafts: Sequence[int], drawn: Sequence[int]) -> list[int]:
    """The tokens a speculating decode yields: ``drawn[i]`` is the token sampled
    at draft i's position (given the drafts before it; one more row after the
    last). Drafts are kept while they equal the draw; then the draw at the
    first mismatch (or after the last draft) follows."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == drawn[kept]:
        kept += 1
    return list(drawn[: kept + 1])


def expected_accepted(acceptance: float, n: int) -> float:
    """Drafts expected to be kept of n, each kept with probability ``acceptance``
    once those before it were."""
    return sum(acceptance**i for i in range(1, n + 1))


def paying_drafts(
    cost: IterationCost,
    shape: tuple[list[int], list[tuple[int, int]]],
    now_s: float,
    yielded: float,
    limit_s: float,
    start: int,
    most: int,
    acceptance: float,
) -> tuple[int, float]:
    """How many of ``most`` drafts after a decode at context ``start`` fit the time
    limit and pay: their expected kept tokens per second added beat the batch's
    (``yielded`` tokens in ``now_s``); with the iteration's predicted time then.
    Tokens per second added falls as drafts are added, so the largest that pays
    is found by bisection (0: none does)."""
    decodes, chunks = shape

    def pays(m: int) -> tuple[bool, float]:
        then_s = cost.iteration_s(decodes + [start + 1 + i for i in range(m)], chunks)
        gain = expected_accepted(acceptance, m)
        return then_s <= limit_s and gain * now_s > (then_s - now_s) * yielded, then_s

    ok, best_s = pays(1)
    if not ok:
        return 0, now_s
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok, mid_s = pays(mid)
        if ok:
            lo, best_s = mid, mid_s
        else:
            hi = mid - 1
    return lo, best_s


class Drafter(Protocol):
    def propose(self, req: Request, k: int, ngram: tuple[int, int]) -> tuple[int, ...]:
        """Up to k draft tokens to follow req's tokens (none: nothing to propose).
        ``ngram``: (shortest, longest) suffix to look up."""
        ...

    def limit(self, req: Request, most: int) -> int:
        """How many drafts req should get now, at most ``most``."""
        ...

    def acceptance(self, req: Request) -> float:
        """req's acceptance rate per draft so far."""
        ...

    def observe(self, req: Request, proposed: int, accepted: int) -> None:
        """A verification of req's drafts kept ``accepted`` of ``proposed``."""
        ...

    def release(self, request_ids: list[str]) -> None:
        """Forget ended requests."""
        ...


@dataclass(slots=True)
class _Lookup:
    """One request's n-gram index: each n-gram's latest end (the position of the
    token after it), over the n-grams ending before ``indexed``."""

    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0
    k: int = 0  # drafts to propose next (0: not verified yet, the setting's most)
    acceptance: float = PRIOR_ACCEPTANCE


class NgramDrafter:
    """Prompt lookup over each request's own tokens, indexed as they grow."""

    def __init__(self) -> None:
        self._lookups: dict[str, _Lookup] = {}

    def _lookup(self, req: Request) -> _Lookup:
        found = self._lookups.get(req.request_id)
        if found is None:
            found = self._lookups[req.request_id] = _Lookup()
        return found

    def propose(self, req: Request, k: int, ngram: tuple[int, int]) -> tuple[int, ...]:
        shortest, longest = ngram
        lookup = self._lookup(req)
        end = req.num_tokens
        if end <= shortest or k < 1:
            return ()
        # index the n-grams ending before the current suffix's end
        start = max(0, lookup.indexed - longest)
        window = req.tokens(start, end)
        ends = lookup.ends
        for e in range(max(lookup.indexed, shortest), end):
            i = e - start
            for n in range(shortest, min(longest, e) + 1):
                ends[tuple(window[i - n : i])] = e
        lookup.indexed = end
        suffix_at = end - start
        for n in range(min(longest, end - 1), shortest - 1, -1):
            found = ends.get(tuple(window[suffix_at - n :]))
            if found is not None:
                return tuple(req.tokens(found, min(found + k, end)))
        return ()

    def limit(self, req: Request, most: int) -> int:
        k = self._lookup(req).k
        return min(most, k) if k else most

    def acceptance(self, req: Request) -> float:
        return self._lookup(req).acceptance

    def observe(self, req: Request, proposed: int, accepted: int) -> None:
        lookup = self._lookup(req)
        lookup.k = 2 * proposed if accepted == proposed else max(1, 2 * accepted)
        rate = accepted / proposed
        lookup.acceptance += ACCEPTANCE_WEIGHT * (rate - lookup.acceptance)

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._lookups.pop(rid, None)
