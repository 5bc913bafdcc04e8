"""The offset that moves timelines between processes' monotonic clocks (``scaleout.clock``)."""

from __future__ import annotations

import time

from stallfree.scaleout import clock

WALL = 1_800_000_000_000_000_000  # the wall clock at perf_counter 0, in ns


def test_the_offset_comes_from_the_most_tightly_bracketed_wall_reading(monkeypatch):
    # two brackets of perf_counter reads around a wall reading; the first was preempted for 46 ms
    perf = iter([0, 46_000_000, 46_001_000, 46_001_200])
    wall = iter([WALL + 100, WALL + 46_001_100])
    monkeypatch.setattr(time, "perf_counter_ns", lambda: next(perf))
    monkeypatch.setattr(time, "time_ns", lambda: next(wall))
    assert clock.wall_offset_ns(reads=2) == WALL


def test_the_offset_maps_perf_counter_onto_the_wall_clock():
    offset = clock.wall_offset_ns()
    assert abs(time.perf_counter_ns() + offset - time.time_ns()) < 5_000_000
