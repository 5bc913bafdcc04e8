"""Every Triton kernel against its torch reference, on CPU under Triton's interpreter.

TRITON_INTERPRET must be set before the kernel module is imported (the
dispatch point imports it only for CUDA tensors, so nothing has before).
The interpreter holds bf16 as raw bits: the kernels upcast right after
loading, and bf16 results are compared with a tolerance that covers the
truncating fp32 -> bf16 store (about 8e-3).
"""

from __future__ import annotations

import os
import sys

assert "stallfree.kernels.triton_ops" not in sys.modules, "imported before TRITON_INTERPRET was set"
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from stallfree.core.model.llama import rope_cos_sin  # noqa: E402
from stallfree.core.model.model_config import ModelConfig  # noqa: E402
from stallfree.kernels import build_attention_meta, reference  # noqa: E402
from stallfree.kernels import triton_ops as tri  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = 1e-4 if dtype == torch.float32 else 1.5e-2
    return torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_residual_add(dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 96, dtype=dtype)
    residual = torch.randn(5, 96)
    w = (1 + 0.1 * torch.randn(96)).to(dtype)
    assert close(tri.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), dtype)
    out, res = tri.add_rms_norm(x, residual, w, 1e-5)
    ref_out, ref_res = reference.add_rms_norm(x, residual, w, 1e-5)
    assert res.dtype == torch.float32 and torch.allclose(res, ref_res, atol=1e-5)
    assert close(out, ref_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    torch.manual_seed(1)
    x = torch.randn(7, 2 * 80, dtype=dtype) * 3
    assert close(tri.silu_mul(x), reference.silu_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope(dtype):
    torch.manual_seed(2)
    cos_sin = rope_cos_sin(ModelConfig.tiny(), torch.device("cpu"))
    q = torch.randn(6, 4, 16, dtype=dtype)
    k = torch.randn(6, 2, 16, dtype=dtype)
    positions = torch.tensor([0, 1, 7, 300, 4095, 9])
    tq, tk = tri.rope(q, k, positions, cos_sin)
    rq, rk = reference.rope(q, k, positions, cos_sin)
    assert close(tq, rq, dtype)
    assert close(tk, rk, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv(dtype):
    torch.manual_seed(3)
    caches = [torch.zeros(6, 16, 2, 32, dtype=dtype) for _ in range(4)]
    k, v = torch.randn(9, 2, 32, dtype=dtype), torch.randn(9, 2, 32, dtype=dtype)
    slots = torch.randperm(6 * 16)[:9]
    tri.write_kv(caches[0], caches[1], k, v, slots)
    reference.write_kv(caches[2], caches[3], k, v, slots)
    assert torch.equal(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3])
    tri.write_kv(caches[0], caches[1], k[:0], v[:0], slots[:0])  # nothing to write


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_ragged_mixed_batch(dtype):
    """Decodes at block boundaries, chunks with and without a prefix, a 1-token
    chunk, an empty sequence, GQA and scattered blocks, in one launch."""
    torch.manual_seed(4)
    heads, kv_heads, dim, bs, num_blocks = 4, 2, 32, 16, 24
    # (tokens already cached, new query tokens); decodes first
    seqs = [(0, 1), (15, 1), (16, 1), (31, 1), (0, 20), (16, 33), (5, 1), (9, 0)]
    num_decodes = 4
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim, dtype=dtype)  # garbage where unused
    v_cache = torch.randn(num_blocks, bs, kv_heads, dim, dtype=dtype)
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(max(1, -(-(p + n) // bs)))] for p, n in seqs]
    meta = build_attention_meta(
        tables, [p + n for p, n in seqs], [n for _, n in seqs], num_decodes, bs, torch.device("cpu")
    )
    q = torch.randn(sum(n for _, n in seqs), heads, dim, dtype=dtype)
    out = tri.paged_attention(q, k_cache, v_cache, meta, dim**-0.5)
    ref = reference.paged_attention(q, k_cache, v_cache, meta, dim**-0.5)
    assert out.shape == ref.shape
    assert close(out, ref, dtype)


def test_dispatch_never_picks_triton_for_cpu_tensors():
    from stallfree import kernels

    assert kernels._impl(torch.zeros(1)) is kernels._cpu()
    assert kernels._impl(torch.zeros(1)) is not tri


def test_gpu_script_is_ready_and_refuses_without_cuda(monkeypatch):
    from bench.kernels import gpu_kernels

    monkeypatch.setattr(sys, "argv", ["gpu_kernels"])
    with pytest.raises(SystemExit, match="no CUDA device"):
        gpu_kernels.main()
