"""What scale-out costs and buys, side by side in one run: one ``stallfree
serve`` process against ``--replicas 2`` (Ray Serve), started in turn.

    python -m bench.scaleout.replicas hop [--streams 100 --seconds 10 --repeats 3]
    python -m bench.scaleout.replicas throughput [--clients 8 --seconds 40 --repeats 2]

hop: the simulated runner (no model), 100 concurrent WebSocket streams;
per token frame, the delivery latency (client receive minus the engine's
emit time, which a replica stamps on the wall clock). The difference between
the two is what the hop to a replica adds.

throughput: the real model, 1 torch thread per engine (one engine, or two
replicas); closed-loop clients each send a ~100-token prompt for 64 tokens,
again and again; delivered tokens per second. The load generator and the
gateway share this machine's cores with the engines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import orjson
from websockets.asyncio.client import connect

from bench.gateway.gateway_load import run_load
from bench.record import dated, describe, machine, table
from bench.servers import StallfreeServer
from stallfree.loadtest.workloads import WORDS

REPLICAS = ("--replicas", "2", "--stats-period-s", "0.5")


def hop(args: argparse.Namespace) -> list[dict]:
    rows = []
    for rep in range(args.repeats):
        for label, extra in (("1 process", ()), ("2 replicas", REPLICAS)):
            server = StallfreeServer(
                "--sim",
                "--max-num-seqs",
                str(args.streams + 8),
                "--max-waiting",
                str(args.streams + 8),
                "--kv-cache-gib",
                "4",
                "--max-generations-per-connection",
                "1000",
                *extra,
            )
            try:
                result = asyncio.run(run_load(server.port, args.streams, max(1, args.streams // 20), args.seconds))
            finally:
                server.stop()
            rows.append({"setup": label, "repeat": rep, **result})
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


async def closed_loop(port: int, clients: int, seconds: float) -> dict:
    counted = 0
    requests = 0
    counting = asyncio.Event()
    words = WORDS

    async def client(c: int) -> None:
        nonlocal counted, requests
        rng = random.Random(c)
        async with connect(f"ws://127.0.0.1:{port}/v1/stream", max_size=None) as ws:
            for n in range(1_000_000):
                prompt = " ".join(rng.choice(words) for _ in range(100))
                await ws.send(
                    orjson.dumps(
                        {"type": "generate", "id": f"c{n}", "prompt": prompt, "max_tokens": 64, "ignore_eos": True}
                    ).decode()
                )
                async for raw in ws:
                    f = orjson.loads(raw)
                    if f["type"] == "token" and counting.is_set():
                        counted += len(f["token_ids"])
                    if f["type"] in ("done", "error"):
                        requests += counting.is_set()
                        break

    tasks = [asyncio.create_task(client(c)) for c in range(clients)]
    await asyncio.sleep(10.0)  # warm-up: kernels, first prompts
    counting.set()
    t0 = time.perf_counter()
    await asyncio.sleep(seconds)
    elapsed = time.perf_counter() - t0
    counting.clear()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"tokens_per_s": counted / elapsed, "requests_finished": requests, "seconds": elapsed}


def throughput(args: argparse.Namespace) -> list[dict]:
    rows = []
    for rep in range(args.repeats):
        for label, extra in (("1 process", ()), ("2 replicas", REPLICAS)):
            server = StallfreeServer("--threads", "1", "--max-num-seqs", "32", "--kv-cache-gib", "1", *extra)
            try:
                result = asyncio.run(closed_loop(server.port, args.clients, args.seconds))
            finally:
                server.stop()
            rows.append({"setup": label, "repeat": rep, **result})
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def setups_table(rows: list[dict], keys: list[tuple[str, str]]) -> list[str]:
    cells = []
    for setup in dict.fromkeys(r["setup"] for r in rows):
        row = [setup]
        for key, _ in keys:
            v = [r[key] for r in rows if r["setup"] == setup]
            row.append(f"{statistics.median(v):,.2f} [{min(v):,.2f}-{max(v):,.2f}]")
        cells.append(row)
    return table(["setup", *(f"{title} median [min-max]" for _, title in keys)], cells, "l" + "r" * len(keys))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("hop", "throughput"))
    p.add_argument("--streams", type=int, default=100)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float)
    p.add_argument("--repeats", type=int)
    args = p.parse_args()
    m = machine()
    if args.what == "hop":
        args.seconds, args.repeats = args.seconds or 10.0, args.repeats or 3
        rows = hop(args)
        keys = [
            ("latency_p50_ms", "delivery p50 ms"),
            ("latency_p99_ms", "delivery p99 ms"),
            ("tokens_per_s", "tokens/s"),
        ]
        title = f"# The hop to a replica: delivery latency at {args.streams} streams (simulated runner)"
    else:
        args.seconds, args.repeats = args.seconds or 40.0, args.repeats or 2
        rows = throughput(args)
        keys = [("tokens_per_s", "tokens/s"), ("requests_finished", "requests finished")]
        title = f"# Real model: 2 replicas (1 thread each) vs 1 process (1 thread), {args.clients} closed-loop clients"
    command = "python -m bench.scaleout.replicas " + " ".join(sys.argv[1:])
    base = dated(f"replicas_{args.what}")
    base.with_suffix(".json").write_text(json.dumps({"command": command, "machine": m, "rows": rows}, indent=2))
    lines = [
        title,
        "",
        f"`{command}` on {describe(m)}; configurations alternate, {args.repeats} runs each.",
        "",
        *setups_table(rows, keys),
        "",
    ]
    base.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
