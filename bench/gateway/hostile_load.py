"""Normal streams beside a hostile mixed load, against a live ``stallfree serve``.

    .venv/bin/python -m bench.gateway.hostile_load [--sim] [--rounds 2] [--phase-s 20]

Phases alternate (quiet, hostile, quiet, hostile, ...): in each, four users
stream over WebSocket, one generation after another; in a hostile phase, at
the same time, clients with no key and no manners send:

- giant headers (8 MB, again and again, on fresh connections),
- slowloris connections (a header line every 3 s) and idle ones (nothing),
- /tokenize floods (16 at once, 900 kB prompts),
- frames that cannot be echoed (an id nested 260 deep, a 500 kB type),
- chats of 1,025 messages and JSON nested 300 deep;

and, with ``--round4`` (issue 36's findings), on a server with an API key
that the four users send and the attackers mostly do not:

- pipelining floods (29,000 requests a write, never reading the answers),
- WebSocket frames announcing 4 MB before any key, fragment floods (a
  TEXT frame, then empty continuations), ping floods from a client that
  never reads,
- endless chunked trailers, keep-alive trickles (a byte a second after an
  answered request), h2c upgrade floods (log lines),
- with the key: tool schemas of 8,000 chained ``$defs``, bad ``tool_choice``
  shapes, a 900 kB ``model`` string with ``n`` = 16, ``response_format``
  with 300 patterned required properties, and 64 prompts of 7,900 tokens at
  once.

Recorded: the normal streams' gaps (p50, p99, worst) per phase; the
server's RSS and open file descriptors before, during (the peak), after each
phase and at the end; every 500 any attack saw; what each attack got
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
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from websockets.asyncio.client import connect
from websockets.exceptions import WebSocketException
from websockets.frames import Frame, Opcode

from bench.gateway.users import stream_user
from bench.record import dated, describe, machine, table
from bench.servers import StallfreeServer
from stallfree.core.sched.timings import percentile
from stallfree.gateway.edge.connections import raise_file_limit

STREAMS = 4


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def gauge(metrics: str, sample: str) -> float:
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(sample + " "))


def open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def fd_kinds(pid: int) -> dict[str, int]:
    """What the open file descriptors are (socket, pipe, anon_inode:[eventfd], a path...)."""
    kinds: collections.Counter[str] = collections.Counter()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = str(fd.readlink())
            kinds[target.split(":[")[0] if target.startswith(("socket", "pipe")) else target] += 1
    return dict(kinds)


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


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


async def repeat_until(name: str, make: Any, stop_at: float, seen: dict[str, collections.Counter[str]]) -> None:
    """make() again and again until stop_at; one still running 5 s after it is cut ("cut at phase end")."""
    while (left := stop_at - time.perf_counter()) > 0:
        try:
            seen[name][await asyncio.wait_for(make(), left + 5)] += 1
        except TimeoutError:
            seen[name]["cut at phase end"] += 1
        except (OSError, httpx.HTTPError, WebSocketException) as exc:  # what the attacker saw is the result
            seen[name][exc.__class__.__name__] += 1


async def attacks(
    port: int, stop_at: float, seen: dict[str, collections.Counter[str]], crowd: float = 1.0, key: str | None = None
) -> None:
    """crowd scales the number of slowloris and idle clients (1: 200 and 1,000); key: what the
    body and frame attacks send, to reach the parsers on a server that requires one."""
    base = f"http://127.0.0.1:{port}"

    async def repeat(name: str, make: Any) -> None:
        await repeat_until(name, make, stop_at, seen)

    async def giant_header() -> str:
        return await raw_exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (8 << 20) + b"\r\n\r\n")

    async def slowloris() -> str:
        lines = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(40))
        return await raw_exchange(port, lines, trickle_s=3.0)

    async def idle() -> str:
        return await raw_exchange(port, b"")

    async with httpx.AsyncClient(base_url=base, timeout=120, headers=auth(key)) as http:

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
            async with connect(f"ws://127.0.0.1:{port}/v1/stream", max_size=None, additional_headers=auth(key)) as ws:
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


async def ws_raw(port: int, key: str | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A WebSocket handshake by hand (the attacks write frames no client library would)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = "GET /v1/stream HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    head += "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in auth(key).items()) + "\r\n"
    writer.write(head.encode())
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    return reader, writer


def ws_frame(opcode: Opcode, data: bytes, fin: bool = True) -> bytes:
    return Frame(opcode, data, fin=fin).serialize(mask=True)


async def close_code(reader: asyncio.StreamReader, timeout_s: float = 30) -> str:
    """The server's close code, once it closes ("open" if it has not within timeout_s)."""
    data = b""
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await reader.read(65536):
                data += chunk
    except TimeoutError:
        return "open"
    except ConnectionError:
        return "reset"
    at = data.rfind(b"\x88")
    return str(int.from_bytes(data[at + 2 : at + 4], "big")) if at >= 0 and len(data) >= at + 4 else "closed"


async def round4_attacks(port: int, stop_at: float, seen: dict[str, collections.Counter[str]], key: str) -> None:
    """Issue 36's findings as attacks; the schema ones come from a careless user with the key."""

    async def pipeline_flood() -> str:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)  # its answers are never read
        burst = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 29_000
        writes = 0
        try:
            for _ in range(20):  # never reading the answers
                writer.write(burst)
                await asyncio.wait_for(writer.drain(), 2)
                writes += 1
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.transport.abort()  # gone without a goodbye, its unsent burst dropped
        return "held back" if writes < 20 else "all written"

    async def ws_big_frame_before_key() -> str:
        reader, writer = await ws_raw(port)
        frame = ws_frame(Opcode.TEXT, b"x" * 4_000_000)
        with contextlib.suppress(ConnectionError):
            writer.write(frame[:3_990_000])
            await writer.drain()
        try:
            return await close_code(reader)
        finally:
            writer.close()

    async def fragment_flood() -> str:
        reader, writer = await ws_raw(port)
        with contextlib.suppress(ConnectionError):
            writer.write(ws_frame(Opcode.TEXT, b"", fin=False) + ws_frame(Opcode.CONT, b"", fin=False) * 200_000)
            await writer.drain()
        try:
            return await close_code(reader)
        finally:
            writer.close()

    async def ping_flood_no_read() -> str:
        _reader, writer = await ws_raw(port, key)  # its pongs are never read
        ping = ws_frame(Opcode.PING, b"p" * 125) * 1000
        sent = 0
        try:
            async with asyncio.timeout(5):
                while True:
                    writer.write(ping)
                    await writer.drain()
                    sent += 1000
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.transport.abort()
        return "held back" if sent < 1_000_000 else "all written"

    async def trailer_flood() -> str:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-T: "
        return await raw_exchange(port, head + b"a" * (4 << 20))

    async def keepalive_trickle() -> str:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b'"ok"}'), 30)
            for _ in range(20):  # a byte a second for 20 s: closed, or still held at the end
                writer.write(b"x")
                await writer.drain()
                try:
                    if await asyncio.wait_for(reader.read(1), 1) == b"":
                        return "closed"
                except TimeoutError:
                    continue
            return "held 20 s"
        except ConnectionError:
            return "closed"
        finally:
            writer.close()

    async def h2c_upgrade() -> str:
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        return await raw_exchange(port, head + b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\nConnection: close\r\n\r\n")

    messages = [{"role": "user", "content": "hi"}]
    defs: dict[str, Any] = {"d0": {"type": "string"}}
    defs.update({f"d{i}": {"$ref": f"#/$defs/d{i - 1}"} for i in range(1, 8000)})
    chain = {"type": "object", "properties": {"x": {"$ref": "#/$defs/d7999"}}, "required": ["x"], "$defs": defs}
    patterned = {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]+x{i}$"} for i in range(300)}
    fmt = {
        "type": "json_schema",
        "json_schema": {
            "name": "x",
            "schema": {"type": "object", "properties": patterned, "required": list(patterned)},
        },
    }

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300, headers=auth(key)) as http:

        async def tool_schema_chain() -> str:
            tool = {"type": "function", "function": {"name": "f", "parameters": chain}}
            body = {"messages": messages, "tools": [tool], "max_tokens": 1}
            return str((await http.post("/v1/chat/completions", json=body)).status_code)

        async def bad_tool_choice() -> str:
            tool = {"type": "function", "function": {"name": "f"}}
            codes = []
            for choice in ({"type": "function", "function": "f"}, {"type": "function", "function": None}, ["f"], 3):
                body = {"messages": messages, "tools": [tool], "tool_choice": choice, "max_tokens": 1}
                codes.append(str((await http.post("/v1/chat/completions", json=body)).status_code))
            return "+".join(sorted(set(codes)))

        async def model_echo() -> str:
            body = {"prompt": "hi", "model": "m" * 900_000, "n": 16, "max_tokens": 100, "stream": True}
            size = 0
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for chunk in r.aiter_bytes():
                    size += len(chunk)
            return f"{r.status_code}, {'under' if size < 1 << 20 else 'over'} 1 MB back"

        async def patterned_format() -> str:
            body = {"prompt": "hi", "response_format": fmt, "max_tokens": 8}
            return str((await http.post("/v1/completions", json=body)).status_code)

        async def long_prompt_burst() -> str:
            bodies = [{"prompt": f"{i} {time.time()} " + "lorem ipsum " * 1575, "max_tokens": 16} for i in range(64)]
            replies = await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))  # ~7,900 tokens
            return "+".join(sorted({str(r.status_code) for r in replies}))

        tasks = [repeat_until("pipeline_flood", pipeline_flood, stop_at, seen)]
        tasks += [repeat_until("ws_4mb_frame_before_key", ws_big_frame_before_key, stop_at, seen) for _ in range(8)]
        tasks += [repeat_until("fragment_flood", fragment_flood, stop_at, seen)]
        tasks += [repeat_until("ping_flood_no_read", ping_flood_no_read, stop_at, seen)]
        tasks += [repeat_until("trailer_flood", trailer_flood, stop_at, seen) for _ in range(2)]
        tasks += [repeat_until("keepalive_trickle", keepalive_trickle, stop_at, seen) for _ in range(20)]
        tasks += [repeat_until("h2c_upgrade", h2c_upgrade, stop_at, seen)]
        tasks += [repeat_until("tool_schema_8000_defs", tool_schema_chain, stop_at, seen)]
        tasks += [repeat_until("bad_tool_choice", bad_tool_choice, stop_at, seen)]
        tasks += [repeat_until("model_echo_n16", model_echo, stop_at, seen)]
        tasks += [repeat_until("response_format_300_patterns", patterned_format, stop_at, seen)]
        tasks += [repeat_until("long_prompt_burst_64x7900", long_prompt_burst, stop_at, seen)]
        await asyncio.gather(*tasks)


async def health_probes(port: int, stop_at: float, seen: collections.Counter[str], key: str | None = None) -> None:
    async with httpx.AsyncClient(timeout=10, headers=auth(key)) as http:
        while time.perf_counter() < stop_at:
            try:
                seen[str((await http.get(f"http://127.0.0.1:{port}/healthz")).status_code)] += 1
            except httpx.HTTPError as exc:
                seen[exc.__class__.__name__] += 1
            await asyncio.sleep(0.5)


async def watch_process(pid: int, stop_at: float, peak: dict[str, float]) -> None:
    """The server's RSS and open file descriptors, sampled every 0.25 s: their peaks."""
    while time.perf_counter() < stop_at:
        peak["rss_mb"] = max(peak.get("rss_mb", 0.0), rss_mb(pid))
        peak["fds"] = max(peak.get("fds", 0), open_fds(pid))
        await asyncio.sleep(0.25)


async def phase(
    port: int,
    hostile: bool,
    seconds: float,
    crowd: float = 1.0,
    key: str | None = None,
    round4: bool = False,
    pid: int | None = None,
) -> dict[str, Any]:
    """key: the users' API key (the server requires one); round4: issue 36's attacks too;
    pid: the server's process, watched for its peak RSS and file descriptors."""
    stop_at = time.perf_counter() + seconds
    gaps: list[float] = []
    ends: collections.Counter[str] = collections.Counter()
    seen: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    health: collections.Counter[str] = collections.Counter()
    peak: dict[str, float] = {}
    url = f"ws://127.0.0.1:{port}/v1/stream"
    jobs = [stream_user(url, stop_at, gaps, ends=ends, headers=auth(key)) for _ in range(STREAMS)]
    if pid is not None:
        jobs.append(watch_process(pid, stop_at, peak))
    if hostile:
        jobs += [attacks(port, stop_at, seen, crowd, key), health_probes(port, stop_at, health, key)]
        if round4:
            assert key is not None, "round 4's attacks need a server with a key"
            jobs.append(round4_attacks(port, stop_at, seen, key))
    await asyncio.gather(*jobs)
    return {
        "hostile": hostile,
        "gaps": len(gaps),
        "gap_p50_ms": round(percentile(gaps, 50), 1),
        "gap_p99_ms": round(percentile(gaps, 99), 1),
        "gap_max_ms": round(max(gaps, default=0.0), 1),
        "normal_ends": dict(ends),
        "attacks": {k: dict(v) for k, v in seen.items()},
        "healthz": dict(health),
        "peak_rss_mb": round(peak.get("rss_mb", 0.0), 1),
        "peak_fds": int(peak.get("fds", 0)),
    }


KEY = "hostile-load-key"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sim", action="store_true", help="the simulated runner instead of the embedded model")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--round4", action="store_true", help="issue 36's attacks too, on a server with an API key")
    ap.add_argument("--tbt-slo-ms", type=float, default=0.0, help="the server's TBT target (0: none, the default)")
    ap.add_argument("--engine", choices=("process", "thread"), default="process", help="the server's --engine")
    args = ap.parse_args()
    raise_file_limit()  # this process holds 1,200 sockets at once
    serve = ["--engine", args.engine, *(["--sim"] if args.sim else ["--threads", "1"])]
    serve += ["--tbt-slo-ms", f"{args.tbt_slo_ms:g}", "--ttft-slo-ms", "0"]
    key = KEY if args.round4 else None
    server = StallfreeServer(*serve, *(["--api-key", KEY] if key else []))
    port, pid = server.port, server.proc.pid
    try:
        start = {"rss_mb": rss_mb(pid), "fds": open_fds(pid), "fd_kinds": fd_kinds(pid)}
        phases = []
        for _ in range(args.rounds):
            for hostile in (False, True):
                result = asyncio.run(phase(port, hostile, args.phase_s, key=key, round4=args.round4, pid=pid))
                time.sleep(12)  # the attack's idle and slowloris sockets time out (10 s)
                result["rss_after_mb"] = round(rss_mb(pid), 1)
                result["fds_after"] = open_fds(pid)
                phases.append(result)
                print(json.dumps(result))
        settle_at = time.monotonic() + 70  # past stalled_connection_s (60 s): anything held is dropped by then
        while open_fds(pid) > start["fds"] and time.monotonic() < settle_at:
            time.sleep(1)
        end = {"rss_mb": rss_mb(pid), "fds": open_fds(pid), "fd_kinds": fd_kinds(pid)}
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=auth(key)).text
        kv_used = gauge(metrics, 'stallfree_kv_blocks{state="used"}')
    finally:
        server.stop()
    write(args, phases, start, end, kv_used)


def write(
    args: argparse.Namespace, phases: list[dict[str, Any]], start: dict[str, Any], end: dict[str, Any], kv: float
) -> None:
    m = machine()
    path = dated("hostile_load")
    command = "python -m bench.gateway.hostile_load" + (" --sim" if args.sim else "")
    command += f" --rounds {args.rounds} --phase-s {args.phase_s:g}" + (" --round4" if args.round4 else "")
    command += f" --tbt-slo-ms {args.tbt_slo_ms:g}" if args.tbt_slo_ms else ""
    command += f" --engine {args.engine}"
    doc = {"command": command, "machine": m, "phases": phases, "start": start, "end": end, "kv_blocks_used_at_end": kv}
    path.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    lines = [
        "# Normal streams beside a hostile mixed load",
        "",
        f"`{command}` on {describe(m)}, {time.strftime('%Y-%m-%d')}; {STREAMS} WebSocket users streaming "
        f"({'simulated runner' if args.sim else 'the embedded model, 1 thread, --dtype auto'}); phases alternate.",
        "",
    ]
    header = ["phase", "gaps", "p50 ms", "p99 ms", "worst ms", "normal generations", "peak RSS MB", "RSS after MB"]
    header += ["peak fds", "fds after", "/healthz"]
    keys = ("gaps", "gap_p50_ms", "gap_p99_ms", "gap_max_ms", "normal_ends", "peak_rss_mb", "rss_after_mb")
    cells = [
        [
            "hostile" if p["hostile"] else "quiet",
            *(p[k] for k in keys),
            p["peak_fds"],
            p["fds_after"],
            p["healthz"] or "-",
        ]
        for p in phases
    ]
    lines += table(header, cells, "lrrrrlrrrrl")
    lines += ["", "What the attacks got back (hostile phases, summed):", ""]
    totals: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for p in phases:
        for name, codes in p["attacks"].items():
            totals[name].update(codes)
    lines += [f"- {name}: {dict(codes)}" for name, codes in sorted(totals.items())]
    errors = sorted(name for name, codes in totals.items() if any(c.startswith("5") and c != "503" for c in codes))
    lines += ["", f"5xx other than 503 (overload) seen by: {', '.join(errors) or 'no attack'}."]
    lines += [
        f"At start RSS {start['rss_mb']:.0f} MB and {start['fds']:.0f} file descriptors; at the end "
        f"{end['rss_mb']:.0f} MB and {end['fds']:.0f}; KV blocks in use at the end: {kv:g}.",
        f"File descriptors by kind at start {start['fd_kinds']}, at the end {end['fd_kinds']}.",
    ]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
