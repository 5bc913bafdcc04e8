"""What `stallfree serve` on the embedded model takes to be ready (/readyz),
with the TBT and TTFT targets it derives (its default) and without them.

    .venv/bin/python -m bench.serving.startup_cost [--repeats 3]

Three starts, alternating (A B C A B C): the default on a machine with no
profile saved (it measures a quick one and saves it: a fresh HOME each
time, the compiled kernels from the usual cache), the default again with
that profile saved, and the targets off (``--tbt-slo-ms 0 --ttft-slo-ms 0``:
no decode probe, nothing measured; the saved profile is loaded). Writes a
new bench/results/startup_cost-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.record import dated, describe, machine, table
from bench.servers import NO_TARGETS, StallfreeServer
from stallfree.core.model.model_runner import resolve_dtype

KERNELS = Path(os.environ.get("STALLFREE_KERNEL_CACHE") or Path.home() / ".cache" / "stallfree" / "kernels")


def ready_s(home: Path, *flags: str) -> float:
    env = {"HOME": str(home), "STALLFREE_KERNEL_CACHE": str(KERNELS)}
    start = time.perf_counter()
    server = StallfreeServer(*flags, env=env)
    took = time.perf_counter() - start
    server.stop()
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")  # what serve picks here
    rows = []
    for rep in range(args.repeats):
        with tempfile.TemporaryDirectory() as home:
            starts = {
                "default, no profile saved (measures one)": (),
                "default, its profile saved": (),
                "targets off": NO_TARGETS,
            }
            for name, flags in starts.items():
                rows.append({"start": name, "repeat": rep, "ready_s": ready_s(Path(home), *flags)})
                print(json.dumps(rows[-1]), file=sys.stderr)
    command = ("python -m bench.serving.startup_cost " + " ".join(sys.argv[1:])).strip()
    record = {"command": command, "machine": machine(), "rows": rows}
    base = dated("startup_cost")
    base.with_suffix(".json").write_text(json.dumps(record, indent=2))
    cells = []
    for name in dict.fromkeys(r["start"] for r in rows):
        times = [r["ready_s"] for r in rows if r["start"] == name]
        cells.append([name, f"{statistics.median(times):.2f}", f"{min(times):.2f}-{max(times):.2f}"])
    lines = [
        "# What serve's start costs, with the targets it derives and without",
        "",
        f"`{command}` on {describe(record['machine'])}: seconds from launch to /readyz answering, "
        f"embedded model, {dtype}, serve's default threads (all {os.cpu_count()} cores); medians of "
        f"{args.repeats} alternating runs.",
        "",
        *table(["start", "ready (s)", "range"], cells, "lrr"),
    ]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
