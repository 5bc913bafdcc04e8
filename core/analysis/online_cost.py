"""A fitted cost model that follows the machine it runs on.

The fitted roofline (``stallfree profile``) knows the shape of an iteration's
cost: how it grows with decodes, their contexts, chunk sizes and prefixes.
Its scale drifts on a shared, noisy machine (the other core busy, turbo,
caches), and the profile times the runner alone, not the engine's own work
around it. ``OnlineCost`` keeps the shape and corrects the scale from every
iteration the engine measures: a factor per kind of iteration, decode-only
and with prefill (they run different GEMM regimes and err differently),
each an exponentially weighted geometric mean of measured / predicted.

Under a TBT target the iterations with prefill are sized to the target, so
their factor is calibrated where the target needs it. A factor starts as
the plain mean of its first ``1 / weight`` observations (a cold start learns
at once); after that one outlier (a collection pause) moves it by at most
``weight * CLIP`` in log space.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from stallfree.core.sched.cost import Chunks, IterationCost

CLIP = math.log(2.0)  # largest log error one iteration may apply


class OnlineCost:
    def __init__(self, base: IterationCost, weight: float = 0.1, corrections: tuple[float, float] = (1.0, 1.0)) -> None:
        """``corrections``: the factors to start from (decode-only, with prefill)."""
        if not 0 < weight <= 1:
            raise ValueError("weight must be in (0, 1]")
        self.base = base
        self.weight = weight
        self._log_factor = [math.log(c) for c in corrections]  # [decode-only, with prefill]
        self._observed = [0, 0]

    def correction(self, with_prefill: bool) -> float:
        """Measured / fitted time, as learnt so far, for that kind of iteration."""
        return math.exp(self._log_factor[with_prefill])

    def iteration_s(self, decode_contexts: Sequence[int], chunks: Chunks) -> float:
        return self.base.iteration_s(decode_contexts, chunks) * self.correction(bool(chunks))

    def observe(self, decode_contexts: Sequence[int], chunks: Chunks, measured_s: float) -> None:
        fitted = self.base.iteration_s(decode_contexts, chunks)
        if fitted <= 0 or measured_s <= 0:
            return
        kind = bool(chunks)
        self._observed[kind] += 1
        n = self._observed[kind]
        error = math.log(measured_s / fitted) - self._log_factor[kind]
        if n * self.weight < 1:  # warming up: the mean so far
            self._log_factor[kind] += error / n
        else:
            self._log_factor[kind] += self.weight * max(-CLIP, min(CLIP, error))
