"""Gateway load: concurrent WebSocket streams against the simulated runner.

    .venv/bin/python -m bench.gateway.gateway_load [--streams 100,250,500,1000]
        [--streams-per-connection 20] [--time-scales 1,0.1] [--seconds 10]
        [--repeats N] [--baseline PATH] [--engines process,thread]

Starts ``stallfree serve --sim`` in its own process (so the model is not the
bottleneck), opens the streams from this process, and records for every token
frame the delivery latency: client receive time minus the engine's emit time
(``"timestamps": true`` puts the engine's perf_counter_ns in token frames;
CLOCK_MONOTONIC is shared by processes on one machine), and the gateway's part
of it, the frame's ``sent_ns`` (encoded for writing) minus its emit: what the
load generator's own parsing adds is not the gateway's. Smaller time scales
make the simulated model faster, raising the token rate until the gateway is
the bottleneck. ``--baseline PATH`` runs the server of another checkout
(``git worktree add PATH <rev>``) under the same load, alternating with this
one's, for a before/after comparison on one noisy machine; ``--engines``
runs this checkout's server with each ``--engine`` in turn. Writes a new
bench/results/gateway_load-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson
from websockets.asyncio.client import connect

from bench.record import dated, describe, machine, table
from bench.servers import ROOT, StallfreeServer
from stallfree.core.sched.timings import percentile


def start_server(time_scale: float, streams: int, checkout: Path, extra: tuple[str, ...]) -> StallfreeServer:
    return StallfreeServer(
        *extra,
        "--sim",
        "--sim-time-scale",
        str(time_scale),
        "--max-num-seqs",
        str(streams + 8),
        "--token-budget",
        str(max(2048, streams * 2)),
        "--max-waiting",
        str(streams + 8),
        "--kv-cache-gib",
        "8",
        "--max-generations-per-connection",
        "1000",
        checkout=checkout,
    )


def revision(checkout: Path) -> str:
    """The checkout's commit, marked if its tracked files have changed since."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True).stdout.strip()

    changed = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short", "HEAD") + ("+changes" if changed else "")


async def run_load(port: int, streams: int, connections: int, seconds: float) -> dict:
    latencies: list[float] = []
    gateway: list[float] = []
    tokens = 0
    started = asyncio.Event()
    per_conn = [streams // connections + (i < streams % connections) for i in range(connections)]

    async def one(n: int, ready: list[int]) -> None:
        nonlocal tokens
        async with connect(f"ws://127.0.0.1:{port}/v1/stream", max_size=None) as ws:
            for i in range(n):
                frame = {
                    "type": "generate",
                    "id": f"g{i}",
                    "prompt": "load",
                    "max_tokens": 8000,
                    "ignore_eos": True,
                    "timestamps": True,
                }
                await ws.send(orjson.dumps(frame).decode())
            ready.append(1)
            async for raw in ws:
                now = time.perf_counter_ns()
                f = orjson.loads(raw)
                if f["type"] == "token" and started.is_set():
                    tokens += len(f["token_ids"])
                    latencies.append((now - f["emit_ns"]) / 1e6)
                    gateway.append((f["sent_ns"] - f["emit_ns"]) / 1e6)

    ready: list[int] = []
    tasks = [asyncio.create_task(one(n, ready)) for n in per_conn]
    while len(ready) < connections:
        await asyncio.sleep(0.05)
    await asyncio.sleep(2.0)  # let every stream start decoding
    gc.collect()
    gc.freeze()  # the load generator's own collections would show up as latency
    started.set()
    t0 = time.perf_counter()
    await asyncio.sleep(seconds)
    elapsed = time.perf_counter() - t0
    started.clear()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "tokens_per_s": tokens / elapsed,
        "latency_p50_ms": percentile(latencies, 50),
        "latency_p99_ms": percentile(latencies, 99),
        "latency_max_ms": max(latencies, default=0.0),
        "gateway_p50_ms": percentile(gateway, 50),
        "gateway_p99_ms": percentile(gateway, 99),
        "frames": len(latencies),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="100,250,500,1000")
    ap.add_argument("--streams-per-connection", type=int, default=20)
    ap.add_argument("--time-scales", default="1,0.1")
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--baseline", type=Path, help="another checkout whose server runs alternately with this one's")
    ap.add_argument("--engines", help="comma-separated --engine values to run this checkout's server with, alternately")
    args = ap.parse_args()
    here = revision(ROOT)
    servers: dict[str, tuple[Path, tuple[str, ...]]] = {here: (ROOT, ())}
    if args.engines:
        servers = {f"{here} --engine {e}": (ROOT, ("--engine", e)) for e in args.engines.split(",")}
    if args.baseline is not None:
        servers = {f"{revision(args.baseline)} (baseline)": (args.baseline, ()), **servers}
    rows = []
    for rep in range(args.repeats):
        for streams in [int(x) for x in args.streams.split(",")]:
            for scale in [float(x) for x in args.time_scales.split(",")]:
                for server, (checkout, extra) in servers.items():
                    connections = max(1, streams // args.streams_per_connection)
                    launched = start_server(scale, streams, checkout, extra)
                    try:
                        result = asyncio.run(run_load(launched.port, streams, connections, args.seconds))
                    finally:
                        launched.stop()
                    row = {"server": server, "streams": streams, "connections": connections, "time_scale": scale}
                    rows.append({**row, "repeat": rep, **result})
                    print(json.dumps(rows[-1]), file=sys.stderr)
    command = "python -m bench.gateway.gateway_load " + " ".join(sys.argv[1:])
    doc = {"command": command.strip(), "machine": machine(), "rows": rows}
    base = dated("gateway_load")
    base.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    lines = [
        f"# Gateway load: WebSocket streams, {args.streams_per_connection} per connection (simulated runner)",
        "",
        f"`{doc['command']}`; {describe(doc['machine'])}. The load generator runs in a second process on the same",
        "cores. Time scale 1 is this CPU's real-model speed; 0.1 makes the simulated model 10x faster, so the gateway",
        "is the bottleneck. Delivery latency: engine emit (end of the forward pass) -> client receive, per token",
        f"frame. Medians over {args.repeats} repeat(s), servers alternating; p99 range: lowest-highest repeat.",
        "",
    ]
    cells = []
    keys = sorted({(r["streams"], r["time_scale"]) for r in rows}, key=lambda k: (k[0], -k[1]))
    for streams, scale in keys:
        for server in servers:
            rs = [r for r in rows if (r["server"], r["streams"], r["time_scale"]) == (server, streams, scale)]
            med = {
                k: statistics.median(r[k] for r in rs)
                for k in ("tokens_per_s", "latency_p50_ms", "latency_p99_ms", "latency_max_ms", "gateway_p99_ms")
            }
            p99s = [r["latency_p99_ms"] for r in rs]
            cells.append(
                [
                    server,
                    streams,
                    f"{scale:g}",
                    f"{med['tokens_per_s']:.0f}",
                    f"{med['latency_p50_ms']:.2f}",
                    f"{med['latency_p99_ms']:.2f}",
                    f"{min(p99s):.1f}-{max(p99s):.1f}",
                    f"{med['latency_max_ms']:.1f}",
                    f"{med['gateway_p99_ms']:.2f}",
                ]
            )
    header = ["server", "streams", "sim time scale", "delivered tokens/s", "delivery p50 ms", "p99 ms", "p99 range"]
    lines += table([*header, "max ms", "gateway's part p99 ms"], cells, "lrrrrrrrr")
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
