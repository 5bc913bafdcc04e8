"""Where an iteration's time goes, torch reference kernels vs the native C++ ones,
side by side in one process on the embedded model.

    .venv/bin/python -m bench.engine.engine_profile [--repeats 5] [--threads 1] [--dtype auto]
        [--kv-dtype auto] [--compute float]

Scenarios (one forward pass each, random KV in a paged cache):
decode at 8 and 32 streams (512-token contexts), one 512-token chunk after 0
and after 1,500 cached tokens, and a 2,000-token prompt in 4 chunks of 500 at
budget 512 with 8 decodes riding along (the 4 iterations summed). Backends
alternate run by run (A B A B ...). Each op the model calls through
``kernels`` is timed (attention, element-wise, KV write, the linear layers);
the rest is the embedding, metadata and Python. The linear layers' and
attention's FLOPs are counted as they run, so each gets an achieved rate,
reported as a fraction of this machine's measured peak (``kernels.roofline``,
probed at the start and recorded): the float32 FMA peak in float32, in bf16
the arithmetic bf16 GEMMs use here (AMX's brgemm, else vdpbf16ps). "End to end" is all those FLOPs over the whole
iteration. ``--kv-dtype bf16`` keeps the KV cache, and runs attention, in
bf16 under float32 GEMMs; ``--compute int8`` runs the chunks' GEMMs in int8
(rates still against the float32 peak). Writes bench/results/engine_profile-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from bench.record import dated, describe, machine, table
from stallfree import kernels
from stallfree.core.model.llama import LlamaModel
from stallfree.core.model.loader import load_model
from stallfree.core.model.model_runner import resolve_dtype
from stallfree.kernels import build_attention_meta, reference, roofline

CPU = torch.device("cpu")
BLOCK = 16
OPS = {  # kernels function -> breakdown category
    "paged_attention": "attention",
    "rms_norm": "element-wise",
    "add_rms_norm": "element-wise",
    "rope": "element-wise",
    "silu_mul": "element-wise",
    "write_kv": "kv write",
    "linear": "linear (GEMM)",
}


def linear_flops(layer: kernels.Linear, x: torch.Tensor) -> float:
    return 2.0 * x.shape[0] * layer.weight.numel()


def attention_flops(q: torch.Tensor, k_cache, v_cache, meta: kernels.AttentionMeta, scale: float) -> float:
    """QK^T and PV over each sequence's keys, causal inside its new rows."""
    heads, dim = q.shape[1], q.shape[2]
    pairs = 0.0
    for s in range(meta.num_seqs):
        n = meta.query_start_host[s + 1] - meta.query_start_host[s]
        pairs += n * (meta.seq_lens_host[s] - n) + n * (n + 1) / 2
    return 4.0 * heads * dim * pairs


FLOPS = {"linear": linear_flops, "paged_attention": attention_flops}


class Profile:
    """Wraps the kernels entry points to add up time (and FLOPs) per category."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.flops: dict[str, float] = defaultdict(float)
        self._saved: list[tuple[object, str, Callable]] = []

    def _wrap(self, owner: object, name: str, category: str) -> None:
        fn = getattr(owner, name)
        self._saved.append((owner, name, fn))
        count = FLOPS.get(name)

        def timed(*args, **kwargs):
            if count is not None:
                self.flops[category] += count(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[category] += time.perf_counter() - start

        setattr(owner, name, timed)

    def __enter__(self) -> Profile:
        for name, category in OPS.items():
            self._wrap(kernels, name, category)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)


def scenario(decodes: int, ctx: int, chunks: list[tuple[int, int]]) -> list[tuple]:
    """One (tables, seq_lens, query_lens, num_decodes) per iteration; chunks are (prefix, tokens)."""
    iterations = []
    for prefix, n in chunks or [(0, 0)]:
        tables, seq_lens, q_lens, nxt = [], [], [], 0
        for _ in range(decodes):
            nb = -(-(ctx + 1) // BLOCK)
            tables.append(list(range(nxt, nxt + nb)))
            nxt += nb
            seq_lens.append(ctx + 1)
            q_lens.append(1)
        if n:
            nb = -(-(prefix + n) // BLOCK)
            tables.append(list(range(nxt, nxt + nb)))
            seq_lens.append(prefix + n)
            q_lens.append(n)
        iterations.append((tables, seq_lens, q_lens, decodes))
    return iterations


SCENARIOS = {
    "decode, 8 streams": scenario(8, 512, []),
    "decode, 32 streams": scenario(32, 512, []),
    "512-token chunk, no prefix": scenario(0, 0, [(0, 512)]),
    "512-token chunk after 1,500 cached": scenario(0, 0, [(1500, 512)]),
    "2,000-token prompt in 4 chunks + 8 decodes": scenario(8, 512, [(i * 500, 500) for i in range(4)]),
}


def rate(runs: list[dict], flops: tuple[str, ...], seconds: str, peak: float) -> str:
    """Median GFLOP/s of ``flops`` over the time in ``seconds``, and its share of ``peak``."""
    r = statistics.median(sum(run.get(f, 0.0) for f in flops) / run[seconds] for run in runs if run.get(seconds))
    return f"{r / 1e9:.0f} ({r / peak * 100:.0f}%)"


def run_once(model: LlamaModel, caches: tuple[torch.Tensor, torch.Tensor], iterations: list[tuple]) -> float:
    start = time.perf_counter()
    for tables, seq_lens, q_lens, decodes in iterations:
        meta = build_attention_meta(tables, seq_lens, q_lens, decodes, BLOCK, CPU)
        ids = torch.randint(0, model.config.vocab_size, (sum(q_lens),))
        rows = torch.tensor([sum(q_lens[: i + 1]) - 1 for i in range(len(q_lens))])
        model.forward(ids, meta.positions, meta, *caches, rows)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-dtype", default="auto", help="the KV cache's (and attention's) dtype; auto: --dtype")
    ap.add_argument("--compute", default="float", choices=["float", "int8"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, CPU)
    kv_dtype = dtype if args.kv_dtype == "auto" else resolve_dtype(args.kv_dtype, CPU)
    limits = roofline.measure()
    if limits is None:
        sys.exit(f"the native kernels are not available here: {kernels.backend(torch.device('cpu'))}")
    peak = limits.peak(dtype)
    loaded = load_model(None)
    model = LlamaModel(loaded.config, loaded.weights, dtype, CPU, loaded.quantized, int8=args.compute == "int8")
    c = loaded.config
    shape = (c.num_layers, 1200, BLOCK, c.num_kv_heads, c.head_dim)
    caches = (torch.randn(shape).to(kv_dtype), torch.randn(shape).to(kv_dtype))
    native = kernels._cpu()
    backends = {"reference": reference, "native": native}
    if native is reference:
        sys.exit(f"the native kernels are not available here: {kernels.backend(torch.device('cpu'))}")
    results: dict[str, dict[str, list]] = {s: {b: [] for b in backends} for s in SCENARIOS}
    for rep in range(args.repeats + 1):  # the first round warms up and is dropped
        for name, iterations in SCENARIOS.items():
            for backend, module in backends.items():
                with kernels.cpu_path(module), Profile() as prof:
                    total = run_once(model, caches, iterations)
                if rep:
                    flops = {f"{cat} flops": v for cat, v in prof.flops.items()}
                    results[name][backend].append({"total_s": total, **prof.totals, **flops})
        print(f"repeat {rep}/{args.repeats} done", file=sys.stderr, flush=True)
    m = machine()
    command = f"python -m bench.engine.engine_profile {' '.join(sys.argv[1:])}".strip()
    doc = {
        "command": command,
        "machine": m,
        "dtype": str(dtype),
        "kv_dtype": str(kv_dtype),
        "compute": args.compute,
        "threads": args.threads,
        "roofline": limits.to_json(),
        "results": results,
    }
    base = dated("engine_profile")
    base.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    lines = [
        f"# Where an iteration's time goes: torch reference vs native CPU kernels ({c.name})",
        "",
        f"`{command}` on {describe(m)}; {str(dtype).removeprefix('torch.')}"
        f"{', KV cache and attention in ' + str(kv_dtype).removeprefix('torch.') if kv_dtype != dtype else ''}"
        f"{', chunk GEMMs in int8' if args.compute == 'int8' else ''}, {args.threads} thread(s). "
        f"Medians of {args.repeats} alternating runs [min–max]; speed-up = reference / native.",
        "",
    ]
    cells = []
    for name, by in results.items():
        ref, nat = ([r["total_s"] * 1e3 for r in by[b]] for b in backends)
        ratios = [a / b for a, b in zip(ref, nat, strict=True)]
        cells.append(
            [
                name,
                f"{statistics.median(ref):.1f} [{min(ref):.1f}–{max(ref):.1f}]",
                f"{statistics.median(nat):.1f} [{min(nat):.1f}–{max(nat):.1f}]",
                f"{statistics.median(ratios):.2f}× [{min(ratios):.2f}–{max(ratios):.2f}]",
            ]
        )
    lines += table(["scenario", "reference ms", "native ms", "speed-up"], cells, "lrrr")
    categories = [*dict.fromkeys(OPS.values())]
    lines += ["", "Share of the iteration (medians):", ""]
    cells = []
    for name, by in results.items():
        for backend in backends:
            runs = by[backend]
            total = statistics.median(r["total_s"] for r in runs)
            shares = [statistics.median(r.get(cat, 0.0) for r in runs) / total for cat in categories]
            rest = max(0.0, 1 - sum(shares))
            cells.append([name, backend, *(f"{s * 100:.0f}%" for s in [*shares, rest])])
    lines += table(["scenario", "backend", *categories, "rest"], cells, "ll" + "r" * (len(categories) + 1))
    lines += [
        "",
        f"Achieved rates against this machine's measured peak (one thread): "
        f"{peak / 1e9:.0f} GFLOP/s ({limits.arithmetic(dtype)}); "
        f"float32 FMA {limits.fma_f32 / 1e9:.0f}, bf16 vdpbf16ps {limits.dot_bf16 / 1e9:.0f}, "
        f"float32 brgemm {limits.brgemm_f32 / 1e9:.0f}, "
        f"bf16 brgemm {limits.brgemm_bf16 / 1e9:.0f} GFLOP/s, int8 {limits.brgemm_int8 / 1e9:.0f} GOP/s, "
        f"reads {limits.read_bw / 1e9:.1f} GB/s. Medians; GFLOP/s (% of peak).",
        "",
    ]
    gemm, attention = ("linear (GEMM) flops",), ("attention flops",)
    cells = [
        [
            name,
            backend,
            rate(by[backend], gemm, "linear (GEMM)", peak),
            rate(by[backend], attention, "attention", peak),
            rate(by[backend], gemm + attention, "total_s", peak),
        ]
        for name, by in results.items()
        for backend in backends
    ]
    lines += table(["scenario", "backend", "linear (GEMM)", "attention", "end to end"], cells, "llrrr")
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
