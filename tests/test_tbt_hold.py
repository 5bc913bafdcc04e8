"""bench.serving.tbt_hold's reading of the dashboard's iteration feed."""

from bench.serving.tbt_hold import Timed, by_shape, shape_of


def timed(ratio: float, prefix: int, context: float) -> Timed:
    return Timed(ratio, 0.9, 0.0, True, 0.0, 0, 0, 0, 0.0, prefix, context)


def test_the_feed_shape_is_read_and_the_scatter_split_where_it_lies():
    # a feed row: [end, duration, decodes, prefill, budget, predicted, target, cpu, preempted,
    # waits, faults, collector, decode context tokens, chunk prefix tokens]
    assert shape_of([0, 50, 4, 256, 512, 45, 100, 50, 0, 0, 0, 0, 800, 1500]) == (1500, 200.0)
    assert shape_of([0, 50, 4, 256, 512, 45, 100, 50, 0, 0, 0, 0]) == (0, 0.0)  # an older feed
    # the model misjudges long prefixes: only that half scatters
    near = [timed(1.0, 100, 50.0) for _ in range(50)] + [timed(1.3, 2000, 50.0) for _ in range(50)]
    out = by_shape(near)
    assert out["near_prefix_short_max"] == 1.0 and out["near_prefix_long_p50"] == 1.3
    assert out["near_context_long_p99"] == 1.3  # one context: every iteration on the long side
