"""Soak: the real gateway (simulated engine, its own process) under steady
load plus disconnect and cancel storms, sampled every minute.

    .venv/bin/python -m bench.gateway.soak --minutes 60

Load: ``--rate`` requests a second, alternating WebSocket generations on a
pool of sockets and OpenAI-API calls (streaming and not); every ``--storm-s``
seconds a disconnect storm (sockets that start generations and vanish
mid-stream) or a cancel storm (generations cancelled at once or after their
first token). Each sample: requests served, errors by kind, KV blocks in use,
open file descriptors and RSS of the server process. After the load stops,
KV must return to zero. Writes a new bench/results/soak-<date>.{json,md}.
A short version runs in ``make test`` (tests/test_soak.py).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from websockets.asyncio.client import connect

from bench.servers import StallfreeServer


@dataclass
class Tally:
    served: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # error codes the server answered with
    client: Counter[str] = field(default_factory=Counter)  # what the load itself did (storms, drops)


class Server(StallfreeServer):
    """``stallfree serve --sim`` in a child process, observed through /proc."""

    def __init__(self, *args: str) -> None:
        super().__init__("--sim", *args, log_level="error")

    def sample(self) -> dict[str, Any]:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
        kv = httpx.get(self.url + "/api/config", timeout=30).json()["kv_cache"]
        return {
            "rss_mib": round(rss_kb / 1024, 1),
            "fds": len(os.listdir(f"/proc/{self.proc.pid}/fd")),
            "kv_used_blocks": kv["used_blocks"],
        }


def _generate(gen_id: str, prompt: str, max_tokens: int) -> str:
    return orjson.dumps({"type": "generate", "id": gen_id, "prompt": prompt, "max_tokens": max_tokens}).decode()


async def _socket_worker(url: str, tally: Tally, queue: asyncio.Queue[int]) -> None:
    """One long-lived socket: takes generation jobs, reads every frame."""
    ids = itertools.count()
    async with connect(url, max_size=None) as ws:

        async def reader() -> None:
            async for text in ws:
                f = orjson.loads(text)
                if f["type"] == "done":
                    tally.served += 1
                elif f["type"] == "error":
                    tally.errors[f["code"]] += 1

        task = asyncio.create_task(reader())
        try:
            while True:
                max_tokens = await queue.get()
                await ws.send(_generate(f"s{next(ids)}", "w " * random.randint(5, 200), max_tokens))
        finally:
            task.cancel()


async def _http_request(http: httpx.AsyncClient, tally: Tally, stream: bool) -> None:
    body = {"prompt": "q " * random.randint(5, 200), "max_tokens": random.randint(1, 48), "stream": stream}
    try:
        if stream:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    tally.errors[orjson.loads(await r.aread())["error"]["code"]] += 1
                    return
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        tally.served += 1
        else:
            r = await http.post("/v1/completions", json=body)
            if r.status_code == 200:
                tally.served += 1
            else:
                tally.errors[r.json()["error"]["code"]] += 1
    except httpx.HTTPError as exc:
        tally.client[f"http_{type(exc).__name__}"] += 1


async def _disconnect_storm(url: str, tally: Tally, sockets: int = 20) -> None:
    async def one() -> None:
        async with connect(url) as ws:
            for i in range(2):
                await ws.send(_generate(f"d{i}", "x " * 50, 500))
            await asyncio.wait_for(ws.recv(), 30)
            ws.transport.abort()  # vanish mid-stream, no close handshake

    results = await asyncio.gather(*(one() for _ in range(sockets)), return_exceptions=True)
    tally.client["disconnect_storm_sockets"] += sockets
    tally.client["storm_socket_errors"] += sum(1 for r in results if isinstance(r, Exception))


async def _cancel_storm(url: str, tally: Tally, gens: int = 40) -> None:
    async with connect(url) as ws:
        for i in range(gens):
            await ws.send(_generate(f"c{i}", "y " * 30, 400))
            if i % 2 == 0:  # half at once, half after their first frames
                await ws.send(orjson.dumps({"type": "cancel", "id": f"c{i}"}).decode())
        await asyncio.sleep(0.2)
        for i in range(1, gens, 2):
            await ws.send(orjson.dumps({"type": "cancel", "id": f"c{i}"}).decode())
        ended = 0
        while ended < gens:
            f = orjson.loads(await asyncio.wait_for(ws.recv(), 60))
            if f["type"] in ("done", "error"):
                ended += 1
    tally.client["cancel_storm_generations"] += gens


async def soak(server: Server, minutes: float, rate: float, storm_s: float, sample_s: float) -> dict[str, Any]:
    tally = Tally()
    samples = [{"t_s": 0.0, "served": 0, **server.sample()}]
    queue: asyncio.Queue[int] = asyncio.Queue()
    workers = [asyncio.create_task(_socket_worker(server.ws_url, tally, queue)) for _ in range(8)]
    pending: set[asyncio.Task[None]] = set()
    start = time.monotonic()
    end = start + minutes * 60
    next_sample, next_storm, storms = start + sample_s, start + storm_s, itertools.cycle(("disconnect", "cancel"))
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        for n in itertools.count():
            now = time.monotonic()
            if now >= end:
                break
            kind = n % 3
            if kind == 0:
                queue.put_nowait(random.randint(1, 64))
            else:
                task = asyncio.create_task(_http_request(http, tally, stream=kind == 1))
                pending.add(task)
                task.add_done_callback(pending.discard)
            if now >= next_storm:
                storm = _disconnect_storm if next(storms) == "disconnect" else _cancel_storm
                task = asyncio.create_task(storm(server.ws_url, tally))
                pending.add(task)
                task.add_done_callback(pending.discard)
                next_storm += storm_s
            if now >= next_sample:
                samples.append({"t_s": round(now - start, 1), "served": tally.served, **server.sample()})
                print(json.dumps(samples[-1]), flush=True)
                next_sample += sample_s
            await asyncio.sleep(random.expovariate(rate))
        await asyncio.gather(*pending, return_exceptions=True)
        while not queue.empty():
            await asyncio.sleep(0.1)
    await asyncio.sleep(2.0)  # the pool's last generations finish
    for w in workers:
        w.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    deadline = time.monotonic() + 30
    while (final := server.sample())["kv_used_blocks"] and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    samples.append({"t_s": round(time.monotonic() - start, 1), "served": tally.served, **final, "after_load": True})
    return {"samples": samples, "served": tally.served, "errors": dict(tally.errors), "load": dict(tally.client)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second (default %(default)s)")
    ap.add_argument("--storm-s", type=float, default=20.0, help="seconds between storms")
    ap.add_argument("--sample-s", type=float, default=60.0)
    args = ap.parse_args()
    from bench.record import dated, describe, machine, table

    server = Server("--max-waiting", "512")
    try:
        result = asyncio.run(soak(server, args.minutes, args.rate, args.storm_s, args.sample_s))
    finally:
        exit_code = server.stop()
    m = machine()
    command = f"python -m bench.gateway.soak {' '.join(sys.argv[1:])}".strip()
    record = {"command": command, "machine": m, "server_exit_code": exit_code, **result}
    base = dated("soak")
    base.with_suffix(".json").write_text(json.dumps(record, indent=2))
    samples = result["samples"]
    warm = samples[min(5, len(samples) - 1)]
    last = samples[-1]
    lines = [
        "# Soak: the gateway with the simulated engine, steady load plus disconnect and cancel storms",
        "",
        f"`{command}` on {describe(m)}. Served {result['served']:,} requests; "
        f"errors answered: {result['errors'] or 'none'}; load: {result['load']}; server exit code {exit_code}.",
        "",
        f"After warm-up (sample {samples.index(warm)}) to the end: RSS {warm['rss_mib']} → {last['rss_mib']} MiB, "
        f"open FDs {warm['fds']} → {last['fds']}, KV blocks in use after the load: {last['kv_used_blocks']}.",
        "",
        *table(
            ["t (s)", "served", "RSS MiB", "open FDs", "KV blocks in use"],
            [
                [
                    f"{s['t_s']}{' (after load)' if s.get('after_load') else ''}",
                    f"{s['served']:,}",
                    s["rss_mib"],
                    s["fds"],
                    s["kv_used_blocks"],
                ]
                for s in samples
            ],
            "rrrrr",
        ),
    ]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
