"""The C++ CPU kernels (kernels/csrc) against the torch reference, the build, and the fallback."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.accuracy.greedy_agreement import greedy
from stallfree import kernels
from stallfree.core.model.llama import rope_cos_sin
from stallfree.core.model.loader import load_model
from stallfree.core.model.model_config import ModelConfig
from stallfree.core.model.model_runner import ModelRunner
from stallfree.kernels import build_attention_meta, cpu_build, reference

CPU = torch.device("cpu")
NO_INT8 = "ATen offers no int8 brgemm here (it does with AMX-INT8 only)"


@pytest.fixture(scope="module")
def ops():
    """The native ops; the build must succeed wherever a C++ compiler exists (CI included)."""
    status = cpu_build.status()
    assert shutil.which("c++"), "no C++ compiler: the project's set-up installs gcc"
    assert status.backend == "native", f"the CPU kernels did not build: {status}"
    from stallfree.kernels import cpu_ops

    return cpu_ops


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    return torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)


@st.composite
def batches(draw):
    """A ragged mixed batch: decodes first, then chunks with and without a cached
    prefix (1-token chunks included), scattered blocks, partial last blocks."""
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 3, 4, 8, 12]))  # 12: decode runs groups past 8 in slices
    dim = draw(st.sampled_from([16, 32, 64, 128]))
    block_size = draw(st.sampled_from([1, 4, 16, 32]))
    decodes = draw(st.lists(st.integers(1, 300), max_size=5))  # context lengths
    chunks = draw(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 130)), max_size=3))  # (prefix, new)
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return kv_heads, group, dim, block_size, decodes, chunks, dtype


def tiles(ops, kind: str) -> contextlib.AbstractContextManager[None]:
    """Prefill tiles as this machine runs them (AMX's own instructions for bf16
    heads of 64 where it has them, else oneDNN's brgemm), through brgemm, or
    forced onto the hand-written kernel."""
    return {
        "as built": contextlib.nullcontext(),
        "brgemm": ops.brgemm_tiles(),
        "hand-written": ops.hand_written_tiles(),
    }[kind]


@pytest.mark.parametrize("kind", ["as built", "brgemm", "hand-written"])
@settings(max_examples=60, deadline=None)
@given(batch=batches(), seed=st.integers(0, 2**16))
def test_paged_attention_matches_the_reference(ops, kind, batch, seed):
    with tiles(ops, kind):
        check_paged_attention(ops, batch, seed)


def test_the_tiles_run_on_brgemm_where_the_cpu_has_it(ops):
    """AVX2 and AVX-512 builds run float32 tiles on brgemm; bf16 ones run on
    AMX's brgemm or the AVX512-BF16 dot-product kernel (the ``avx512-bf16`` build)."""
    expected = set()
    if cpu_build.detect_isa() != "generic":
        expected.add(torch.float32)
    if cpu_build.detect_isa() == "avx512-bf16":
        expected.add(torch.bfloat16)
    assert ops.brgemm_dtypes() == expected
    with ops.hand_written_tiles():
        assert ops.ops.attention_brgemm(False) == 0


def test_bf16_tiles_run_on_amx_where_the_cpu_has_it(ops):
    """AMX's own instructions for bf16 prefill tiles exactly where the kind is
    ``amx`` (not under a forced ISA); ``brgemm_tiles`` turns them off."""
    assert ops.amx_tiles() == (cpu_build.kind() == "amx" and not os.environ.get("STALLFREE_CPU_ISA"))
    with ops.brgemm_tiles():
        assert not ops.ops.attention_amx(False)


@pytest.mark.parametrize("kind", ["as built", "brgemm"])
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("group", [3, 12])
def test_bf16_decodes_of_every_length_match_the_reference(ops, kind, block_size, group):
    """Decodes of heads of 64 in bf16: where the kind is ``amx`` their scores
    are tile products over the cache's 16-token groups as they lie (blocks a
    multiple of 16; others, and ``brgemm_tiles``, take the dot-product loop).
    Lengths around the 16-token groups and the 64-token tiles, partial last
    blocks, groups past 8 (two slices)."""
    lengths = [1, 2, 15, 16, 17, 31, 63, 64, 65, 129, 300]
    with tiles(ops, kind):
        check_paged_attention(ops, (3, group, 64, block_size, lengths, [], torch.bfloat16), seed=block_size + group)


@pytest.mark.parametrize("kind", ["as built", "brgemm"])
def test_a_chunk_whose_later_keys_score_far_higher_matches_the_reference(ops, kind):
    """Keys whose scores grow along the sequence: each query vector's maximum
    passes its first KV tile's by more than 2^8 (log2 units) in a later tile,
    which makes the AMX and dot-product tiles rescale (their reference
    maximum otherwise stands); bf16, heads of 64, a chunk of 100 after 300
    cached tokens."""
    torch.manual_seed(5)
    heads, kv_heads, dim, bs, prefix, new = 9, 3, 64, 16, 300, 100
    nblocks = -(-(prefix + new) // bs)
    growth = (1 + torch.arange(nblocks * bs, dtype=torch.float32) / 40).view(nblocks, bs, 1, 1)
    k_cache = (torch.randn(nblocks, bs, kv_heads, dim) * growth).bfloat16()
    v_cache = torch.randn(nblocks, bs, kv_heads, dim).bfloat16()
    q = (torch.randn(new, heads, dim) * 3).bfloat16()
    meta = build_attention_meta([list(range(nblocks))], [prefix + new], [new], 0, bs, CPU)
    scale = dim**-0.5
    keys = k_cache.float().view(-1, kv_heads, dim)[: prefix + new].repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale * 1.4426950408889634  # log2 units
    first_tile_max = scores[:, :, :128].amax(-1)
    assert bool((scores.amax(-1) > first_tile_max + 8).all())  # every vector rescales at least once
    with tiles(ops, kind):
        out = ops.paged_attention(q, k_cache, v_cache, meta, scale)
    assert close(out, reference.paged_attention(q, k_cache, v_cache, meta, scale), torch.bfloat16)


def check_paged_attention(ops, batch, seed) -> None:
    kv_heads, group, dim, bs, decodes, chunks, dtype = batch
    seqs = [(n - 1, 1) for n in decodes] + chunks
    if not seqs:
        return
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(p + n) // bs) for p, n in seqs]
    num_blocks = sum(blocks_needed) + 3
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(nb)] for nb in blocks_needed]
    meta = build_attention_meta(tables, [p + n for p, n in seqs], [n for _, n in seqs], len(decodes), bs, CPU)
    q = torch.randn(sum(n for _, n in seqs), kv_heads * group, dim, generator=gen).to(dtype)
    out = ops.paged_attention(q, k_cache, v_cache, meta, dim**-0.5)
    ref = reference.paged_attention(q, k_cache, v_cache, meta, dim**-0.5)
    assert out.shape == ref.shape and out.dtype == dtype
    assert close(out, ref, dtype)


def test_paged_attention_reads_q_rows_strided_like_the_qkv_split(ops):
    torch.manual_seed(1)
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    qkv = torch.randn(40, (heads + 2 * kv_heads) * dim)
    q = qkv[:, : heads * dim].view(40, heads, dim)
    k_cache, v_cache = torch.randn(8, bs, kv_heads, dim), torch.randn(8, bs, kv_heads, dim)
    meta = build_attention_meta([[3, 1, 5], [0, 7]], [40, 20], [30, 10], 0, bs, CPU)
    out = ops.paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert close(out, reference.paged_attention(q.contiguous(), k_cache, v_cache, meta, 0.125), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_elementwise_ops_match_the_reference(ops, dtype):
    torch.manual_seed(2)
    x = torch.randn(7, 576, dtype=dtype)
    residual = torch.randn(7, 576)
    w = (1 + 0.1 * torch.randn(576)).to(dtype)
    assert close(ops.rms_norm(residual, w, 1e-5), reference.rms_norm(residual, w, 1e-5), dtype)
    want_out, want_res = reference.add_rms_norm(x, residual, w, 1e-5)
    got_out, got_res = ops.add_rms_norm(x, residual.clone(), w, 1e-5)
    assert close(got_out, want_out, dtype) and torch.allclose(got_res, want_res)
    gate_up = torch.randn(7, 2 * 1536, dtype=dtype) * 4
    assert close(ops.silu_mul(gate_up), reference.silu_mul(gate_up), dtype)
    cos_sin = rope_cos_sin(dataclasses.replace(ModelConfig.tiny(), head_dim=64), CPU)
    qkv = torch.randn(7, (9 + 2 * 3) * 64, dtype=dtype)
    q, k = qkv[:, : 9 * 64].view(7, 9, 64), qkv[:, 9 * 64 : 12 * 64].view(7, 3, 64)
    positions = torch.tensor([0, 1, 5, 17, 300, 301, 4000])
    want_q, want_k = reference.rope(q, k, positions, cos_sin)
    got_q, got_k = ops.rope(q, k, positions, cos_sin)
    assert close(got_q, want_q, dtype) and close(got_k, want_k, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_the_reference(ops, dtype):
    """Rows strided like the QKV split land in the slots index_copy_ puts them in;
    a slot past the cache is refused, nothing written."""
    torch.manual_seed(4)
    qkv = torch.randn(5, (9 + 2 * 3) * 64, dtype=dtype)
    k, v = qkv[:, 9 * 64 : 12 * 64].view(5, 3, 64), qkv[:, 12 * 64 :].view(5, 3, 64)
    slots = torch.tensor([3, 17, 0, 40, 63])
    caches = [torch.randn(4, 16, 3, 64, dtype=dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    reference.write_kv(*want, k, v, slots)
    ops.write_kv(*caches, k, v, slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    before = [c.clone() for c in caches]
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.write_kv(*caches, k, v, torch.tensor([3, 17, 0, 40, 64]))
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])


@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_is_the_first_largest_entry_as_torchs_max(ops, threads):
    """Random rows, ties inside a lane, across lanes and in the tail, rows of
    -inf, NaN (the first NaN, as torch's max propagates it), widths under a
    vector and with a tail, rows strided as a slice of a wider tensor."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(threads)
        for n in (1, 5, 16, 63, 64, 65, 200, 49152):
            x = torch.randn(9, n + 3, generator=gen)[:, :n]  # rows n + 3 apart
            assert x.stride(1) == 1 and x.stride(0) == n + 3
            x[1] = 0.0  # all tied: index 0
            x[2] = -float("inf")
            x[3, n // 2 :] = 7.0  # a run of the largest: its first index
            x[4, -1] = x[4, 0] = 9.0  # the first and the last
            x[5, n // 3] = float("nan")
            x[6, -1] = 11.0  # only in the tail
            x[7, :] = torch.randint(0, 3, (n,), generator=gen).float()  # many ties at 2
            want = x.max(dim=-1).indices
            got = ops.argmax(x)
            assert got.dtype == torch.long and torch.equal(got, want), (n, got, want)
        assert torch.equal(ops.argmax(torch.zeros(0, 8)), torch.zeros(0, dtype=torch.long))
    finally:
        torch.set_num_threads(before)


def test_argmax_of_other_dtypes_is_the_references(ops):
    x = torch.randn(3, 40).bfloat16()
    assert torch.equal(ops.argmax(x), reference.argmax(x))


def test_rms_norm_leaves_its_input_alone(ops):
    x = torch.randn(3, 64)
    before = x.clone()
    ops.rms_norm(x, torch.ones(64), 1e-5)
    assert torch.equal(x, before)


def test_unsupported_shapes_fall_back_to_the_reference(ops):
    x = torch.randn(3, 40)  # not a multiple of the SIMD width
    w = torch.ones(40)
    assert torch.allclose(ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
    assert torch.allclose(ops.silu_mul(x), reference.silu_mul(x))


def test_dispatch_uses_the_native_kernels_on_cpu(ops):
    assert kernels._impl(torch.zeros(1)) is ops
    assert kernels.backend(torch.device("cpu")).startswith("native-")


def _backend_in_subprocess(env: dict[str, str]) -> str:
    code = (
        "import kernels, torch; print(kernels.backend(torch.device('cpu')));"
        "print(kernels._impl(torch.zeros(1)).__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=120, check=True
    )
    return out.stdout + out.stderr


@pytest.mark.slow
def test_fallback_can_be_forced():
    out = _backend_in_subprocess({"STALLFREE_CPU_KERNELS": "reference"})
    assert "reference (STALLFREE_CPU_KERNELS=reference)" in out
    assert "kernels.reference" in out


@pytest.mark.slow
def test_missing_compiler_falls_back_with_a_log_line(tmp_path):
    """No c++ on PATH (and an empty build cache): the reference runs and a warning says why."""
    out = _backend_in_subprocess({"PATH": str(tmp_path), "STALLFREE_KERNEL_CACHE": str(tmp_path / "cache")})
    assert "c++ not found; using the torch reference" in out
    assert "kernels.reference" in out


def test_isa_detection_picks_the_best_available():
    assert cpu_build.detect_isa({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}) == "avx512"
    assert cpu_build.detect_isa({"avx2", "fma", "f16c"}) == "avx2"
    assert cpu_build.detect_isa(set()) == "generic"
    assert cpu_build.has_amx({"amx_bf16", "amx_tile"}) and not cpu_build.has_amx({"avx512_bf16"})
    zen4 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
    assert cpu_build.detect_isa(zen4) == cpu_build.kind(zen4) == "avx512-bf16"
    assert cpu_build.kind(zen4 | {"amx_bf16", "amx_tile"}) == "amx"


def test_a_forced_isa_must_be_one_this_cpu_runs(monkeypatch):
    avx2 = {"avx2", "fma", "f16c"}
    monkeypatch.setenv("STALLFREE_CPU_ISA", "avx2")
    assert cpu_build.detect_isa(avx2) == "avx2" and not cpu_build.has_amx()
    monkeypatch.setenv("STALLFREE_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="STALLFREE_CPU_ISA=avx512: this CPU runs avx2, generic"):
        cpu_build.detect_isa(avx2)


@pytest.mark.skipif("avx2" not in cpu_build.cpu_flags(), reason="the CPU cannot execute an AVX2 build")
def test_the_default_dtype_follows_the_kind_a_forced_isa_names(monkeypatch):
    """--dtype auto is bf16 on the kinds with bf16 arithmetic only, so an
    emulated AVX2 machine runs float32 as a real one would."""
    from stallfree.core.model.model_runner import resolve_dtype

    monkeypatch.setenv("STALLFREE_CPU_ISA", "avx2")
    assert cpu_build.kind() == "avx2" and resolve_dtype("auto", CPU) == torch.float32


@pytest.fixture(scope="module")
def smollm():
    return load_model(None)


@pytest.mark.slow
def test_real_model_greedy_output_is_identical_to_the_reference_path(ops, smollm):
    """The embedded SmolLM2 in float32, chunked (budget 64): the native kernels and
    the torch reference produce the same greedy tokens on a fixed prompt set."""
    runner = ModelRunner(smollm, 128, 16, torch.float32, CPU)
    prompts = [
        smollm.tokenizer.encode("The capital of France is"),
        smollm.tokenizer.encode("def fibonacci(n):\n    " * 12),
        smollm.tokenizer.encode("Once upon a time, in a land far away, " * 10),
    ]
    native_out = [greedy(runner, p, 16) for p in prompts]
    with kernels.cpu_path(reference):
        reference_out = [greedy(runner, p, 16) for p in prompts]
    assert kernels._impl(torch.zeros(1)) is ops  # restored after the block
    assert native_out == reference_out


@settings(max_examples=20, deadline=None)
@given(
    rows=st.sampled_from([1, 7, 33, 80]),
    k=st.sampled_from([64, 96, 576]),
    n=st.sampled_from([64, 72, 576]),
    seed=st.integers(0, 999),
)
def test_float_out_layers_give_unrounded_float32_products(ops, rows, k, n, seed):
    """bf16 operands, float32 output (brgemm where it runs, else a float32 GEMM):
    equal to the float32 product of the same bf16 values up to summation order,
    far inside bf16's own output rounding."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    layer = kernels.Linear(w, bias, float_out=True)
    y = kernels.linear(layer, x)
    exact = x.double() @ w.double().t() + bias.double()
    assert y.dtype == torch.float32
    assert (y.double() - exact).abs().max() <= 1e-5 * exact.abs().max() * k**0.5
    rounded = kernels.linear(kernels.Linear(w, bias), x)  # bf16 out: what float_out avoids
    assert rounded.dtype == torch.bfloat16


def test_bf16_layers_run_on_brgemm_where_the_cpu_has_amx(ops, monkeypatch):
    """With AMX, decode-sized bf16 batches (and every float_out batch) take
    gemm_vnni; larger bf16-out batches oneDNN's matmul."""
    layer = kernels.Linear(torch.randn(64, 64).bfloat16(), float_out=True)
    assert (layer.vnni is not None) == cpu_build.has_amx()
    if layer.vnni is None:
        return
    calls: list[int] = []
    vnni = torch.ops.stallfree.gemm_vnni

    def spy(x, *args):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return vnni(x, *args)

    monkeypatch.setattr(torch.ops.stallfree, "gemm_vnni", spy)
    plain = kernels.Linear(torch.randn(64, 64).bfloat16())
    rows = kernels.Linear.VNNI_ROWS
    for m in (1, rows, rows + 1):
        plain(torch.randn(m, 64).bfloat16())
        layer(torch.randn(m, 64).bfloat16())
    assert calls == [1, 1, rows, rows, rows + 1]  # the bf16-out layer's largest batch went to oneDNN


@pytest.mark.skipif(not cpu_build.has_amx(), reason="gemm_vnni needs ATen's bf16 brgemm: AMX")
@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 70),
    n_blocks=st.integers(1, 3),
    k=st.sampled_from([2, 64, 96, 576]),
    bias=st.booleans(),
    float_out=st.booleans(),
    strided=st.booleans(),
    seed=st.integers(0, 999),
)
def test_gemm_vnni_matches_a_float64_product(ops, rows, n_blocks, k, bias, float_out, strided, seed):
    """float32 sums of the bf16 products, rounded once to bf16 unless float_out."""
    gen = torch.Generator().manual_seed(seed)
    n = 64 * n_blocks
    wide = torch.randn(rows, k + 6, generator=gen).bfloat16()
    x = wide[:, 3 : 3 + k] if strided else wide[:, :k].contiguous()  # rows strided like the QKV split
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    y = torch.ops.stallfree.gemm_vnni(x, torch.ops.stallfree.pack_bf16(w), n, b, float_out)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    assert y.shape == (rows, n) and y.dtype == (torch.float32 if float_out else torch.bfloat16)
    tol = scale * (k * 2**-23 + (0 if float_out else 2**-8)) + 1e-30
    assert ((y.double() - exact).abs() <= tol).all()


def test_the_roofline_probe_gives_sane_figures(ops):
    """Positive and under what any CPU core could do (6 GHz, two 512-bit FMA
    ports, AMX's 1,024 bf16 MACs a cycle). No relation between two rates is
    asserted: the tests share the cores, so one probe may run slowed."""
    from stallfree.kernels import roofline

    ghz = 6e9
    r = roofline.measure(seconds=0.02, runs=1)
    assert r is not None
    assert 1e9 < r.fma_f32 <= 2 * 16 * 2 * ghz
    assert 0 < r.brgemm_f32 <= 2 * 16 * 2 * ghz
    assert 0 <= r.brgemm_bf16 <= 2 * 1024 * ghz and (r.brgemm_bf16 > 0) == cpu_build.has_amx(cpu_build.cpu_flags())
    assert 0 <= r.brgemm_int8 <= 2 * 2048 * ghz
    assert 1e8 < r.read_bw <= 500e9
    assert 0 <= r.dot_bf16 <= 2 * 2 * 16 * 2 * ghz and (r.dot_bf16 > 0) == (cpu_build.detect_isa() == "avx512-bf16")
    assert r.peak(torch.bfloat16) == (r.brgemm_bf16 or r.dot_bf16 or r.fma_f32) and r.peak(torch.float32) == r.fma_f32


@pytest.mark.skipif(not kernels.linear_int8_available(), reason=NO_INT8)
@settings(max_examples=10, deadline=None)
@given(rows=st.sampled_from([65, 130, 512]), k=st.sampled_from([64, 576]), seed=st.integers(0, 999))
def test_int8_gemm_matches_its_dequantized_reference(ops, rows, k, seed):
    """gemm_int8 = the float64 product of the int8 values it computes with (the
    activations quantized as the kernel does, in float32: x * (1 / scale),
    rounded half to even), scaled back, within 1e-3 of the output's range;
    and within a few % of the float32 GEMM."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(128, k, generator=gen) * 0.05
    x = torch.randn(rows, k, generator=gen)
    layer = kernels.Linear(w, int8=True)
    _, scale, shift = layer.int8
    y = kernels.linear(layer, x)
    wq = (w / scale[:, None]).round().clamp(-127, 127).double()
    sx = x.abs().amax(1, keepdim=True) / 127
    xq = (x * (1 / sx)).round().double()
    ref = (xq @ wq.t()) * sx.double() * scale.double()
    assert (y.double() - ref).abs().max() <= 1e-3 * ref.abs().max()
    exact = x.double() @ w.double().t()
    assert (y.double() - exact).abs().max() <= 0.05 * exact.abs().max()
    assert shift.tolist() == (wq.sum(1) * 128).long().tolist()


@pytest.mark.skipif(not kernels.linear_int8_available(), reason=NO_INT8)
@pytest.mark.parametrize("compact", [True, False])
def test_int8_layers_leave_decode_sized_batches_exact(ops, compact):
    """Up to COMPACT_ROWS rows an int8 layer gives the float layer's output, with
    a compact copy (bf16-exact weights) or without one; above, it runs int8."""
    w = torch.randn(128, 64)
    if compact:
        w = w.bfloat16().float()
    plain, int8 = kernels.Linear(w), kernels.Linear(w, int8=True)
    assert (plain.compact is not None) == compact
    x = torch.randn(kernels.Linear.COMPACT_ROWS, 64)
    assert torch.equal(kernels.linear(int8, x), kernels.linear(plain, x))
    big = torch.randn(kernels.Linear.COMPACT_ROWS + 1, 64)
    assert not torch.equal(kernels.linear(int8, big), kernels.linear(plain, big))


LESSER_ISAS = [
    isa
    for isa, (needs, _) in cpu_build.ISAS.items()
    if isa not in (cpu_build.detect_isa(), "generic") and set(needs) <= cpu_build.cpu_flags()
]


@pytest.mark.slow
@pytest.mark.parametrize("isa", LESSER_ISAS)
def test_kernels_built_for_a_lesser_isa_match_the_reference(isa):
    """The kinds this machine is not, as far as it can execute them: the
    kernel property tests again on a build for that ISA (``STALLFREE_CPU_ISA``),
    in a fresh interpreter (one build loads per process)."""
    tests = [
        "tests/test_cpu_kernels.py::test_paged_attention_matches_the_reference",
        "tests/test_cpu_kernels.py::test_elementwise_ops_match_the_reference",
        "tests/test_cpu_kernels.py::test_argmax_is_the_first_largest_entry_as_torchs_max",
        "tests/test_cpu_kernels.py::test_the_tiles_run_on_brgemm_where_the_cpu_has_it",
        "tests/test_compact_gemm.py",
        "tests/test_dot_gemm.py",
        "tests/test_screened_head.py",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        env={**os.environ, "STALLFREE_CPU_ISA": isa},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout
    code = "from kernels import cpu_build; print(cpu_build.status())"
    built = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "STALLFREE_CPU_ISA": isa}, capture_output=True, text=True
    )
    assert built.stdout.strip() == f"native-{isa}"
