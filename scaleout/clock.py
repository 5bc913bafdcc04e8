"""Moving a timeline between processes' monotonic clocks.

Each process maps perf_counter_ns to the wall clock with a fixed offset; a
replica sends timelines on the wall clock and the ingress maps them back
onto its own monotonic clock, so every interval stays a difference of two
timestamps of one clock (on one machine both offsets describe the same
CLOCK_MONOTONIC and the shift is exact; across machines it is as good as
their wall clocks' agreement).
"""

from __future__ import annotations

import time

from stallfree.core.sched.request import Chunk, Timeline


def wall_offset_ns(reads: int = 8) -> int:
    """The wall clock minus perf_counter_ns, from the wall reading bracketed
    most tightly by two perf_counter_ns readings: a process preempted between
    a lone pair of reads would put every timestamp it moves off by the pause
    (a replica's span once ended 46 ms past its request's on a busy machine)."""
    width, offset = None, 0
    for _ in range(reads):
        before = time.perf_counter_ns()
        wall = time.time_ns()
        after = time.perf_counter_ns()
        if width is None or after - before < width:
            width, offset = after - before, wall - (before + after) // 2
    return offset


def shift(tl: Timeline, delta_ns: int) -> None:
    """Add delta_ns to every timestamp of tl, in place."""

    def move(t: int | None) -> int | None:
        return None if t is None else t + delta_ns

    tl.arrival_ns += delta_ns
    tl.scheduled_ns = move(tl.scheduled_ns)
    tl.first_token_ns = move(tl.first_token_ns)
    tl.finished_ns = move(tl.finished_ns)
    tl.chunks = [
        Chunk(c.iteration, c.start_ns + delta_ns, c.end_ns + delta_ns, c.tokens, c.prefix_len) for c in tl.chunks
    ]
    tl.token_ns = [t + delta_ns for t in tl.token_ns]
