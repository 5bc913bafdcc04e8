"""Normal streams beside a hostile mixed load, against a live ``stallfree serve``.

    .venv/bin/python -m bench.gateway.hostile_load [--sim] [--rounds 2] [--phase-s 20]

Phases alternate (quiet, hostile, quiet, hostile, ...): in each, four users
stream over WebSocket, one generation after another; in a hostile phase, at
the same time, clients with no key and no manners send:

- giant headers (8 MB, again and again, on fresh connections),
- slowloris connections (a header line every 3 s) and idle ones (nothing),
- /tokenize floods (16 at once, 900 kB prompts),
- frames that cannot be echoed (an id nested 260 deep, a 500 kB type),
- chats of 1,025 messages and JSON nested 300 deep.

Recorded: the normal streams' gaps (p50, p99, worst) per phase; the
server's RSS before, after each phase and at the end; what each attack got
back (status codes); /healthz probes answered during the hostile phases;
that every normal generation ended with ``done``; and KV blocks in use at
the end (the server's ``/metrics``). Writes bench/results/hostile_load-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from websockets.asyncio.client import connect

from bench.record import dated, describe, machine, table
from bench.servers import StallfreeServer
from gateway.connections import raise_file_limit

STREAMS = 4


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def gauge(metrics: str, sample: str) -> float:
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(sample + " "))


async def stream_user(url: str, stop_at: float, gaps: list[float], ends: collections.Counter[str]) -> None:
    """One user: a generation after another until stop_at; every gap between tokens."""
    async with connect(url, max_size=None) as ws:
        n = 0
        while time.perf_counter() < stop_at:
            n += 1
            frame = {"type": "generate", "id": f"u{n}", "prompt": "Tell me a story.", "max_tokens": 64}
            await ws.send(orjson.dumps({**frame, "ignore_eos": True}).decode())
            last = None
            while True:
                f = orjson.loads(await asyncio.wait_for(ws.recv(), 120))
                if f["type"] == "token":
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append((now - last) * 1e3)
                    last = now
                elif f["type"] in ("done", "error"):
                    ends[f["type"] if f["type"] == "done" else f["code"]] += 1
                    break


async def raw_exchange(port: int, data: bytes, trickle_s: float = 0.0) -> str:
    """Send data (all at once, or a line every trickle_s), return the status line's code."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        return f"connect: {exc.__class__.__name__}"
    try:
        with contextlib.suppress(ConnectionError):
            if trickle_s:
                for line in data.split(b"\r\n"):
                    writer.write(line + b"\r\n")
                    await writer.drain()
                    if reader.at_eof():
                        break
                    await asyncio.sleep(trickle_s)
            else:
                writer.write(data)
                await writer.drain()
        head = await asyncio.wait_for(reader.readline(), 60)
        return head.split(b" ")[1].decode() if head.count(b" ") >= 2 else "closed"
    except (ConnectionError, TimeoutError, IndexError):
        return "closed"
    finally:
        writer.close()


async def attacks(port: int, stop_at: float, seen: dict[str, collections.Counter[str]], crowd: float = 1.0) -> None:
    """crowd scales the number of slowloris and idle clients (1: 200 and 1,000)."""
    base = f"http://127.0.0.1:{port}"

    async def repeat(name: str, make: Any) -> None:
        while time.perf_counter() < stop_at:
            try:
                seen[name][await make()] += 1
            except (OSError, TimeoutError, httpx.HTTPError) as exc:  # what the attacker saw is the result
                seen[name][exc.__class__.__name__] += 1

    async def giant_header() -> str:
        return await raw_exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (8 << 20) + b"\r\n\r\n")

    async def slowloris() -> str:
        lines = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(40))
        return await raw_exchange(port, lines, trickle_s=3.0)

    async def idle() -> str:
        return await raw_exchange(port, b"")

    async with httpx.AsyncClient(base_url=base, timeout=120) as http:

        async def tokenize() -> str:
            r = await http.post("/tokenize", json={"prompt": "lorem ipsum dolor " * 50_000})
            return str(r.status_code)

        async def many_messages() -> str:
            body = {"messages": [{"role": "user", "content": ""}] * 1025}
            return str((await http.post("/v1/chat/completions", json=body)).status_code)

        async def deep_json() -> str:
            body = b'{"prompt":"hi","metadata":' + b'{"a":' * 300 + b"1" + b"}" * 300 + b"}"
            r = await http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            return str(r.status_code)

        async def bad_frames() -> str:
            async with connect(f"ws://127.0.0.1:{port}/v1/stream", max_size=None) as ws:
                await ws.send('{"type":"cancel","id":' + '{"a":' * 260 + "1" + "}" * 260 + "}")
                await ws.send(orjson.dumps({"type": "x" * 500_000}).decode())
                codes = [orjson.loads(await ws.recv()).get("code") for _ in range(2)]
            return "+".join(codes)

        tasks = [repeat("giant_header", giant_header) for _ in range(2)]
        tasks += [repeat("slowloris", slowloris) for _ in range(round(200 * crowd))]
        tasks += [repeat("idle", idle) for _ in range(round(1000 * crowd))]
        tasks += [repeat("tokenize_flood", tokenize) for _ in range(16)]
        tasks += [repeat("many_messages", many_messages), repeat("deep_json", deep_json)]
        tasks += [repeat("bad_frames", bad_frames)]
        await asyncio.gather(*tasks)


async def health_probes(port: int, stop_at: float, seen: collections.Counter[str]) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        while time.perf_counter() < stop_at:
            try:
                seen[str((await http.get(f"http://127.0.0.1:{port}/healthz")).status_code)] += 1
            except httpx.HTTPError as exc:
                seen[exc.__class__.__name__] += 1
            await asyncio.sleep(0.5)


async def phase(port: int, hostile: bool, seconds: float, crowd: float = 1.0) -> dict[str, Any]:
    stop_at = time.perf_counter() + seconds
    gaps: list[float] = []
    ends: collections.Counter[str] = collections.Counter()
    seen: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    health: collections.Counter[str] = collections.Counter()
    url = f"ws://127.0.0.1:{port}/v1/stream"
    jobs = [stream_user(url, stop_at, gaps, ends) for _ in range(STREAMS)]
    if hostile:
        jobs += [attacks(port, stop_at, seen, crowd), health_probes(port, stop_at, health)]
    await asyncio.gather(*jobs)
    q = statistics.quantiles(gaps, n=100) if len(gaps) > 1 else [0.0] * 99
    return {
        "hostile": hostile,
        "gaps": len(gaps),
        "gap_p50_ms": round(q[49], 1),
        "gap_p99_ms": round(q[98], 1),
        "gap_max_ms": round(max(gaps, default=0.0), 1),
        "normal_ends": dict(ends),
        "attacks": {k: dict(v) for k, v in seen.items()},
        "healthz": dict(health),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sim", action="store_true", help="the simulated runner instead of the embedded model")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--phase-s", type=float, default=20.0)
    args = ap.parse_args()
    raise_file_limit()  # this process holds 1,200 sockets at once
    serve = ["--sim"] if args.sim else ["--threads", "1"]
    server = StallfreeServer(*serve)
    port = server.port
    try:
        rss = {"start": rss_mb(server.proc.pid)}
        phases = []
        for _ in range(args.rounds):
            for hostile in (False, True):
                result = asyncio.run(phase(port, hostile, args.phase_s))
                time.sleep(12)  # the attack's idle and slowloris sockets time out (10 s)
                result["rss_after_mb"] = round(rss_mb(server.proc.pid), 1)
                phases.append(result)
                print(json.dumps(result))
        rss["end"] = rss_mb(server.proc.pid)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        kv_used = gauge(metrics, 'stallfree_kv_blocks{state="used"}')
    finally:
        server.stop()
    write(args, phases, rss, kv_used)


def write(args: argparse.Namespace, phases: list[dict[str, Any]], rss: dict[str, float], kv_used: float) -> None:
    m = machine()
    path = dated("hostile_load")
    command = "python -m bench.gateway.hostile_load" + (" --sim" if args.sim else "")
    command += f" --rounds {args.rounds} --phase-s {args.phase_s:g}"
    doc = {"command": command, "machine": m, "phases": phases, "rss_mb": rss, "kv_blocks_used_at_end": kv_used}
    path.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    lines = [
        "# Normal streams beside a hostile mixed load",
        "",
        f"`{command}` on {describe(m)}, {time.strftime('%Y-%m-%d')}; {STREAMS} WebSocket users streaming "
        f"({'simulated runner' if args.sim else 'the embedded model, 1 thread'}); phases alternate.",
        "",
    ]
    header = ["phase", "gaps", "p50 ms", "p99 ms", "worst ms", "normal generations", "RSS after MB", "/healthz"]
    cells = [
        [
            "hostile" if p["hostile"] else "quiet",
            *(p[k] for k in ("gaps", "gap_p50_ms", "gap_p99_ms", "gap_max_ms", "normal_ends", "rss_after_mb")),
            p["healthz"] or "-",
        ]
        for p in phases
    ]
    lines += table(header, cells, "lrrrrlrl")
    lines += ["", "What the attacks got back (hostile phases, summed):", ""]
    totals: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for p in phases:
        for name, codes in p["attacks"].items():
            totals[name].update(codes)
    lines += [f"- {name}: {dict(codes)}" for name, codes in sorted(totals.items())]
    lines += ["", f"RSS {rss['start']:.0f} MB at start, {rss['end']:.0f} MB at the end; KV blocks in use at the end: "]
    lines[-1] += f"{kv_used:g}."
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
