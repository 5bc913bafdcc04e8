"""GPU check of the Triton kernels (one run, well under 10 minutes on an H200).

    python -m bench.kernels.gpu_kernels [--out bench/results/gpu]

1. Correctness of every kernel against its torch reference on the GPU (bf16).
2. Paged attention throughput for decode-heavy, prefill-heavy and mixed
   batches, against the memory-bandwidth and FLOP roofline.
3. A whole decode step of a model against the weight-read roofline.
4. flashinfer side by side for the decode-heavy batch, if it imports.
Writes gpu.json and gpu.md under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from bench.record import table
from stallfree.core.model.llama import LlamaModel, rope_cos_sin
from stallfree.core.model.model_config import ModelConfig
from stallfree.kernels import build_attention_meta, reference
from stallfree.kernels import triton_ops as tri

HBM_BYTES_S = 4.8e12  # H200
BF16_FLOPS = 790e12  # dense bf16, measured on that machine


def timed_ms(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def batch(seqs: list[tuple[int, int]], num_decodes: int, heads: int, kv_heads: int, dim: int, bs: int = 16):
    """Random caches and queries for (cached prefix, new tokens) sequences, decodes first."""
    dev = torch.device("cuda")
    blocks_needed = sum(-(-(p + n) // bs) for p, n in seqs)
    k_cache = torch.randn(blocks_needed, bs, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(blocks_needed).tolist()
    tables, at = [], 0
    for p, n in seqs:
        nb = -(-(p + n) // bs)
        tables.append(perm[at : at + nb])
        at += nb
    meta = build_attention_meta(tables, [p + n for p, n in seqs], [n for _, n in seqs], num_decodes, bs, dev)
    q = torch.randn(sum(n for _, n in seqs), heads, dim, device=dev, dtype=torch.bfloat16)
    return q, k_cache, v_cache, meta


def correctness() -> dict[str, float]:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    errs: dict[str, float] = {}
    x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
    res = torch.randn(64, 4096, device=dev)
    w = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    errs["rms_norm"] = (tri.rms_norm(x, w, 1e-5).float() - reference.rms_norm(x, w, 1e-5).float()).abs().max().item()
    a, b = tri.add_rms_norm(x, res, w, 1e-5), reference.add_rms_norm(x, res, w, 1e-5)
    errs["add_rms_norm"] = max((a[0].float() - b[0].float()).abs().max().item(), (a[1] - b[1]).abs().max().item())
    g = torch.randn(64, 2 * 14336, device=dev, dtype=torch.bfloat16)
    errs["silu_mul"] = (tri.silu_mul(g).float() - reference.silu_mul(g).float()).abs().max().item()
    cfg = ModelConfig("rope", 32000, 4096, 14336, 1, 32, 8, 128, 500000.0, 1e-5, 8192, False)
    cs = rope_cos_sin(cfg, dev)
    q = torch.randn(64, 32, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(64, 8, 128, device=dev, dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (64,), device=dev)
    tq, tk = tri.rope(q, k, pos, cs)
    rq, rk = reference.rope(q, k, pos, cs)
    errs["rope"] = max((tq.float() - rq.float()).abs().max().item(), (tk.float() - rk.float()).abs().max().item())
    caches = [torch.zeros(64, 16, 8, 128, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    slots = torch.randperm(64 * 16, device=dev)[:64]
    tri.write_kv(caches[0], caches[1], k, k, slots)
    reference.write_kv(caches[2], caches[3], k, k, slots)
    errs["write_kv"] = (caches[0].float() - caches[2].float()).abs().max().item()
    seqs = [(0, 1), (15, 1), (4095, 1), (0, 300), (1000, 257), (5, 1)]
    q, kc, vc, meta = batch(seqs, 3, 32, 8, 128)
    errs["paged_attention"] = (
        (
            tri.paged_attention(q, kc, vc, meta, 128**-0.5).float()
            - reference.paged_attention(q, kc, vc, meta, 128**-0.5).float()
        )
        .abs()
        .max()
        .item()
    )
    return errs


def attention_throughput() -> list[dict[str, Any]]:
    heads, kv_heads, dim = 32, 8, 128  # Llama-3-8B layout
    cases = {
        "decode-heavy: 256 decodes x 4096 ctx": ([(4095, 1)] * 256, 256),
        "prefill-heavy: 4 chunks of 2048 after 0/2k/4k/6k": ([(p, 2048) for p in (0, 2048, 4096, 6144)], 0),
        "mixed: 128 decodes x 2048 + 1 chunk of 1024 after 4096": ([(2047, 1)] * 128 + [(4096, 1024)], 128),
    }
    rows = []
    for name, (seqs, nd) in cases.items():
        q, kc, vc, meta = batch(seqs, nd, heads, kv_heads, dim)
        ms = timed_ms(lambda q=q, kc=kc, vc=vc, meta=meta: tri.paged_attention(q, kc, vc, meta, dim**-0.5))
        kv_bytes = sum(p + n for p, n in seqs) * 2 * kv_heads * dim * 2
        flops = sum(4 * heads * dim * (n * p + n * (n + 1) / 2) for p, n in seqs)
        roof_ms = max(kv_bytes / HBM_BYTES_S, flops / BF16_FLOPS) * 1e3
        rows.append(
            {
                "case": name,
                "ms": ms,
                "tb_s": kv_bytes / ms / 1e9,
                "tflop_s": flops / ms / 1e9,
                "roofline_ms": roof_ms,
                "fraction_of_roofline": roof_ms / ms,
            }
        )
    return rows


def decode_step(config: ModelConfig, batch_size: int = 64, ctx: int = 1024) -> dict[str, Any]:
    dev = torch.device("cuda")
    weights = _random_weights(config)
    model = LlamaModel(config, weights, torch.bfloat16, dev)
    bs = 16
    nb = -(-(ctx + 1) // bs)
    k_cache = torch.zeros(
        config.num_layers, batch_size * nb, bs, config.num_kv_heads, config.head_dim, device=dev, dtype=torch.bfloat16
    )
    v_cache = torch.zeros_like(k_cache)
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(batch_size)]
    meta = build_attention_meta(tables, [ctx + 1] * batch_size, [1] * batch_size, batch_size, bs, dev)
    ids = torch.randint(0, config.vocab_size, (batch_size,), device=dev)
    pos = torch.full((batch_size,), ctx, device=dev)
    rows = torch.arange(batch_size, device=dev)
    ms = timed_ms(lambda: model.forward(ids, pos, meta, k_cache, v_cache, rows), repeats=10)
    weight_bytes = sum(w.numel() for w in weights.values()) * 2
    kv_bytes = batch_size * (ctx + 1) * config.num_layers * 2 * config.num_kv_heads * config.head_dim * 2
    roof_ms = (weight_bytes + kv_bytes) / HBM_BYTES_S * 1e3
    return {
        "model": config.name,
        "batch": batch_size,
        "ctx": ctx,
        "ms": ms,
        "weights_gb": weight_bytes / 1e9,
        "roofline_ms": roof_ms,
        "fraction_of_roofline": roof_ms / ms,
    }


def _random_weights(c: ModelConfig) -> dict[str, torch.Tensor]:
    h, f, d = c.hidden_size, c.intermediate_size, c.head_dim
    w = {"model.embed_tokens.weight": torch.randn(c.vocab_size, h) * 0.02, "model.norm.weight": torch.ones(h)}
    if not c.tie_embeddings:
        w["lm_head.weight"] = torch.randn(c.vocab_size, h) * 0.02
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": torch.randn(c.num_heads * d, h) * 0.02,
            p + "self_attn.k_proj.weight": torch.randn(c.num_kv_heads * d, h) * 0.02,
            p + "self_attn.v_proj.weight": torch.randn(c.num_kv_heads * d, h) * 0.02,
            p + "self_attn.o_proj.weight": torch.randn(h, c.num_heads * d) * 0.02,
            p + "mlp.gate_proj.weight": torch.randn(f, h) * 0.02,
            p + "mlp.up_proj.weight": torch.randn(f, h) * 0.02,
            p + "mlp.down_proj.weight": torch.randn(h, f) * 0.02,
        }
    return w


def flashinfer_decode() -> dict[str, Any]:
    """flashinfer's paged decode on the decode-heavy batch, if it is installed."""
    try:
        import flashinfer
    except ImportError as exc:
        return {"skipped": f"flashinfer not importable: {exc}"}
    try:
        heads, kv_heads, dim, n, ctx, bs = 32, 8, 128, 256, 4096, 16
        nb = ctx // bs
        cache = torch.randn(n * nb, 2, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD"
        )
        indptr = torch.arange(0, (n + 1) * nb, nb, device="cuda", dtype=torch.int32)
        indices = torch.arange(n * nb, device="cuda", dtype=torch.int32)
        last = torch.full((n,), bs, device="cuda", dtype=torch.int32)
        wrapper.plan(indptr, indices, last, heads, kv_heads, dim, bs, data_type=torch.bfloat16)
        q = torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16)
        ms = timed_ms(lambda: wrapper.run(q, cache))
        kv_bytes = n * ctx * 2 * kv_heads * dim * 2
        return {"case": "decode-heavy: 256 decodes x 4096 ctx", "ms": ms, "tb_s": kv_bytes / ms / 1e9}
    except Exception as exc:  # a version mismatch must not lose the rest of the run
        return {"skipped": f"flashinfer failed: {type(exc).__name__}: {exc}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this script checks the Triton kernels on a GPU")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    result["max_abs_error_vs_reference"] = correctness()
    result["attention"] = attention_throughput()
    smol = ModelConfig("smollm2-135m-shape", 49152, 576, 1536, 30, 9, 3, 64, 100000.0, 1e-5, 8192, True)
    llama8b = ModelConfig("llama-3-8b-shape", 128256, 4096, 14336, 32, 32, 8, 128, 500000.0, 1e-5, 8192, False)
    result["decode_step"] = [decode_step(smol), decode_step(llama8b)]
    result["flashinfer"] = flashinfer_decode()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps(result, indent=2))
    lines = [f"# Triton kernels on {result['device']}", "", "max |triton - reference| (bf16):", ""]
    lines += [f"- {k}: {v:.4f}" for k, v in result["max_abs_error_vs_reference"].items()]
    attention = [
        [
            r["case"],
            f"{r['ms']:.3f}",
            f"{r['tb_s']:.2f}",
            f"{r['tflop_s']:.0f}",
            f"{r['roofline_ms']:.3f}",
            f"{r['fraction_of_roofline']:.0%}",
        ]
        for r in result["attention"]
    ]
    header = ["attention batch", "ms", "TB/s", "TFLOP/s", "roofline ms", "of roofline"]
    lines += ["", *table(header, attention, "lrrrrr")]
    decode = [
        [
            r["model"],
            f"{r['batch']} x {r['ctx']}",
            f"{r['ms']:.2f}",
            f"{r['roofline_ms']:.2f}",
            f"{r['fraction_of_roofline']:.0%}",
        ]
        for r in result["decode_step"]
    ]
    lines += ["", *table(["decode step", "batch x ctx", "ms", "roofline ms", "of roofline"], decode, "llrrr")]
    lines += ["", f"flashinfer: {json.dumps(result['flashinfer'])}"]
    (args.out / "gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
