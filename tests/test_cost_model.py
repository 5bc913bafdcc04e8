"""The cost model's two rooflines and the profile fit that calibrates them."""

import math

import pytest

from stallfree.core.analysis.cost_model import CostModel, HardwareSpec, ModelSpec
from stallfree.core.analysis.profiler import Point, fit

SPEC = ModelSpec("m", 100e6, 4.0, layers=10, heads=8, kv_heads=2, head_dim=64)


def test_linear_and_attention_rooflines_add():
    hw = HardwareSpec("h", flops=1e11, mem_bw=1e10, overhead_s=0.01, attention_flops=5e10)
    cost = CostModel(SPEC, hw, attention=True, kv_reads=True)
    linear = max(2 * SPEC.params * 8 / hw.flops, SPEC.weight_bytes / hw.mem_bw)  # 8 decodes: weight reads bind
    attention = max(8 * SPEC.attention_flops(500, 1) / 5e10, 8 * 500 * SPEC.kv_bytes_per_token / hw.mem_bw)
    assert cost.iteration_s([500] * 8, []) == pytest.approx(linear + attention + 0.01)


def test_decode_and_chunk_attention_are_rooflines_of_their_own():
    """Decodes' attention is bound by its KV reads, a chunk's by its FLOPs: each
    takes its own time (taken together, the chunk's compute hid under the reads)."""
    hw = HardwareSpec("h", flops=1e11, mem_bw=1e10, attention_flops=5e10)
    cost = CostModel(SPEC, hw, attention=True, kv_reads=True)
    decodes, chunk = [2000] * 16, [(1500, 256)]
    decode_reads = 16 * 2000 * SPEC.kv_bytes_per_token / hw.mem_bw
    chunk_compute = SPEC.attention_flops(1500, 256) / 5e10
    assert decode_reads > 16 * SPEC.attention_flops(2000, 1) / 5e10  # the decodes' reads bind
    assert chunk_compute > 1500 * SPEC.kv_bytes_per_token / hw.mem_bw  # the chunk's FLOPs bind
    linear = cost.linear_s(16 + 256)
    assert cost.iteration_s(decodes, chunk) == pytest.approx(linear + decode_reads + chunk_compute)


def test_without_overlap_weight_reads_add_to_compute():
    hw = HardwareSpec("h", flops=1e11, mem_bw=1e10, overlap=False)
    compute, memory = 2 * SPEC.params * 300 / hw.flops, SPEC.weight_bytes / hw.mem_bw
    assert CostModel(SPEC, hw).iteration_s([], [(0, 300)]) == pytest.approx(compute + memory)
    overlapped = HardwareSpec("h", flops=1e11, mem_bw=1e10)
    assert CostModel(SPEC, overlapped).iteration_s([], [(0, 300)]) == pytest.approx(max(compute, memory))


def test_fit_recovers_a_machine_that_adds_weight_reads():
    truth = CostModel(SPEC, HardwareSpec("t", 8e10, 5e9, 0.02, 3e10, overlap=False), attention=True, kv_reads=True)
    shapes = [(1, 256, 0, 0), (8, 256, 0, 0), (32, 256, 0, 0), (64, 256, 0, 0)]
    shapes += [(8, 256, c, 0) for c in (16, 128, 512, 2048)] + [(0, 0, 256, p) for p in (512, 2048, 4096)]
    points = []
    for decodes, ctx, chunk, prefix in shapes:
        ms = truth.iteration_s([ctx] * decodes, [(prefix, chunk)] if chunk else []) * 1e3
        points.append(Point(decodes, ctx, chunk, prefix, ms))
    fitted = fit(SPEC, points)
    assert fitted.hardware.overlap is False
    worst = max(abs(math.log(p.predicted_ms / p.measured_ms)) for p in points)
    assert worst < 0.05


def test_small_batches_run_their_own_gemm():
    hw = HardwareSpec(
        "h", flops=1e11, mem_bw=1e10, overlap=False, small_batch_rows=64, small_batch_flops=4e10, small_batch_bw=5e10
    )
    cost = CostModel(SPEC, hw)
    small = 2 * SPEC.params * 64 / 4e10 + SPEC.weight_bytes / 5e10
    large = 2 * SPEC.params * 65 / 1e11 + SPEC.weight_bytes / 1e10
    assert cost.linear_s(64) == pytest.approx(small)
    assert cost.linear_s(65) == pytest.approx(large)


def test_fit_recovers_a_machine_with_a_small_batch_gemm():
    hw = HardwareSpec(
        "t", 8e10, 5e9, 0.02, 3e10, overlap=False, small_batch_rows=64, small_batch_flops=3e10, small_batch_bw=3e10
    )
    truth = CostModel(SPEC, hw, attention=True, kv_reads=True)
    shapes = [(n, 256, 0, 0) for n in (1, 8, 16, 32, 64)]
    shapes += [(8, 256, c, 0) for c in (16, 64, 128, 512, 1024, 2048)] + [(0, 0, 256, p) for p in (512, 2048, 4096)]
    points = []
    for decodes, ctx, chunk, prefix in shapes:
        ms = truth.iteration_s([ctx] * decodes, [(prefix, chunk)] if chunk else []) * 1e3
        points.append(Point(decodes, ctx, chunk, prefix, ms))
    fit(SPEC, points)  # one roofline for both paths
    single = max(abs(math.log(p.predicted_ms / p.measured_ms)) for p in points)
    fitted = fit(SPEC, points, small_batch_rows=64)
    assert fitted.hardware.small_batch_rows == 64
    worst = max(abs(math.log(p.predicted_ms / p.measured_ms)) for p in points)
    assert worst < 0.05 < single  # one roofline cannot fit both paths; two can


def test_each_sequence_adds_its_fixed_cost():
    hw = HardwareSpec("h", flops=1e11, mem_bw=1e10, per_sequence_s=0.002)
    cost, plain = CostModel(SPEC, hw), CostModel(SPEC, HardwareSpec("h", flops=1e11, mem_bw=1e10))
    assert cost.iteration_s([100] * 8, [(0, 50)]) == pytest.approx(plain.iteration_s([100] * 8, [(0, 50)]) + 9 * 0.002)


def test_fit_recovers_a_per_sequence_cost():
    # decodes that cost far more than their GEMM rows (sampling, metadata): a
    # roofline alone cannot fit decode-only batches and chunks together
    hw = HardwareSpec("t", 8e11, 6e9, 0.005, 8e10, overlap=False, per_sequence_s=0.0015)
    truth = CostModel(SPEC, hw, attention=True, kv_reads=True)
    shapes = [(n, 256, 0, 0) for n in (1, 8, 16, 32, 64)]
    shapes += [(8, 256, c, 0) for c in (16, 128, 512, 2048)] + [(0, 0, 256, p) for p in (512, 2048, 4096)]
    points = []
    for decodes, ctx, chunk, prefix in shapes:
        ms = truth.iteration_s([ctx] * decodes, [(prefix, chunk)] if chunk else []) * 1e3
        points.append(Point(decodes, ctx, chunk, prefix, ms))
    fitted = fit(SPEC, points)
    assert fitted.hardware.per_sequence_s == pytest.approx(0.0015, rel=0.2)
    assert max(abs(math.log(p.predicted_ms / p.measured_ms)) for p in points) < 0.05
