"""Every linear layer of the embedded model once (one decode step's GEMMs),
the native kernels vs oneDNN's prepacked weights.

    .venv/bin/python -m bench.kernels.linear_kernels [--repeats 7] [--threads 1] [--dtype float32]

float32: compact weights (the native kernels) vs oneDNN's prepacked float32
weights over all 121 weights (~540 MB, more than any cache, so each pass
streams them from memory as a decode step does); the crossover sets
``kernels.Linear.COMPACT_ROWS``. bf16 (where the build has AVX512-BF16): the
120 bf16 body weights (the head stays float32) on the dot-product kernel vs
oneDNN's prepacked bf16 GEMM (and, with AMX, vs one brgemm call a block of
64 columns over a VNNI-packed copy, ``gemm_vnni``), with the dot kernel's GFLOP/s against the
``vdpbf16ps`` peak the roofline probe measures first. Rows = sequences in
the batch (chunk sizes at the end). Writes a new
bench/results/linear_kernels-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.record import dated, describe, machine, table
from stallfree import kernels
from stallfree.core.model.llama import LlamaModel
from stallfree.core.model.loader import load_model
from stallfree.kernels.linear import dot_available

ROWS = (1, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
BF16_ROWS = (1, 4, 8, 16, 32, 48, 64, 128, 256, 512)


Path = Callable[[kernels.Linear, torch.Tensor], torch.Tensor]


def side_by_side(
    row_counts: tuple[int, ...], repeats: int, one_pass: Callable[[int, str], float], names: tuple[str, ...]
) -> list[dict[str, Any]]:
    """Per row count, each path's median ms over ``repeats`` alternating passes
    (the first pass of each warms up), and each later path's speed-up = first /
    it per pass (``speedup`` for the second, ``<name>_speedup`` for the rest)."""
    results: list[dict[str, Any]] = []
    for rows in row_counts:
        times: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(repeats + 1):
            for name in names:
                t = one_pass(rows, name)
                if rep:
                    times[name].append(t)
        result: dict[str, Any] = {"rows": rows} | {f"{name}_ms": statistics.median(times[name]) * 1e3 for name in names}
        for i, name in enumerate(names[1:]):
            ratios = [a / b for a, b in zip(times[names[0]], times[name], strict=True)]
            key = "speedup" if i == 0 else f"{name}_speedup"
            result |= {key: statistics.median(ratios), f"{key}_range": (min(ratios), max(ratios))}
        results.append(result)
    return results


def write(record: dict[str, Any], lines: list[str]) -> None:
    """A new dated linear_kernels record: the JSON and the markdown lines."""
    base = dated("linear_kernels")
    base.with_suffix(".json").write_text(json.dumps(record, indent=2))
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def speedup(r: dict[str, Any], key: str = "speedup") -> str:
    return f"{r[key]:.2f}× [{r[key + '_range'][0]:.2f}–{r[key + '_range'][1]:.2f}]"


def bf16_paths(model: LlamaModel) -> tuple[list[kernels.Linear], dict[str, Path], float]:
    """(layers, {name: one layer's call}, total weights) for the bf16 comparison."""
    layers = [getattr(lay, n) for lay in model.layers for n in ("qkv", "o", "gate_up", "down")]
    if not dot_available():
        sys.exit("the dot-product kernel does not run here (it needs the avx512-bf16 build)")
    packed = {id(lay): torch.ops.mkldnn._reorder_linear_weight(lay.weight, 64) for lay in layers}
    # the dot kernel's copies: the layers keep none where AMX takes them
    dots = {id(lay): lay.dot if lay.dot is not None else torch.ops.stallfree.pack_dot(lay.weight) for lay in layers}

    def onednn(lay: kernels.Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed[id(lay)], lay.bias, "none", [], "")

    def dot(lay: kernels.Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.stallfree.gemm_dot(x, dots[id(lay)], lay.bias, lay.float_out)

    def vnni(lay: kernels.Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.stallfree.gemm_vnni(x, lay.vnni, lay.weight.shape[0], lay.bias, lay.float_out)

    paths: dict[str, Path] = {"onednn": onednn, "dot": dot}
    if all(lay.vnni is not None for lay in layers):  # AMX: one brgemm call a block over VNNI-packed copies
        paths["vnni"] = vnni
    return layers, paths, float(sum(lay.weight.numel() for lay in layers))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bf16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if kernels.native_cpu() is None:
        sys.exit(f"the native kernels are not available here: {kernels.backend(torch.device('cpu'))}")
    if args.dtype == "bf16":
        return bf16_main(args)
    loaded = load_model()
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, torch.device("cpu"), loaded.quantized)
    layers = [model.lm_head] + [getattr(lay, n) for lay in model.layers for n in ("qkv", "o", "gate_up", "down")]
    kinds = sorted({lay.compact.kind for lay in layers if lay.compact is not None})
    compact_mb = sum(t.nbytes for lay in layers if lay.compact for t in lay.compact.tensors) / 2**20
    fp32_mb = sum(lay.weight.nbytes for lay in layers) / 2**20

    def one_pass(rows: int, name: str) -> float:
        xs = {k: torch.randn(rows, k) for k in {lay.weight.shape[1] for lay in layers}}
        start = time.perf_counter()
        for lay in layers:
            x = xs[lay.weight.shape[1]]
            lay.compact(x, lay.bias) if name == "compact" else lay(x)
        return time.perf_counter() - start

    results = side_by_side(ROWS, args.repeats, one_pass, ("onednn", "compact"))
    m = machine()
    command = f"python -m bench.kernels.linear_kernels {' '.join(sys.argv[1:])}".strip()
    record = {"command": command, "machine": m, "kinds": kinds, "compact_mb": compact_mb, "fp32_mb": fp32_mb}
    lines = [
        "# One decode step's linear layers: compact weights vs oneDNN float32",
        "",
        f"`{command}` on {describe(m)}; {args.threads} thread(s); embedded model, all 121 weights per pass "
        f"(compact: {', '.join(kinds)}, {compact_mb:.0f} MB; float32: {fp32_mb:.0f} MB); medians of "
        f"{args.repeats} alternating passes, speed-up = oneDNN / compact per pass [min–max].",
        "",
    ]
    cells = [[r["rows"], f"{r['onednn_ms']:.1f}", f"{r['compact_ms']:.1f}", speedup(r)] for r in results]
    lines += table(["rows", "oneDNN fp32 ms", "compact ms", "speed-up"], cells, "rrrr")
    write(record | {"rows": results}, lines)


def bf16_main(args: argparse.Namespace) -> None:
    from stallfree.kernels import roofline

    limits = roofline.measure()
    peak = limits.dot_bf16 if limits else 0.0
    loaded = load_model()
    model = LlamaModel(loaded.config, loaded.weights, torch.bfloat16, torch.device("cpu"), loaded.quantized)
    layers, paths, weights = bf16_paths(model)

    def one_pass(rows: int, name: str) -> float:
        xs = {k: torch.randn(rows, k).bfloat16() for k in {lay.weight.shape[1] for lay in layers}}
        call = paths[name]
        start = time.perf_counter()
        for lay in layers:
            call(lay, xs[lay.weight.shape[1]])
        return time.perf_counter() - start

    results = side_by_side(BF16_ROWS, args.repeats, one_pass, tuple(paths))
    for r in results:
        r["dot_gflops"] = 2 * r["rows"] * weights / r["dot_ms"] / 1e6
    m = machine()
    command = f"python -m bench.kernels.linear_kernels {' '.join(sys.argv[1:])}".strip()
    record = {"command": command, "machine": m, "dot_bf16_peak": peak, "weights": weights}
    lines = [
        "# One decode step's bf16 linear layers: the vdpbf16ps kernel"
        + (" and gemm_vnni" if "vnni" in paths else "")
        + " vs oneDNN bf16",
        "",
        f"`{command}` on {describe(m)}; {args.threads} thread(s); embedded model, the 120 bf16 body weights "
        f"per pass ({weights * 2 / 2**20:.0f} MB; the head stays float32); medians of {args.repeats} alternating "
        f"passes, speed-up = oneDNN / dot per pass [min–max]; % of the {peak / 1e9:.0f} GFLOP/s vdpbf16ps peak "
        "probed first (cache-resident registers; a pass streams its weights from memory).",
        "",
    ]
    vnni = "vnni" in paths
    if vnni:
        lines[-2] += (
            " vnni: oneDNN's brgemm called once a block of 64 output columns over a VNNI-packed copy "
            "(`gemm_vnni`, AMX), its speed-up = oneDNN / vnni."
        )
    cells = [
        [
            r["rows"],
            f"{r['onednn_ms']:.1f}",
            f"{r['dot_ms']:.1f}",
            f"{r['dot_gflops']:.0f} ({r['dot_gflops'] * 1e9 / peak * 100:.0f}%)" if peak else f"{r['dot_gflops']:.0f}",
            speedup(r),
            *([f"{r['vnni_ms']:.1f}", speedup(r, "vnni_speedup")] if vnni else []),
        ]
        for r in results
    ]
    header = ["rows", "oneDNN bf16 ms", "dot ms", "dot GFLOP/s (% of peak)", "speed-up"]
    header += ["vnni ms", "vnni speed-up"] if vnni else []
    lines += table(header, cells, "r" * len(header))
    write(record | {"rows": results}, lines)


if __name__ == "__main__":
    main()
