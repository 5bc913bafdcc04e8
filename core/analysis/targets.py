"""The TBT and TTFT targets a server holds when it is not told any.

Sarathi-Serve states its strict SLO as 5 x the decode-only iteration time on
the machine at hand. ``stallfree serve`` holds that out of the box: from the
cost model its start-up profile fitted, the predicted iteration of
``SLO_DECODES`` decodes at ``SLO_CONTEXT`` tokens of context (the
decode-only shape the capacity benchmarks measure their SLOs on), times
``STRICT``. With no target, the token budget alone sizes iterations and a
burst of prompts beside decoding users gives them gaps of a whole budget's
prefill each (1.1 s on a 2-core Zen 4 at the default 512).

The TTFT target is the bound the project's capacity and goodput figures
judge a first token by (2 s: Sarathi-Serve's median scheduling delay, the
goodput rule's TTFT); it orders the prompts waiting by their slack. A prompt
whose prefill alone takes longer still runs, behind those that can make
their deadlines, and never waits past the starvation ceiling
(``max_defer_s``).
"""

from __future__ import annotations

from dataclasses import dataclass

from stallfree.core.analysis.capacity_search import STRICT
from stallfree.core.sched.cost import IterationCost

SLO_DECODES = 8
SLO_CONTEXT = 128  # tokens: a 64-token prompt half-way through 128 output tokens
TTFT_TARGET_MS = 2000.0


@dataclass(frozen=True, slots=True)
class Targets:
    tbt_slo_ms: float
    ttft_slo_ms: float
    basis: str  # what the start-up log says of how they were derived


def derived_targets(cost: IterationCost) -> Targets:
    """The strict TBT target for the machine ``cost`` predicts, and the TTFT target."""
    decode_ms = cost.iteration_s([SLO_CONTEXT] * SLO_DECODES, []) * 1e3
    tbt_ms = round(STRICT * decode_ms, 1)
    basis = (
        f"TBT {STRICT:g} x the predicted decode-only iteration ({SLO_DECODES} decodes at {SLO_CONTEXT} tokens: "
        f"{decode_ms:.1f} ms); TTFT {TTFT_TARGET_MS:g} ms"
    )
    return Targets(tbt_ms, TTFT_TARGET_MS, basis)
