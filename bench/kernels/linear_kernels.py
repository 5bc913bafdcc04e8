"""Every linear layer of the embedded model once (one decode step's GEMMs),
compact weights (the native kernels) vs oneDNN's prepacked float32 weights.

    .venv/bin/python -m bench.kernels.linear_kernels [--repeats 7] [--threads 1]

The model's 121 weights (~540 MB in float32) do not fit any cache, so each
pass streams them from memory as a decode step does. Rows = sequences in the
batch. The crossover sets ``kernels.Linear.COMPACT_ROWS``. Writes a new
bench/results/linear_kernels-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import kernels
from bench.record import dated, describe, machine, table
from core.model.llama import LlamaModel
from core.model.loader import load_model

ROWS = (1, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if kernels.native_cpu() is None:
        sys.exit(f"the native kernels are not available here: {kernels.backend(torch.device('cpu'))}")
    loaded = load_model()
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, torch.device("cpu"), loaded.quantized)
    layers = [model.lm_head] + [getattr(lay, n) for lay in model.layers for n in ("qkv", "o", "gate_up", "down")]
    kinds = sorted({lay.compact.kind for lay in layers if lay.compact is not None})
    compact_mb = sum(t.nbytes for lay in layers if lay.compact for t in lay.compact.tensors) / 2**20
    fp32_mb = sum(lay.weight.nbytes for lay in layers) / 2**20

    def one_pass(rows: int, compact: bool) -> float:
        xs = {k: torch.randn(rows, k) for k in {lay.weight.shape[1] for lay in layers}}
        start = time.perf_counter()
        for lay in layers:
            x = xs[lay.weight.shape[1]]
            lay.compact(x, lay.bias) if compact else lay(x)
        return time.perf_counter() - start

    results = []
    for rows in ROWS:
        times: dict[str, list[float]] = {"onednn": [], "compact": []}
        for rep in range(args.repeats + 1):  # alternate; the first pass of each warms up
            for name in times:
                t = one_pass(rows, name == "compact")
                if rep:
                    times[name].append(t)
        ratios = [a / b for a, b in zip(times["onednn"], times["compact"], strict=True)]
        results.append(
            {
                "rows": rows,
                "onednn_ms": statistics.median(times["onednn"]) * 1e3,
                "compact_ms": statistics.median(times["compact"]) * 1e3,
                "speedup": statistics.median(ratios),
                "speedup_range": (min(ratios), max(ratios)),
            }
        )
    m = machine()
    command = f"python -m bench.kernels.linear_kernels {' '.join(sys.argv[1:])}".strip()
    base = dated("linear_kernels")
    record = {"command": command, "machine": m, "kinds": kinds, "compact_mb": compact_mb, "fp32_mb": fp32_mb}
    base.with_suffix(".json").write_text(json.dumps(record | {"rows": results}, indent=2))
    lines = [
        "# One decode step's linear layers: compact weights vs oneDNN float32",
        "",
        f"`{command}` on {describe(m)}; {args.threads} thread(s); embedded model, all 121 weights per pass "
        f"(compact: {', '.join(kinds)}, {compact_mb:.0f} MB; float32: {fp32_mb:.0f} MB); medians of "
        f"{args.repeats} alternating passes, speed-up = oneDNN / compact per pass [min–max].",
        "",
    ]
    cells = [
        [
            r["rows"],
            f"{r['onednn_ms']:.1f}",
            f"{r['compact_ms']:.1f}",
            f"{r['speedup']:.2f}× [{r['speedup_range'][0]:.2f}–{r['speedup_range'][1]:.2f}]",
        ]
        for r in results
    ]
    lines += table(["rows", "oneDNN fp32 ms", "compact ms", "speed-up"], cells, "rrrr")
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
