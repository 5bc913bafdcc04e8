"""The same iteration shape, built onto the runner's KV cache and timed over and
over (bench.engine.shape_repeat): the floor under the cost model's scatter."""

import pytest
import torch

from bench.engine.shape_repeat import figures
from stallfree.core.analysis.profiler import ShapeBench
from stallfree.core.model.model_runner import ModelRunner


def test_shapes_are_built_as_asked_and_give_their_blocks_back(tiny_model):
    runner = ModelRunner(tiny_model, 64, 16, torch.float32, torch.device("cpu"))
    shapes = ShapeBench(runner, 64)
    free = shapes.kv.num_free_blocks
    batch, reqs = shapes.batch(3, 40, 20, 30)
    decodes = [i for i in batch.items if not i.is_prefill]
    (chunk,) = [i for i in batch.items if i.is_prefill]
    assert len(decodes) == 3 and {(i.start, i.num_tokens) for i in decodes} == {(40, 1)}
    assert (chunk.start, chunk.num_tokens) == (30, 20)
    runner.execute(batch)
    shapes.free(reqs)
    assert shapes.kv.num_free_blocks == free


def test_slow_iterations_in_runs_read_as_a_positive_lag1_autocorrelation():
    burst = figures([100.0] * 50 + [120.0] * 5 + [100.0] * 45)
    assert burst["median_ms"] == 100.0 and burst["max_over_median"] == pytest.approx(1.2)
    assert burst["p99_over_median"] == pytest.approx(1.2) and burst["lag1_autocorrelation"] > 0.5
    assert figures([100.0, 120.0] * 50)["lag1_autocorrelation"] < -0.9  # lone slow ones alternate
