"""Paged attention alone, native C++ kernel vs the torch reference, on the
embedded model's shapes (9 query heads, 3 KV heads, head_dim 64, blocks of 16).

    .venv/bin/python -m bench.kernels.attention_kernels [--repeats 15] [--dtype auto]

Reports each kernel's time per layer, its attention FLOP rate and the KV
bytes it must read per second (the decode roofline), alternating the
kernels call by call: the reference, the native kernel as it runs here
(bf16 prefill tiles on AMX's own instructions where the machine has AMX,
others on oneDNN's brgemm where it has that), the native kernel with bf16
tiles through brgemm instead of AMX's instructions, and with its hand-written
tiles forced (the path of a machine without either).
``--threads``: the kernels' threads (a chunk's work split over them).
Writes a new bench/results/attention_kernels-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench.record import dated, describe, machine, table
from stallfree import kernels
from stallfree.core.model.model_runner import resolve_dtype
from stallfree.kernels import build_attention_meta, reference

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
CASES = {  # name: (decodes, decode context, chunk, chunk prefix)
    "decode 32 streams, 512 context": (32, 512, 0, 0),
    "decode 32 streams, 2,000 context": (32, 2000, 0, 0),
    "512-token chunk, no prefix": (0, 0, 512, 0),
    "512-token chunk after 1,500 cached": (0, 0, 512, 1500),
    # budget 256's mixed iteration late in a 2,000-token prompt: 8 decodes and the rest of the budget
    "8 decodes at 512 beside a 248-token chunk after 1,752": (8, 512, 248, 1752),
}


def case(decodes: int, ctx: int, chunk: int, prefix: int, dtype: torch.dtype):
    seqs = [(ctx, 1)] * decodes + ([(prefix, chunk)] if chunk else [])
    tables, nxt = [], 0
    for p, n in seqs:
        nb = -(-(p + n) // BLOCK)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    meta = build_attention_meta(
        tables, [p + n for p, n in seqs], [n for _, n in seqs], decodes, BLOCK, torch.device("cpu")
    )
    k_cache = torch.randn(nxt, BLOCK, KV_HEADS, DIM).to(dtype)
    v_cache = torch.randn(nxt, BLOCK, KV_HEADS, DIM).to(dtype)
    q = torch.randn(sum(n for _, n in seqs), HEADS, DIM).to(dtype)
    pairs = sum(n * p + n * (n + 1) / 2 for p, n in seqs)  # (query, key) pairs, causal
    kv_bytes = 2 * sum(p + n for p, n in seqs) * KV_HEADS * DIM * dtype.itemsize
    return (q, k_cache, v_cache, meta), 4 * HEADS * DIM * pairs, kv_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="attention_kernels", help="result file stem under bench/results/ (dated)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    native = kernels.native_cpu()
    if native is None:
        sys.exit(f"the native kernels are not available here: {kernels.backend(torch.device('cpu'))}")

    class HandWritten:
        @staticmethod
        def paged_attention(*a):
            with native.hand_written_tiles():
                return native.paged_attention(*a)

    class Brgemm:
        @staticmethod
        def paged_attention(*a):
            with native.brgemm_tiles():
                return native.paged_attention(*a)

    impls = {"reference": reference, "native": native, "brgemm tiles": Brgemm, "hand-written tiles": HandWritten}
    rows = []
    for name, shape in CASES.items():
        (q, kc, vc, meta), flops, kv_bytes = case(*shape, dtype)
        times: dict[str, list[float]] = {k: [] for k in impls}
        names = list(impls)
        for rep in range(args.repeats + 1):  # the first call of each warms up
            # the order turns each repeat: a kernel run after the reference finds colder caches
            for impl_name in names[rep % len(names) :] + names[: rep % len(names)]:
                impl = impls[impl_name]
                meta.decode_gather = None  # the reference caches its gather plan per iteration
                start = time.perf_counter()
                impl.paged_attention(q, kc, vc, meta, DIM**-0.5)
                if rep:
                    times[impl_name].append(time.perf_counter() - start)
        ratios = [a / b for a, b in zip(times["reference"], times["native"], strict=True)]
        over_brgemm = [a / b for a, b in zip(times["brgemm tiles"], times["native"], strict=True)]
        row = {"case": name, "flops": flops, "kv_bytes": kv_bytes, "speedup": statistics.median(ratios)}
        row["over_brgemm"] = statistics.median(over_brgemm)
        row["over_brgemm_range"] = (min(over_brgemm), max(over_brgemm))
        for impl_name, ts in times.items():
            t = statistics.median(ts)
            row[impl_name] = {"ms": t * 1e3, "gflops": flops / t / 1e9, "kv_gb_s": kv_bytes / t / 1e9}
        row["speedup_range"] = (min(ratios), max(ratios))
        rows.append(row)
    m = machine()
    command = f"python -m bench.kernels.attention_kernels {' '.join(sys.argv[1:])}".strip()
    base = dated(args.out)
    results = {r["case"]: {f"{impl} ms": r[impl]["ms"] for impl in impls} for r in rows}  # as bench.before_after reads
    doc = {"command": command, "machine": m, "rows": rows, "results": results}
    base.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    lines = [
        "# Paged attention, one layer: native C++ kernel vs torch reference",
        "",
        f"`{command}` on {describe(m)}; {str(dtype).removeprefix('torch.')}, {args.threads} thread(s); "
        f"9 query heads, 3 KV heads, head_dim 64; medians of {args.repeats} alternating calls.",
        "",
    ]
    header = [
        "case",
        "reference ms",
        "hand-written tiles ms",
        "brgemm tiles ms",
        "native ms",
        "native GFLOP/s",
        "native KV GB/s",
        "speed-up",
        "native / brgemm tiles",
    ]
    cells = [
        [
            r["case"],
            f"{r['reference']['ms']:.2f}",
            f"{r['hand-written tiles']['ms']:.2f}",
            f"{r['brgemm tiles']['ms']:.2f}",
            f"{r['native']['ms']:.2f}",
            f"{r['native']['gflops']:.1f}",
            f"{r['native']['kv_gb_s']:.1f}",
            f"{r['speedup']:.2f}× [{r['speedup_range'][0]:.2f}–{r['speedup_range'][1]:.2f}]",
            f"{r['over_brgemm']:.2f}× [{r['over_brgemm_range'][0]:.2f}–{r['over_brgemm_range'][1]:.2f}]",
        ]
        for r in rows
    ]
    lines += table(header, cells, "lrrrrrrrr")
    lines += [
        "",
        "speed-up = reference / native, per call pair: median [min–max]. native / brgemm tiles = brgemm tiles' "
        f"time / native's, per call pair (bf16 prefill tiles on AMX's own instructions here: {native.amx_tiles()}).",
    ]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
