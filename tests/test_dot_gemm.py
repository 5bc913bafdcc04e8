"""The AVX512-BF16 dot-product GEMM (kernels/csrc/dot_gemm.cpp) against torch.

It runs where the build targets AVX512-BF16 (``avx512-bf16``: AMD Zen 4,
Intel Cooper Lake and later); a CPU without the instruction cannot execute
it, and there the bf16 layers keep oneDNN (checked below too).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree import kernels
from stallfree.kernels import cpu_build
from stallfree.kernels.linear import dot_available

needs_dot = pytest.mark.skipif(
    cpu_build.detect_isa() != "avx512-bf16", reason="this CPU has no AVX512-BF16 (the kernel cannot execute here)"
)


@pytest.fixture(autouse=True, scope="module")
def native():
    assert cpu_build.status().backend == "native", f"the CPU kernels did not build: {cpu_build.status()}"


def product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 x W^T + bias of the same bf16 values: what the kernel approximates in float32 sums."""
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


@needs_dot
@settings(max_examples=80, deadline=None)
@given(
    m=st.integers(1, 60),  # register tiles hold 14 rows: crosses 1, 2, 3, 4 and 5 tiles
    n_blocks=st.integers(1, 5),  # 32 columns a block
    k=st.integers(1, 150).map(lambda h: 2 * h),
    bias=st.sampled_from([None, torch.float32, torch.bfloat16]),
    float_out=st.booleans(),
    strided=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gemm_dot_matches_a_float64_product(m, n_blocks, k, bias, float_out, strided, seed):
    gen = torch.Generator().manual_seed(seed)
    n = 32 * n_blocks
    wide = torch.randn(m, k + 6, generator=gen).bfloat16()
    x = wide[:, 3 : 3 + k] if strided else wide[:, :k].contiguous()  # rows strided like the QKV split
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = None if bias is None else torch.randn(n, generator=gen).to(bias)
    y = torch.ops.stallfree.gemm_dot(x, torch.ops.stallfree.pack_dot(w), b, float_out)
    ref = product(x, w, b)
    assert y.shape == (m, n) and y.dtype == (torch.float32 if float_out else torch.bfloat16)
    # float32 sums of exact products: error ~ k * 2^-24 * |terms|; bf16 output adds one rounding
    scale = (x.double().abs() @ w.double().abs().T) + (0 if b is None else b.double().abs())
    tol = scale * (k * 2**-23 + (0 if float_out else 2**-8)) + 1e-30
    assert ((y.double() - ref).abs() <= tol).all()


@needs_dot
def test_big_batches_cross_row_panels():
    """Rows past the L2 panel (256 KiB of activations) land in a second panel."""
    torch.manual_seed(3)
    x, w = torch.randn(300, 1536).bfloat16(), torch.randn(64, 1536).bfloat16()
    y = torch.ops.stallfree.gemm_dot(x, torch.ops.stallfree.pack_dot(w), None, True)
    assert torch.allclose(y.double(), product(x, w, None), rtol=1e-4, atol=1e-3)


def silu_mul_of(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@needs_dot
@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 60),
    f_blocks=st.integers(1, 6),  # 16 outputs a block
    k=st.integers(1, 150).map(lambda h: 2 * h),
    strided=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_gated_product_is_silu_of_the_gate_times_the_up(m, f_blocks, k, strided, seed):
    """gemm_dot_silu over pack_dot_gated's copy: silu(x W_gate^T) * (x W_up^T)
    from float32 sums, rounded once to bf16, against float64 of the same bf16
    values; and the gated layer's plain product gives gate then up columns."""
    gen = torch.Generator().manual_seed(seed)
    f = 16 * f_blocks
    wide = torch.randn(m, k + 6, generator=gen).bfloat16()
    x = wide[:, 3 : 3 + k] if strided else wide[:, :k].contiguous()
    w = torch.randn(2 * f, k, generator=gen).bfloat16()
    y = torch.ops.stallfree.gemm_dot_silu(x, torch.ops.stallfree.pack_dot_gated(w))
    assert y.shape == (m, f) and y.dtype == torch.bfloat16
    want = silu_mul_of(product(x, w, None))
    # the sums' error (k 2^-23 of the terms' scale) carried through silu and the product, then one rounding
    scale = x.double().abs() @ w.double().abs().T
    gate_err, up_err = (scale * k * 2**-23).chunk(2, dim=-1)
    gate, up = product(x, w, None).chunk(2, dim=-1)
    tol = 1.2 * (gate_err * up.abs() + (gate.abs() + gate_err) * up_err) + want.abs() * 2**-8 + 1e-30
    assert ((y.double() - want).abs() <= tol).all()
    layer = kernels.Linear(w, gated=True)
    assert layer.gated and layer.dot is not None
    assert torch.allclose(layer(x.contiguous()).double(), product(x, w, None), rtol=2**-7, atol=1e-3)


@needs_dot
def test_bad_shapes_are_refused():
    ops = torch.ops.stallfree
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.pack_dot(torch.randn(48, 64).bfloat16())
    with pytest.raises(RuntimeError, match="disagree on K"):
        ops.gemm_dot(torch.randn(4, 62).bfloat16(), ops.pack_dot(torch.randn(32, 64).bfloat16()), None, False)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.pack_dot_gated(torch.randn(48, 64).bfloat16())
    with pytest.raises(RuntimeError, match="disagree on K"):
        ops.gemm_dot_silu(torch.randn(4, 62).bfloat16(), ops.pack_dot_gated(torch.randn(32, 64).bfloat16()))


def test_bf16_layers_take_the_dot_kernel_where_it_runs():
    """Every batch size of a bf16 layer, where the CPU has the instruction but
    no AMX (AMX's brgemm takes the layers there)."""
    layer = kernels.Linear(torch.randn(64, 96).bfloat16(), float_out=True)
    assert dot_available() == (cpu_build.detect_isa() == "avx512-bf16")
    assert (layer.dot is not None) == (dot_available() and not cpu_build.has_amx())
    x = torch.randn(70, 96).bfloat16()
    y = layer(x)
    assert y.dtype == torch.float32
    assert torch.allclose(y.double(), product(x, layer.weight, None), rtol=1e-4, atol=1e-4)


def test_the_start_up_log_names_the_kind_and_each_ops_path(tiny_model):
    """``stallfree serve`` logs these facts at start-up (``engine_started``)."""
    from stallfree.cli.serve import runner_facts
    from stallfree.core.model.model_runner import ModelRunner

    runner = ModelRunner(tiny_model, 64, 16, torch.bfloat16, torch.device("cpu"))
    paths = runner_facts(runner)["kernel_paths"]
    assert isinstance(paths, dict) and paths["kind"] == cpu_build.kind()
    assert ("vdpbf16ps" in paths["linear"]) == (dot_available() and not cpu_build.has_amx())
    assert ("brgemm" in paths["linear"]) == cpu_build.has_amx()
    assert ("vdpbf16ps" in paths["attention prefill"]) == (dot_available() and not cpu_build.has_amx())
    assert paths["head"].startswith("float32")
    assert ("vdpbf16ps" in paths["attention decode"]) == dot_available()
    # the tiny model's heads of 16 are not the native RoPE's: its layers go op by op
    assert paths["layer loop"] == "op by op from Python"
