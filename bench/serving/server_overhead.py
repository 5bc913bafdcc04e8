"""Where the server's time goes: the same decode iterations through the engine
alone and through ``stallfree serve`` with its engine on a thread of the
gateway's process (``--engine thread``) or in a process of its own
(``--engine process``), with and without a crowd of idle clients connected.

    .venv/bin/python -m bench.serving.server_overhead [--streams 8,32,64] [--repeats 3] [--crowd 1000] [--threads 1]

Engine alone: this process builds the engine (``--threads`` compute threads
each, default one; the default dtype) and times steady decode iterations of N streams
(``bench.engine.model_throughput.decode_run``). Server: N WebSocket
generations of the same prompt length start together; for the tokens
``WINDOW`` of every stream (all N decoding), the gaps between the engine's
emits (``"timestamps": true``: perf_counter_ns, shared by the processes) are
the server's iteration period, the gaps the client sees are its ITL, and
receive minus emit is the gateway's delivery; the CPU each process used
meanwhile (cores: CPU seconds over wall seconds, from /proc) splits the
machine between the engine, the gateway and the load generator. The crowd:
that many more WebSocket connections held open (idle) while the N streams run.
``--openai``: the same streams also through the OpenAI streaming API (SSE,
``loadtest``'s client), where only the client's gaps are seen.
``--server-flags "A|B"``: each server configuration once per set of extra
``serve`` flags (e.g. ``--engine-switch-interval-ms 1|--engine-switch-interval-ms 5``).
``--baseline PATH``: each server configuration also from another checkout
(``git worktree add PATH <rev>``), named "baseline ...", for a before/after.
Configurations alternate within each repeat; medians over the repeats.
Writes a new bench/results/server_overhead-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.client import connect

from bench.record import dated, describe, machine, table
from bench.servers import NO_TARGETS, ROOT, StallfreeServer
from stallfree.core.sched.timings import percentile

PROMPT = "Write a long story about a lighthouse keeper and the sea."
MAX_TOKENS = 72
WINDOW = (16, 64)  # token indices measured: after every prefill, before any stream ends


def engine_alone(streams: list[int], prompt_tokens: int, threads: int) -> tuple[dict[int, float], str]:
    """Median decode iteration (ms) of the engine alone at each stream count, and
    the dtype it ran (the default's, as the server's)."""
    import torch

    from bench.engine.model_throughput import decode_run
    from stallfree.core.build import ModelSettings, build_engine
    from stallfree.core.sched.config import SchedulerConfig

    engine, runner = build_engine(ModelSettings(threads=threads), SchedulerConfig(max_num_seqs=max(streams) + 8))
    torch.set_num_threads(threads)
    steps = WINDOW[1] - WINDOW[0]
    out = {n: decode_run(engine, runner, n, prompt_tokens, steps)["iteration_ms"] for n in streams}
    dtype = str(runner.dtype).removeprefix("torch.")
    del engine, runner
    return out, dtype


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


async def through_openai(url: str, streams: int) -> dict[str, float]:
    """N streams decoding together over the OpenAI SSE API: the client's gaps."""
    from stallfree.loadtest.clients import OpenAITarget
    from stallfree.loadtest.runner import run_jobs
    from stallfree.loadtest.workloads import Arrival

    jobs = [Arrival(0.0, f"{i}: {PROMPT}", MAX_TOKENS) for i in range(streams)]
    results = await run_jobs(OpenAITarget(url + "/v1", "stallfree"), jobs)
    gaps = [g * 1e3 for r in results for g in r.gaps_s[WINDOW[0] : WINDOW[1] - 1]]
    return {"itl_p50_ms": percentile(gaps, 50), "itl_p99_ms": percentile(gaps, 99), "max_gap_ms": max(gaps)}


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def processes(server: StallfreeServer) -> dict[str, int]:
    """The gateway, its engine process (``--engine process``) and this load generator."""
    children = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    engines = [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return {"gateway": server.proc.pid, **({"engine": engines[0]} if engines else {}), "client": os.getpid()}


def with_cores(server: StallfreeServer, run: Coroutine[Any, Any, dict[str, float]]) -> dict[str, float]:
    """Run the load; its figures and the cores each process used meanwhile."""
    pids = processes(server)
    before, started = {k: cpu_s(p) for k, p in pids.items()}, time.perf_counter()
    result = asyncio.run(run)
    wall = time.perf_counter() - started
    return result | {f"{k}_cores": (cpu_s(p) - before[k]) / wall for k, p in pids.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="8,32,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--crowd", type=int, default=1000, help="idle connections beside the streams (0: no crowd runs)")
    ap.add_argument("--engines", default="thread,process")
    ap.add_argument("--openai", action="store_true", help="also through the OpenAI streaming API (no crowd)")
    ap.add_argument("--out", default="server_overhead")
    ap.add_argument("--threads", default="1", help="compute threads, each count a configuration (e.g. 1,2)")
    ap.add_argument("--server-flags", default="", help="extra serve flags, '|' between configurations")
    ap.add_argument("--baseline", type=Path, help="another checkout whose servers run beside this one's, alternately")
    args = ap.parse_args()
    variants = [v.split() for v in args.server_flags.split("|")]
    threads = [int(t) for t in args.threads.split(",")]
    streams = [int(s) for s in args.streams.split(",")]
    engines = args.engines.split(",")
    crowds = [0, args.crowd] if args.crowd else [0]
    from stallfree.core.model.embedded import load_tokenizer

    prompt_tokens = len(load_tokenizer().encode(PROMPT))
    rows: list[dict[str, object]] = []
    for rep in range(args.repeats):
        for t in threads:
            at = f" --threads {t}" if len(threads) > 1 else ""
            alone, dtype = engine_alone(streams, prompt_tokens, t)
            for n, ms in alone.items():
                rows.append({"repeat": rep, "config": f"engine alone{at}", "streams": n, "crowd": 0, "emit_p50_ms": ms})
                print(json.dumps(rows[-1]), file=sys.stderr)
            checkouts = [ROOT, args.baseline] if args.baseline else [ROOT]
            checkouts = checkouts[::-1] if rep % 2 else checkouts  # ABBA: neither checkout always runs second
            for engine, extra, checkout in ((e, v, c) for e in engines for v in variants for c in checkouts):
                flags = ("--engine", engine, "--threads", str(t), "--max-num-seqs", str(max(streams) + 8))
                flags += (*NO_TARGETS, *extra)
                server = StallfreeServer(*flags, checkout=checkout)
                named = f"--engine {engine}{' ' + ' '.join(extra) if extra else ''}{at}"
                named = named if checkout == ROOT else f"baseline {named}"
                try:
                    for crowd in crowds:
                        for n in streams:
                            result = with_cores(server, through_server(server.ws_url, n, crowd))
                            rows.append({"repeat": rep, "config": named, "streams": n, "crowd": crowd} | result)
                            print(json.dumps(rows[-1]), file=sys.stderr)
                    for n in streams if args.openai else []:
                        result = with_cores(server, through_openai(server.url, n))
                        config = f"{named}, OpenAI API"
                        rows.append({"repeat": rep, "config": config, "streams": n, "crowd": 0} | result)
                        print(json.dumps(rows[-1]), file=sys.stderr)
                finally:
                    server.stop()
    write(args, rows, streams, dtype)


def write(args: argparse.Namespace, rows: list[dict[str, object]], streams: list[int], dtype: str) -> None:
    command = "python -m bench.serving.server_overhead " + " ".join(sys.argv[1:])
    # medians per configuration, stream count and crowd: the shape bench.before_after reads
    by_cell: dict[str, list[dict[str, object]]] = {}
    for r in rows:
        by_cell.setdefault(f"{r['config']}, {r['streams']} streams, {r['crowd']} idle", []).append(r)
    results = {
        name: {
            key: statistics.median(float(r[key]) for r in cell if key in r)  # type: ignore[arg-type]
            for key in sorted({k for r in cell for k in r if k.endswith(("_ms", "_cores"))})
        }
        for name, cell in sorted(by_cell.items())
    }
    m = machine()
    doc = {"command": command.strip(), "machine": m, "dtype": dtype, "rows": rows, "results": results}
    base = dated(args.out)
    base.with_suffix(".json").write_text(json.dumps(doc, indent=2))

    def values(config: str, n: int, crowd: int, key: str) -> list[float]:
        cell = [r for r in rows if (r["config"], r["streams"], r["crowd"]) == (config, n, crowd) and key in r]
        return [float(r[key]) for r in cell]  # type: ignore[arg-type]

    def med(config: str, n: int, crowd: int, key: str) -> float:
        found = values(config, n, crowd, key)
        return statistics.median(found) if found else float("nan")

    def shown(x: float, digits: int = 1) -> str:
        return "–" if x != x else f"{x:.{digits}f}"  # NaN: not measured that way

    def spread(config: str, n: int, crowd: int, key: str) -> str:
        found = values(config, n, crowd, key)
        return f" [{min(found):.1f}-{max(found):.1f}]" if found else ""

    cells = []
    alones = sorted({str(r["config"]) for r in rows if str(r["config"]).startswith("engine alone")})
    for n, alone_config in ((n, a) for n in streams for a in alones):
        suffix = alone_config.removeprefix("engine alone")  # the thread count's, when several are compared
        alone = med(alone_config, n, 0, "emit_p50_ms")
        cells.append([alone_config, n, "", shown(alone), "", "", "", "", "", "", ""])
        servers = {str(r["config"]) for r in rows} - set(alones)
        for config in sorted(c for c in servers if c.removesuffix(", OpenAI API").endswith(suffix)):
            for crowd in sorted({int(r["crowd"]) for r in rows if r["config"] == config}):  # type: ignore[call-overload]
                emit = med(config, n, crowd, "emit_p50_ms")
                itl = med(config, n, crowd, "itl_p50_ms")
                cells.append(
                    [
                        config,
                        n,
                        crowd,
                        shown(emit) + spread(config, n, crowd, "emit_p50_ms"),
                        shown(emit / alone, 2),
                        shown(itl),
                        shown(itl / alone, 2),
                        shown(med(config, n, crowd, "itl_p99_ms")),
                        shown(med(config, n, crowd, "delivery_p50_ms"), 2),
                        shown(med(config, n, crowd, "delivery_p99_ms"), 2),
                        " / ".join(
                            shown(med(config, n, crowd, f"{k}_cores"), 2)
                            for k in ("engine", "gateway", "client")
                            if any(f"{k}_cores" in r for r in rows if r["config"] == config)
                        ),
                    ]
                )
    header = ["configuration", "streams", "idle clients", "iteration p50 ms [range]", "/ alone"]
    header += ["client ITL p50 ms", "/ alone", "ITL p99 ms", "delivery p50 ms", "delivery p99 ms"]
    header += ["cores: engine process / gateway / client (thread: gateway / client)"]
    lines = [
        "# Where the server's time goes: decode through the engine alone and through the server",
        "",
        f"`{doc['command']}`; {describe(m)}; {os.cpu_count()} cores; dtype {dtype}, compute threads",
        f"{args.threads} (as each configuration says); the load generator shares the cores. Iteration: the gap",
        "between two of the engine's emits (the engine alone: its step's time). Client ITL: the gap the client sees.",
        "Delivery: client receive - engine emit.",
        f"Tokens {WINDOW[0]}-{WINDOW[1]} of each stream (all streams decoding). Medians over {args.repeats} repeat(s),",
        "configurations alternating; ranges: lowest-highest repeat.",
        "",
        *table(header, cells, "lrrrrrrrrrr"),
    ]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
