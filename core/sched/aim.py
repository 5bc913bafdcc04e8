"""The TBT target's aim: the fraction of the target iterations are sized to.

Iterations are sized to aim x target, where the aim is 1 over the
``AIM_PERCENTILE`` of (the gap decodes got) / (the iteration's predicted time)
over the last ``AIM_WINDOW`` iterations sized to a target, weighted by their
decodes (the percentile is over tokens, as the SLO's is): the prediction's
error, the loop's own time between iterations and the machine's noise, as a
ratio, so it holds whatever the target. 99.9, not the SLO's 99: a trial's P99
over 2,000 gaps is its one or two worst crowded iterations'. Measured
(bench/results/before_after-2026-12-03, 2-core Zen 4, Azure at 13 req/s,
228 ms): measured / predicted ran p99 1.2-1.46 and max 1.27-1.75 per 200
iterations, and the two aims met the target in 5 trials of 6 each: outliers
that rare no recent percentile foresees.

Only iterations whose prefill the target sized count: a decode-only
iteration's time is no choice, and its errors are mostly a few milliseconds
added (the gateway, the client, the machine) that make a large ratio of a
short iteration. Counted, one 17 ms decode iteration that took 41 ms (a
single hiccup beside a burst of prompts, 2-core Xeon, 2 threads) held the aim
at its floor, 0.5, for 256 iterations: every chunk half what the 94 ms
target allowed, the burst's last prompt waited 6.2 s for its first token
instead of 3.1.
"""

from __future__ import annotations

from collections import deque

from stallfree.core.sched.batch import Batch
from stallfree.core.sched.timings import weighted_percentile

AIM_PERCENTILE = 99.9
AIM_WINDOW = 256
AIM_FLOOR = 0.5


class Aim:
    def __init__(self) -> None:
        self.value = 1.0  # the fraction of the TBT target iterations are sized to
        # (gap / predicted time, decodes), recent targeted iterations
        self._gap_ratios: deque[tuple[float, int]] = deque(maxlen=AIM_WINDOW)
        self._last_end_ns: int | None = None  # the previous iteration's end

    def learn(self, batch: Batch, start_ns: int, end_ns: int) -> None:
        """After every iteration; one whose prefill was sized within the TBT target
        adds the gap its decodes got (from the previous iteration's end when they
        ran back to back, else its own duration) over its predicted time to the
        window the aim is read from, once for each of its decodes."""
        last, self._last_end_ns = self._last_end_ns, end_ns
        unsized = batch.over_target not in (None, "deadlines")  # a stretched target sized it too
        if not batch.target_s or unsized or batch.predicted_s <= 0 or not batch.prefill_tokens:
            return
        back_to_back = last is not None and start_ns - last < batch.target_s * 0.1e9
        gap_s = (end_ns - (last if back_to_back and last is not None else start_ns)) / 1e9
        decodes = sum(not item.is_prefill for item in batch.items)
        self._gap_ratios.append((gap_s / batch.predicted_s, decodes))
        if len(self._gap_ratios) >= 16:
            self.value = max(AIM_FLOOR, min(1.0, 1.0 / weighted_percentile(self._gap_ratios, AIM_PERCENTILE)))
