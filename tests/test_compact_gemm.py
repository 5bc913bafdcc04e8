"""The decode-sized GEMMs over compact weights (kernels/csrc/gemm.cpp): the
weights they widen are the loader's float32 weights bit for bit, and their
products match float32 matmuls for every batch height and shape they take."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree import kernels
from stallfree.core.model.gguf import Q4_1, Q8_0, dequantize
from stallfree.core.model.llama import LlamaModel
from stallfree.core.model.loader import load_model
from stallfree.kernels import cpu_build
from stallfree.kernels.compact import Quantized, compact_weight

GGML = {"Q4_1": Q4_1, "Q8_0": Q8_0}


@pytest.fixture(scope="module", autouse=True)
def native():
    assert cpu_build.status().backend == "native", f"the CPU kernels did not build: {cpu_build.status()}"


def random_blocks(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    """GGUF rows of random blocks: fp16 scale (and minimum for Q4_1), then the quants."""
    g = torch.Generator().manual_seed(seed)
    kb = k // 32

    def half(scale: float) -> torch.Tensor:
        return (torch.randn(n, kb, generator=g) * scale).half().view(torch.uint8).reshape(n, kb, 2)

    if kind == "Q4_1":
        quants = torch.randint(0, 256, (n, kb, 16), generator=g, dtype=torch.uint8)
        return torch.cat([half(0.01), half(0.05), quants], -1).reshape(n, -1)
    quants = torch.randint(-128, 128, (n, kb, 32), generator=g, dtype=torch.int8).view(torch.uint8)
    return torch.cat([half(0.01), quants], -1).reshape(n, -1)


def dequantized(kind: str, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks.numpy().reshape(-1), GGML[kind], n * k).reshape(n, k))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_widened_weights_are_the_dequantized_ones_bit_for_bit(kind):
    n, k = 96, 320  # K over two widened slices (gemm.cpp's KC), the second partial
    blocks = random_blocks(kind, n, k, seed=1)
    weight = dequantized(kind, blocks, n, k)
    compact = compact_weight(weight, Quantized(kind, blocks))
    assert compact is not None and compact.kind == kind.lower()
    # identity rows pick out single weights: every product is exact
    for rows in (torch.eye(k)[:5], torch.eye(k)):  # one register tile, and many (the widened scratch)
        assert torch.equal(compact(rows, None), weight[:, : rows.shape[0]].T.contiguous())


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["Q4_1", "Q8_0", "bf16"]),
    rows=st.integers(1, 80),
    k_blocks=st.integers(1, 12),  # K up to 384: past one widened slice
    n_blocks=st.integers(1, 4),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_products_match_float32_matmul(kind, rows, k_blocks, n_blocks, bias, seed):
    n, k = n_blocks * 2 * torch.ops.stallfree.simd_width(), k_blocks * 32
    g = torch.Generator().manual_seed(seed)
    if kind == "bf16":
        weight, quantized = torch.randn(n, k, generator=g).bfloat16().float(), None
    else:
        blocks = random_blocks(kind, n, k, seed)
        weight, quantized = dequantized(kind, blocks, n, k), Quantized(kind, blocks)
    compact = compact_weight(weight, quantized)
    assert compact is not None and compact.kind == kind.lower()
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    expected = x.double() @ weight.double().T + (0 if b is None else b.double())
    assert torch.allclose(compact(x, b).double(), expected, rtol=1e-5, atol=1e-4)


def test_no_compact_copy_unless_exact_and_the_shape_fits():
    width = torch.ops.stallfree.simd_width()
    assert compact_weight(torch.randn(2 * width, 64), None) is None  # float32 values: bf16 would round them
    assert compact_weight(torch.ones(2 * width + 1, 64), None) is None  # rows not a whole column block
    assert compact_weight(torch.ones(2 * width, 48), None) is None  # K not whole GGUF blocks
    assert compact_weight(torch.ones(2 * width, 64), None).kind == "bf16"


def test_dispatch_reads_compact_weights_only_for_decode_sized_batches():
    width = torch.ops.stallfree.simd_width()
    layer = kernels.Linear(torch.randn(2 * width, 64).bfloat16().float())
    calls = []
    compact = layer.compact

    def spy(x, bias):
        calls.append(x.shape[0])
        return compact(x, bias)

    layer.compact = spy
    for rows in (1, layer.COMPACT_ROWS, layer.COMPACT_ROWS + 1):
        x = torch.randn(rows, 64)
        assert torch.allclose(kernels.linear(layer, x), x @ layer.weight.T, rtol=1e-5, atol=1e-5)
    assert calls == [1, layer.COMPACT_ROWS]
    with kernels.cpu_path(kernels.reference):
        kernels.linear(layer, torch.randn(1, 64))
    assert calls == [1, layer.COMPACT_ROWS]  # the reference path never does


@pytest.mark.slow
def test_embedded_model_layers_widen_to_the_loaders_float32_weights():
    """The real file: Q8_0 embeddings (tied head), Q4_1 layers, Q/K rows un-permuted."""
    loaded = load_model(None)
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, torch.device("cpu"), loaded.quantized)
    layer = model.layers[0]
    for linear, kind in ((model.lm_head, "q8_0"), (layer.qkv, "q4_1"), (layer.gate_up, "q4_1"), (layer.down, "q4_1")):
        assert linear.compact is not None and linear.compact.kind == kind
        k = linear.weight.shape[1]
        assert torch.equal(linear.compact(torch.eye(k)[:40], None), linear.weight[:, :40].T.contiguous())
