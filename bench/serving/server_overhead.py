"""Where the server's time goes: the same decode iterations through the engine
alone and through ``stallfree serve`` with its engine on a thread of the
gateway's process (``--engine thread``) or in a process of its own
(``--engine process``), with and without a crowd of idle clients connected.

    .venv/bin/python -m bench.serving.server_overhead [--streams 8,32,64] [--repeats 3] [--crowd 1000]

Engine alone: this process builds the engine (one compute thread, the
default dtype) and times steady decode iterations of N streams
(``bench.engine.model_throughput.decode_run``). Server: N WebSocket
generations of the same prompt length start together; for the tokens
``WINDOW`` of every stream (all N decoding), the gaps between the engine's
emits (``"timestamps": true``: perf_counter_ns, shared by the processes) are
the server's iteration period, the gaps the client sees are its ITL, and
receive minus emit is the gateway's delivery. The crowd: that many more
WebSocket connections held open (idle) while the N streams run. Configurations
alternate within each repeat; medians over the repeats. Writes a new
bench/results/server_overhead-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import orjson
from websockets.asyncio.client import connect

from bench.record import dated, describe, machine, table
from bench.servers import StallfreeServer
from core.sched.timings import percentile

PROMPT = "Write a long story about a lighthouse keeper and the sea."
MAX_TOKENS = 72
WINDOW = (16, 64)  # token indices measured: after every prefill, before any stream ends


def engine_alone(streams: list[int], prompt_tokens: int) -> dict[int, float]:
    """Median decode iteration (ms) of the engine alone at each stream count."""
    import torch

    from bench.engine.model_throughput import decode_run
    from core.build import ModelSettings, build_engine
    from core.sched.config import SchedulerConfig

    engine, runner = build_engine(ModelSettings(threads=1), SchedulerConfig(max_num_seqs=max(streams) + 8))
    torch.set_num_threads(1)
    steps = WINDOW[1] - WINDOW[0]
    out = {n: decode_run(engine, runner, n, prompt_tokens, steps)["iteration_ms"] for n in streams}
    del engine, runner
    return out


async def through_server(url: str, streams: int, crowd: int) -> dict[str, float]:
    """N streams decoding together (and ``crowd`` idle connections): the engine's
    emit gaps, the client's gaps and the delivery, pooled over the streams."""
    emit_gaps: list[float] = []
    client_gaps: list[float] = []
    delivery: list[float] = []
    idle = [await connect(url, max_size=None) for _ in range(crowd)]

    async def one(i: int) -> None:
        async with connect(url, max_size=None) as ws:
            frame = {"type": "generate", "id": f"s{i}", "prompt": PROMPT, "max_tokens": MAX_TOKENS}
            frame |= {"ignore_eos": True, "temperature": 0, "timestamps": True}
            await ws.send(orjson.dumps(frame).decode())
            index, last_emit, last_seen = 0, 0, 0
            while True:
                f = orjson.loads(await ws.recv())
                now = time.perf_counter_ns()
                if f["type"] in ("done", "error"):
                    break
                if f["type"] != "token":
                    continue
                if WINDOW[0] < index < WINDOW[1]:
                    emit_gaps.append((f["emit_ns"] - last_emit) / 1e6)
                    client_gaps.append((now - last_seen) / 1e6)
                    delivery.append((now - f["emit_ns"]) / 1e6)
                index, last_emit, last_seen = index + len(f["token_ids"]), f["emit_ns"], now

    try:
        await asyncio.gather(*(one(i) for i in range(streams)))
    finally:
        for ws in idle:
            await ws.close()
    return {
        "emit_p50_ms": percentile(emit_gaps, 50),
        "itl_p50_ms": percentile(client_gaps, 50),
        "itl_p99_ms": percentile(client_gaps, 99),
        "max_gap_ms": max(client_gaps),
        "delivery_p50_ms": percentile(delivery, 50),
        "delivery_p99_ms": percentile(delivery, 99),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="8,32,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--crowd", type=int, default=1000, help="idle connections beside the streams (0: no crowd runs)")
    ap.add_argument("--engines", default="thread,process")
    ap.add_argument("--out", default="server_overhead")
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    engines = args.engines.split(",")
    crowds = [0, args.crowd] if args.crowd else [0]
    from core.model.loader import load_tokenizer

    prompt_tokens = len(load_tokenizer().encode(PROMPT))
    rows: list[dict[str, object]] = []
    for rep in range(args.repeats):
        for n, ms in engine_alone(streams, prompt_tokens).items():
            rows.append({"repeat": rep, "config": "engine alone", "streams": n, "crowd": 0, "emit_p50_ms": ms})
            print(json.dumps(rows[-1]), file=sys.stderr)
        for engine in engines:
            server = StallfreeServer("--engine", engine, "--threads", "1", "--max-num-seqs", str(max(streams) + 8))
            try:
                for crowd in crowds:
                    for n in streams:
                        result = asyncio.run(through_server(server.ws_url, n, crowd))
                        rows.append({"repeat": rep, "config": f"--engine {engine}", "streams": n, "crowd": crowd})
                        rows[-1] |= result
                        print(json.dumps(rows[-1]), file=sys.stderr)
            finally:
                server.stop()
    write(args, rows, streams)


def write(args: argparse.Namespace, rows: list[dict[str, object]], streams: list[int]) -> None:
    command = "python -m bench.serving.server_overhead " + " ".join(sys.argv[1:])
    doc = {"command": command.strip(), "machine": machine(), "rows": rows}
    base = dated(args.out)
    base.with_suffix(".json").write_text(json.dumps(doc, indent=2))

    def med(config: str, n: int, crowd: int, key: str) -> float:
        values = [float(r[key]) for r in rows if (r["config"], r["streams"], r["crowd"]) == (config, n, crowd)]
        return statistics.median(values) if values else float("nan")

    def spread(config: str, n: int, crowd: int, key: str) -> str:
        values = [float(r[key]) for r in rows if (r["config"], r["streams"], r["crowd"]) == (config, n, crowd)]
        return f"{min(values):.1f}-{max(values):.1f}" if values else ""

    cells = []
    for n in streams:
        alone = med("engine alone", n, 0, "emit_p50_ms")
        cells.append(["engine alone", n, "", f"{alone:.1f}", "", "", "", "", "", ""])
        for config in sorted({str(r["config"]) for r in rows} - {"engine alone"}):
            for crowd in sorted({int(r["crowd"]) for r in rows if r["config"] == config}):  # type: ignore[call-overload]
                emit = med(config, n, crowd, "emit_p50_ms")
                itl = med(config, n, crowd, "itl_p50_ms")
                cells.append(
                    [
                        config,
                        n,
                        crowd,
                        f"{emit:.1f} [{spread(config, n, crowd, 'emit_p50_ms')}]",
                        f"{emit / alone:.2f}",
                        f"{itl:.1f}",
                        f"{itl / alone:.2f}",
                        f"{med(config, n, crowd, 'itl_p99_ms'):.1f}",
                        f"{med(config, n, crowd, 'delivery_p50_ms'):.2f}",
                        f"{med(config, n, crowd, 'delivery_p99_ms'):.2f}",
                    ]
                )
    header = ["configuration", "streams", "idle clients", "iteration p50 ms [range]", "/ alone"]
    header += ["client ITL p50 ms", "/ alone", "ITL p99 ms", "delivery p50 ms", "delivery p99 ms"]
    lines = [
        "# Where the server's time goes: decode through the engine alone and through the server",
        "",
        f"`{doc['command']}`; {describe(doc['machine'])}; {os.cpu_count()} cores. One compute thread everywhere;",
        "the load generator shares the cores. Iteration: the gap between two of the engine's emits (the engine",
        "alone: its step's time). Client ITL: the gap the client sees. Delivery: client receive - engine emit.",
        f"Tokens {WINDOW[0]}-{WINDOW[1]} of each stream (all streams decoding). Medians over {args.repeats} repeat(s),",
        "configurations alternating; ranges: lowest-highest repeat.",
        "",
        *table(header, cells, "lrrrrrrrrr"),
    ]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
