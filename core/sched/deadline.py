"""The TTFT target's arithmetic: a prompt's deadline, the time its prefill still
needs, its slack, and the queue forecast admission reads.

Time comes from the cost model through one figure, the ``Pace``: how many
prefill tokens one iteration takes now (what the TBT target leaves beside the
decodes, or what the token budget leaves) and that iteration's predicted
time. A prompt with p tokens still to prefill needs ceil(p / tokens)
iterations; its first token comes at the end of the last. Prefix-cache hits
are not counted (they are rare on the shared traces: 3.5 % of Mooncake's
scaled prompt tokens), so a prediction errs long, never short.

Slack = deadline - now - the prefill time still needed. A prompt whose slack
is negative can no longer meet its target; it goes after every prompt that
still can (eager relegation, as Niyama does), or everybody would miss
together; among those that can, the nearest deadline goes first
(``core.sched.policy.deadline_order``). The starvation ceiling still bounds
how long any prompt waits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stallfree.core.sched.request import Request


@dataclass(slots=True, frozen=True)
class Pace:
    """How fast prompts are prefilled now: ``tokens`` a prefill share of one
    iteration takes, in ``iteration_s`` predicted."""

    tokens: int
    iteration_s: float

    def prefill_s(self, pending_tokens: int) -> float:
        """Predicted time until a prompt with that many tokens to prefill, first in line, has its first token."""
        if pending_tokens <= 0:
            return 0.0
        return math.ceil(pending_tokens / max(1, self.tokens)) * self.iteration_s


def deadline_ns(req: Request) -> int | None:
    """When req's first token is due (None: it has no TTFT target)."""
    target = req.ttft_slo_ms
    return req.arrival_ns + int(target * 1e6) if target else None


def slack_s(req: Request, now_ns: int, pace: Pace | None) -> float:
    """Seconds req may still wait and meet its TTFT target (inf: no target)."""
    due = deadline_ns(req)
    if due is None:
        return math.inf
    needed = pace.prefill_s(req.num_pending_tokens) if pace is not None else 0.0
    return (due - now_ns) / 1e9 - needed


@dataclass(slots=True, frozen=True)
class Forecast:
    """What admission reads of the queue after an iteration: the prefill tokens
    queued ahead of a newcomer (the prompts that can still meet their targets:
    late ones go after it), the pace, and how many requests the engine had been
    given by then (those sent since are not in the backlog yet)."""

    backlog_tokens: int
    pace: Pace
    seen: int


@dataclass(slots=True, frozen=True)
class Verdict:
    """Admission's prediction for one new prompt."""

    predicted_s: float  # its first token, this long after arrival
    on_time: bool  # within its TTFT target (always, without one)
    refusable: bool  # late only because of the queue: alone it would be on time
    retry_after_s: int  # refusable: whole seconds until the queue is predicted to have drained enough (else 0)


def verdict(forecast: Forecast, prompt_tokens: int, target_ms: float, unseen_tokens: int = 0) -> Verdict:
    """Can a prompt of ``prompt_tokens`` arriving now meet ``target_ms`` (0: no
    target), behind the backlog and ``unseen_tokens`` sent since the forecast?
    Never refusable with nothing ahead: waiting would not help it."""
    pace = forecast.pace
    ahead = forecast.backlog_tokens + unseen_tokens
    predicted = pace.prefill_s(ahead + prompt_tokens)
    target_s = target_ms / 1e3
    on_time = not target_ms or predicted <= target_s
    refusable = not on_time and ahead > 0 and pace.prefill_s(prompt_tokens) <= target_s
    retry = max(1, math.ceil(predicted - target_s)) if refusable else 0
    return Verdict(predicted, on_time, refusable, retry)
