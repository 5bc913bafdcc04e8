"""How steadily does this machine run the same iteration? One fixed shape
(decodes plus a prompt's chunk, as the TBT target sizes them) timed over and
over in process, the model runner alone, while the other core is idle, runs
Python (compute, little memory traffic) or copies memory
(``bench.serving.neighbour`` at full duty), the three alternating in rounds.

    .venv/bin/python -m bench.engine.shape_repeat [--rounds 4] [--per-round 60] \\
        [--decodes 11 --context 135 --chunk 42 --prefix 121]

Issue 50 asks the cost model's measured / predicted to scatter at most 1.1 at
p99: no prediction can scatter less than the same work does. The default
shape is the median near-target iteration of ``bench.serving.tbt_hold`` on
the Azure trace (2026-12-06). Reports each condition's median, p99 / median,
max / median, and the lag-1 autocorrelation of log(time / median): slow
iterations that come in runs (a burst on the machine) against lone ones.
Writes bench/results/shape_repeat-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import numpy as np

from bench.record import dated, describe, machine, table
from bench.servers import ROOT
from bench.serving.neighbour import neighbour
from stallfree.core.analysis.profiler import ShapeBench
from stallfree.core.build import ModelSettings, load_runner

BUSY_PYTHON = "while True:\n    sum(i * i for i in range(10_000))\n"


@contextmanager
def python_loop() -> Iterator[None]:
    """Another process computing in Python (its working set stays in its core's caches)."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY_PYTHON], cwd=ROOT)
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# what the other core does while the shape repeats: each entered once a round
CONDITIONS: dict[str, Callable[[], AbstractContextManager[object]]] = {
    "idle": lambda: neighbour(0.0),
    "python on the other core": python_loop,
    "memory copy on the other core": lambda: neighbour(1.0),
}


def figures(times_ms: list[float]) -> dict[str, float]:
    a = np.array(times_ms)
    median = float(np.median(a))
    logs = np.log(a / median)
    return {
        "iterations": len(a),
        "median_ms": median,
        "p99_over_median": float(np.percentile(a, 99)) / median,
        "max_over_median": float(a.max()) / median,
        "lag1_autocorrelation": float(np.corrcoef(logs[:-1], logs[1:])[0, 1]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decodes", type=int, default=11)
    ap.add_argument("--context", type=int, default=135, help="each decode's cached tokens")
    ap.add_argument("--chunk", type=int, default=42, help="the prompt's chunk (0: decodes only)")
    ap.add_argument("--prefix", type=int, default=121, help="the chunk's cached prefix")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--per-round", type=int, default=60, help="iterations per condition per round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    runner = load_runner(ModelSettings(dtype=args.dtype, threads=args.threads))
    shapes = ShapeBench(runner, runner.num_blocks)
    batch, _ = shapes.batch(args.decodes, args.context, args.chunk, args.prefix)
    for _ in range(20):  # warm-up: allocator, caches, the kernels' first calls
        runner.execute(batch)
    times: dict[str, list[float]] = {name: [] for name in CONDITIONS}
    for _ in range(args.rounds):
        for name, busy in CONDITIONS.items():
            with busy():
                time.sleep(0.5)  # the neighbour under way
                for _ in range(args.per_round):
                    start = time.perf_counter()
                    runner.execute(batch)
                    times[name].append((time.perf_counter() - start) * 1e3)
    results = {name: figures(t) for name, t in times.items()}
    dtype = str(runner.dtype).removeprefix("torch.")
    shape = f"{args.decodes} decodes of {args.context} cached tokens and a {args.chunk}-token chunk after {args.prefix}"
    doc = {
        "command": "python -m bench.engine.shape_repeat " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "dtype": dtype,
        "threads": args.threads,
        "shape": shape,
        "results": results,
        "times_ms": times,
    }
    base = dated("shape_repeat")
    base.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    keys = list(next(iter(results.values())))
    lines = [
        f"# The same iteration, over and over ({doc['date']})",
        "",
        f"`{doc['command']}` on {describe(doc['machine'])}; {dtype}, {args.threads} compute thread(s); the model "
        f"runner alone in process, {shape}; {args.rounds} rounds of {args.per_round} iterations per condition, "
        "the conditions alternating.",
        "",
        *table(
            ["", *results], [[k, *(f"{r[k]:.3g}" for r in results.values())] for k in keys], "l" + "r" * len(results)
        ),
        "",
        f"Median of the medians: {statistics.median(r['median_ms'] for r in results.values()):.1f} ms. "
        f"Every iteration's time: `{base.with_suffix('.json').name}`.",
    ]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
