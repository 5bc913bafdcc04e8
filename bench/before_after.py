"""One benchmark on two source trees in one run, interleaved (before, after,
after, before, ...), so a change's effect on speed is told apart from the
noise of a shared machine and from whichever runs second.

    .venv/bin/python -m bench.before_after --before ../before --repeats 3 \\
        -- bench.engine.model_throughput --threads 1 --repeats 1

``--before`` is a checkout of the old commit (``git worktree add ../before
<commit>``); "after" is this tree. Each run is ``python -m <module> <args>
--out <stem>`` with the tree as working directory and first on PYTHONPATH;
the module writes its dated JSON under that tree's ``bench/results``
(``{"results": {row: {metric: value}}}``, as ``bench.engine.model_throughput``
does), which is read and removed. The old tree's kernels compile into a
cache of their own (``bench.servers.tree_env``). Reports each metric's median per tree,
the after/before ratio and the spread. Writes bench/results/before_after-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.record import dated, describe, machine, table
from bench.servers import tree_env

ROOT = Path(__file__).resolve().parent.parent


def run_once(tree: Path, module: str, args: list[str], stem: str) -> dict[str, dict[str, float]]:
    """Run the benchmark in tree; return its results, numeric metrics only."""
    env = {**tree_env(tree), "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", module, *args, "--out", stem]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    (path,) = (tree / "bench" / "results").glob(f"{stem}-*.json")
    doc = json.loads(path.read_text())
    for written in (tree / "bench" / "results").glob(f"{stem}-*"):
        written.unlink()
    return {
        row: {m: float(v) for m, v in metrics.items() if isinstance(v, int | float)}
        for row, metrics in doc["results"].items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="checkout of the old commit")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--commits", default="", help="what the two trees are, for the record (e.g. 'bb5e8c9 vs 5a76bec')")
    ap.add_argument("benchmark", nargs=argparse.REMAINDER, help="-- module [args]")
    args = ap.parse_args()
    bench = [a for a in args.benchmark if a != "--"]
    if not bench:
        ap.error("name the benchmark module after --")
    module, bench_args = bench[0], bench[1:]
    trees = {"before": args.before.resolve(), "after": ROOT}
    runs: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name in trees}
    for rep in range(args.repeats):
        order = list(trees.items())
        for name, tree in order if rep % 2 == 0 else reversed(order):  # ABBA: no tree always runs second
            start = time.perf_counter()
            runs[name].append(run_once(tree, module, bench_args, f"before-after-{name}-{os.getpid()}"))
            print(f"repeat {rep + 1}/{args.repeats}: {name} {time.perf_counter() - start:.0f} s", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    for row, metrics in runs["after"][0].items():
        for metric in metrics:
            values = {name: [r[row][metric] for r in runs[name]] for name in trees}
            before, after = statistics.median(values["before"]), statistics.median(values["after"])
            rows.append(
                {
                    "row": row,
                    "metric": metric,
                    "before": values["before"],
                    "after": values["after"],
                    "before_median": before,
                    "after_median": after,
                    "ratio": after / before if before else None,
                }
            )
    m = machine()
    command = "python -m bench.before_after " + " ".join(sys.argv[1:])
    doc = {"command": command, "machine": m, "commits": args.commits, "repeats": args.repeats, "rows": rows}
    base = dated("before_after")
    base.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    lines = [
        f"# Before/after: `{module}` on two trees, interleaved ({args.commits or 'before vs after'})",
        "",
        f"`{command}`",
        "",
        f"Machine: {describe(m)}. Medians of {args.repeats} interleaved runs per tree; "
        "ratio = after / before; [min–max] per tree.",
        "",
    ]
    cells = []
    for r in rows:
        spread_b = f"[{min(r['before']):.4g}–{max(r['before']):.4g}]"
        spread_a = f"[{min(r['after']):.4g}–{max(r['after']):.4g}]"
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "–"
        cells.append(
            [
                r["row"],
                r["metric"],
                f"{r['before_median']:.4g} {spread_b}",
                f"{r['after_median']:.4g} {spread_a}",
                ratio,
            ]
        )
    lines += table(["row", "metric", "before", "after", "ratio"], cells, "llrrr")
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
