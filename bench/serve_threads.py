"""Real model behind the gateway: torch threads 1 vs 2 on this 2-core machine.

    .venv/bin/python -m bench.serve_threads [--repeats 2] [--streams 16]

Starts ``stallfree serve --threads N`` (the gateway's event loop shares the
process), runs the same WebSocket load against each setting in alternation,
and reports decode throughput and client-side inter-token gaps. Writes
a new bench/results/serve_threads-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time

import orjson
from websockets.asyncio.client import connect

from bench.record import dated
from bench.servers import start_stallfree, stop
from core.sched.timings import percentile


async def load(port: int, streams: int, tokens: int) -> dict:
    stamps: dict[str, list[float]] = {f"g{i}": [] for i in range(streams)}
    async with connect(f"ws://127.0.0.1:{port}/v1/stream") as ws:
        t0 = time.perf_counter()
        for i in range(streams):
            frame = {
                "type": "generate",
                "id": f"g{i}",
                "prompt": f"Story number {i}: once upon a time",
                "max_tokens": tokens,
                "ignore_eos": True,
            }
            await ws.send(orjson.dumps(frame).decode())
        done = 0
        while done < streams:
            f = orjson.loads(await ws.recv())
            if f["type"] == "token":
                stamps[f["id"]].append(time.perf_counter())
            done += f["type"] in ("done", "error")
        elapsed = time.perf_counter() - t0
    gaps = [(b - a) * 1e3 for s in stamps.values() for a, b in itertools.pairwise(s)]
    return {
        "tokens_per_s": streams * tokens / elapsed,
        "itl_p50_ms": percentile(gaps, 50),
        "itl_p99_ms": percentile(gaps, 99),
        "max_gap_ms": max(gaps),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    rows = []
    for rep in range(args.repeats):
        for threads in (1, 2):
            proc, port = start_stallfree("--threads", str(threads))
            try:
                asyncio.run(load(port, 2, 8))  # warm-up
                rows.append({"threads": threads, "repeat": rep, **asyncio.run(load(port, args.streams, args.tokens))})
            finally:
                stop(proc)
            print(json.dumps(rows[-1]), file=sys.stderr)
    command = ("python -m bench.serve_threads " + " ".join(sys.argv[1:])).strip()
    base = dated("serve_threads")
    base.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=2))
    lines = [
        f"# Gateway + real model in one process: torch threads ({args.streams} streams x {args.tokens} tokens)",
        "",
        f"`{command}` — medians of {args.repeats} alternating runs; the client runs in another process.",
        "",
        "| threads | tokens/s | ITL p50 ms | ITL p99 ms | max gap ms |",
        "|---:|---:|---:|---:|---:|",
    ]
    for threads in (1, 2):
        rs = [r for r in rows if r["threads"] == threads]
        m = {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "itl_p50_ms", "itl_p99_ms", "max_gap_ms")}
        lines.append(
            f"| {threads} | {m['tokens_per_s']:.0f} | {m['itl_p50_ms']:.1f} | {m['itl_p99_ms']:.1f}"
            f" | {m['max_gap_ms']:.0f} |"
        )
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
