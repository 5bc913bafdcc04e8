"""Issue 48's two claims, measured against a live ``stallfree serve``:

    .venv/bin/python -m bench.gateway.engine_seam [--stop-s 15] [--requests 300] [--b-seconds 40]

**The gateway never waits on the engine.** The engine process is stopped
(SIGSTOP) for ``--stop-s`` while ``--requests`` requests arrive, spread over
the stop (half WebSocket ``generate`` frames on ten sockets, half OpenAI
completions over HTTP), beside a canary stream that was decoding. Recorded:
the slowest /healthz answer (probed every 100 ms) and any that failed; when
/readyz turned false after the stop and true after the resume; when the
canary heard ``stalled`` and ``resumed``; how many requests were accepted
and how many refused (and with what); that every accepted one ended exactly
once after the resume; any 500; KV blocks back to 0. Then the engine is
stopped again and the gateway sent SIGTERM: the time until it exited.

**No key takes from another.** A server with ``--shed-load --ttft-slo-ms
2000 --tbt-slo-ms 200`` and two API keys and an operator key: key A keeps
128 prompts of 4,000 tokens (each its own) waiting, with 10-minute targets
of their own, then with the server's target; key B sends a 300-token prompt
a second for ``--b-seconds``: how many of B's are refused and B's TTFT.
Then A sends four requests of 500 tokens with n = 16 choices (then with
n = 1) and B 27 ordinary ones at once: B's refusals, the same for both.
And A tries the server's settings and more precedence than it was granted.

Where each runs: the server (gateway and engine process) and this load
client share the machine's cores; the simulated engine (``--sim``: the cost
model's time, slept) keeps the engine's core mostly idle. Writes
bench/results/engine_seam-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from websockets.asyncio.client import connect

from bench.record import dated, describe, machine, table
from bench.servers import StallfreeServer

A, B, OPERATOR = "key-a-secret", "key-b-secret", "operator-secret"
A_PROMPT = "word " * 4000  # 4,000 tokens
B_PROMPT = "dolor sit " * 150  # 300 tokens


def engine_pid(server: StallfreeServer) -> int:
    children = subprocess.check_output(["pgrep", "-P", str(server.proc.pid)], text=True).split()
    return next(int(p) for p in children if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes())


# -- the stall --------------------------------------------------------------------------
async def probe(url: str, path: str, until: asyncio.Event, seen: list[tuple[float, int, float]]) -> None:
    """GET path every 100 ms: (monotonic time, status, seconds it took)."""
    async with httpx.AsyncClient(timeout=30) as http:
        while not until.is_set():
            start = time.monotonic()
            try:
                status = (await http.get(url + path)).status_code
            except httpx.HTTPError:
                status = 0
            seen.append((start, status, time.monotonic() - start))
            await asyncio.sleep(0.1)


async def ws_user(server: StallfreeServer, ids: list[str], gap_s: float, ends: dict[str, list[str]]) -> None:
    """Generations on one socket, one every gap_s; every frame's end kept per id."""
    async with connect(server.ws_url, max_size=None) as ws:
        for gid in ids:
            frame = {"type": "generate", "id": gid, "prompt": "tell me more " * 20, "max_tokens": 16}
            await ws.send(orjson.dumps(frame).decode())
            await asyncio.sleep(gap_s)
        open_ids = set(ids)
        while open_ids:
            frame = orjson.loads(await asyncio.wait_for(ws.recv(), 120))
            gid = frame.get("id")
            if frame["type"] in ("accepted", "done", "error") and gid in open_ids:
                ends.setdefault(gid, []).append(frame["type"] + (f":{frame['code']}" if "code" in frame else ""))
                if frame["type"] != "accepted":
                    open_ids.discard(gid)


async def http_user(server: StallfreeServer, delay_s: float, statuses: list[int]) -> None:
    await asyncio.sleep(delay_s)
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(server.url + "/v1/completions", json={"prompt": "tell me more " * 20, "max_tokens": 16})
        statuses.append(r.status_code)


async def canary(server: StallfreeServer, heard: list[tuple[str, float]], ready: asyncio.Event) -> None:
    async with connect(server.ws_url, max_size=None) as ws:
        body = {"type": "generate", "id": "canary", "prompt": "hi", "max_tokens": 8000, "ignore_eos": True}
        await ws.send(orjson.dumps(body).decode())
        async for raw in ws:
            frame = orjson.loads(raw)
            if frame["type"] == "token":
                ready.set()
            if frame["type"] in ("stalled", "resumed"):
                heard.append((frame["type"], time.monotonic()))
                if frame["type"] == "resumed":
                    await ws.send(orjson.dumps({"type": "cancel", "id": "canary"}).decode())
            if frame["type"] in ("done", "error"):
                return


async def stall(server: StallfreeServer, stop_s: float, requests: int) -> dict[str, Any]:
    pid = engine_pid(server)
    heard: list[tuple[str, float]] = []
    decoding = asyncio.Event()
    canary_task = asyncio.create_task(canary(server, heard, decoding))
    await asyncio.wait_for(decoding.wait(), 60)
    done = asyncio.Event()
    health: list[tuple[float, int, float]] = []
    ready: list[tuple[float, int, float]] = []
    probes = [asyncio.create_task(probe(server.url, "/healthz", done, health)),
              asyncio.create_task(probe(server.url, "/readyz", done, ready))]  # fmt: skip
    await asyncio.sleep(0.5)
    stopped_at = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    n_ws = requests // 2
    ws_ids = [[f"w{s}-{i}" for i in range(n_ws // 10)] for s in range(10)]
    gap = stop_s * 0.9 / max(1, n_ws // 10)
    ends: dict[str, list[str]] = {}
    statuses: list[int] = []
    users = [asyncio.create_task(ws_user(server, ids, gap, ends)) for ids in ws_ids]
    n_http = requests - sum(map(len, ws_ids))
    users += [asyncio.create_task(http_user(server, i * stop_s * 0.9 / n_http, statuses)) for i in range(n_http)]
    await asyncio.sleep(max(0.0, stop_s - (time.monotonic() - stopped_at)))
    os.kill(pid, signal.SIGCONT)
    resumed_at = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*users), 300)
    await asyncio.wait_for(canary_task, 60)
    await asyncio.sleep(1.0)
    done.set()
    await asyncio.gather(*probes)
    kv_used = await asyncio.to_thread(server.wait_kv_baseline, 30.0)
    during = [h for h in health if stopped_at <= h[0] <= resumed_at]
    not_ready = next((t for t, status, _ in ready if t >= stopped_at and status == 503), None)
    ready_again = next((t for t, status, _ in ready if t >= resumed_at and status == 200), None)
    ws_accepted = [kinds for kinds in ends.values() if kinds[0] == "accepted"]
    ws_refused = [kinds for kinds in ends.values() if kinds[0] != "accepted"]
    return {
        "stop_s": stop_s,
        "requests": requests,
        "healthz_probes_during_stop": len(during),
        "healthz_slowest_ms": round(max(h[2] for h in during) * 1e3, 1),
        "healthz_failed": sum(1 for h in health if h[1] != 200),
        "readyz_false_after_s": round(not_ready - stopped_at, 2) if not_ready else None,
        "readyz_true_after_resume_s": round(ready_again - resumed_at, 2) if ready_again else None,
        "canary_heard": [(kind, round(t - stopped_at, 2)) for kind, t in heard],
        "ws_accepted": len(ws_accepted),
        "ws_accepted_ended_once": sum(1 for k in ws_accepted if len(k) == 2 and k[1] == "done"),
        "ws_refused": {k: sum(1 for r in ws_refused if r[0] == k) for k in sorted({r[0] for r in ws_refused})},
        "ws_ends_per_id_max": max((len(k) for k in ends.values()), default=0),
        "http_statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
        "http_500s": statuses.count(500),
        "kv_used_after": kv_used,
    }


def sigterm_while_stopped(server: StallfreeServer) -> float:
    pid = engine_pid(server)
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        os.kill(server.proc.pid, signal.SIGTERM)
        server.proc.wait(60)
        return round(time.monotonic() - start, 2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


# -- fairness ----------------------------------------------------------------------------
async def generate(http: httpx.AsyncClient, url: str, key: str, prompt: str, **fields: Any) -> tuple[int, float | None]:
    """One streamed completion: its status and its TTFT (s; None if refused)."""
    body = {"prompt": prompt, "max_tokens": 8, "ignore_eos": True, "stream": True, **fields}
    start = time.monotonic()
    async with http.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, None
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - start
        return 200, first


async def flood_and_probe(url: str, a_fields: dict[str, Any], b_seconds: float) -> dict[str, Any]:
    """Key A keeps 128 prompts waiting; key B sends one a second."""
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=None)) as http:
        counter = iter(range(1_000_000))
        stop = asyncio.Event()
        a_statuses: list[int] = []

        async def a_user() -> None:
            while not stop.is_set():
                status, _ = await generate(http, url, A, f"{next(counter)} {A_PROMPT}", **a_fields)
                a_statuses.append(status)
                if status != 200:
                    await asyncio.sleep(1.0)

        flood = [asyncio.create_task(a_user()) for _ in range(128)]
        await asyncio.sleep(5.0)
        b = []
        for _ in range(int(b_seconds)):
            b.append(asyncio.create_task(generate(http, url, B, B_PROMPT)))
            await asyncio.sleep(1.0)
        results = await asyncio.gather(*b)
        stop.set()
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    ttfts = sorted(t for s, t in results if s == 200 and t is not None)
    return {
        "a_fields": a_fields,
        "b_sent": len(results),
        "b_refused": sum(1 for s, _ in results if s == 429),
        "b_statuses": {str(s): sum(1 for r, _ in results if r == s) for s in sorted({s for s, _ in results})},
        "b_ttft_p50_ms": round(statistics.median(ttfts) * 1e3) if ttfts else None,
        "b_ttft_max_ms": round(ttfts[-1] * 1e3) if ttfts else None,
        "a_statuses": {str(s): a_statuses.count(s) for s in sorted(set(a_statuses))},
    }


async def choices_burst(url: str, n: int) -> dict[str, Any]:
    """A's four requests of 500 tokens with ``n`` choices, then B's 27 at once."""
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=None)) as http:
        a = [asyncio.create_task(generate(http, url, A, f"{n}-{i} " + "word " * 500, n=n)) for i in range(4)]
        await asyncio.sleep(0.5)
        b = await asyncio.gather(*[generate(http, url, B, f"{i} {B_PROMPT}") for i in range(27)])
        await asyncio.gather(*a)
    ttfts = sorted(t for s, t in b if s == 200 and t is not None)
    return {
        "n": n,
        "b_sent": len(b),
        "b_refused": sum(1 for s, _ in b if s == 429),
        "b_ttft_p50_ms": round(statistics.median(ttfts) * 1e3) if ttfts else None,
    }


def overreach(url: str) -> dict[str, Any]:
    """What key A gets when it asks for what it was not granted."""

    def status(method: str, path: str, body: dict[str, Any]) -> tuple[int, int]:
        r = httpx.request(method, url + path, json=body, headers={"Authorization": f"Bearer {A}"}, timeout=60)
        return r.status_code, len(r.content)

    unknown = httpx.put(url + "/api/config", json={"x" * 100_000: 1}, headers={"Authorization": f"Bearer {OPERATOR}"})
    return {
        "put_chunking_none": status("PUT", "/api/config", {"chunking": "none"})[0],
        "put_shed_load_off": status("PUT", "/api/config", {"shed_load": False})[0],
        "ttft_slo_ms_740": status("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "ttft_slo_ms": 740})[0],
        "priority_minus_1e6": status(
            "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "priority": -1000000}
        )[0],
        "operator_unknown_100kB_name": [unknown.status_code, len(unknown.content)],
    }


def fairness(b_seconds: float) -> dict[str, Any]:
    flags = ["--sim", "--shed-load", "--ttft-slo-ms", "2000", "--tbt-slo-ms", "200"]
    server = StallfreeServer(*flags, "--api-key", A, "--api-key", B, "--admin-key", OPERATOR)
    try:
        far = asyncio.run(flood_and_probe(server.url, {"ttft_slo_ms": 600_000}, b_seconds))
        print(json.dumps(far))
        server.wait_kv_baseline(120)
        default = asyncio.run(flood_and_probe(server.url, {}, b_seconds))
        print(json.dumps(default))
        server.wait_kv_baseline(120)
        burst = [asyncio.run(choices_burst(server.url, n)) for n in (16, 1)]
        print(json.dumps(burst))
        refused = overreach(server.url)
        print(json.dumps(refused))
    finally:
        server.stop()
    return {"far_targets": far, "server_target": default, "choices_bursts": burst, "overreach": refused}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stop-s", type=float, default=15.0)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--b-seconds", type=float, default=40.0)
    args = ap.parse_args()
    server = StallfreeServer("--sim")
    try:
        stalled = asyncio.run(stall(server, args.stop_s, args.requests))
        print(json.dumps(stalled))
        stalled["sigterm_while_stopped_s"] = sigterm_while_stopped(server)
        stalled["exit_status"] = server.proc.returncode
    finally:
        server.stop()
    fair = fairness(args.b_seconds)
    write(args, stalled, fair)


def write(args: argparse.Namespace, stalled: dict[str, Any], fair: dict[str, Any]) -> None:
    m = machine()
    out = dated("engine_seam")
    command = "python -m bench.gateway.engine_seam " + " ".join(
        f"--{k.replace('_', '-')} {v:g}" for k, v in vars(args).items()
    )
    out.with_suffix(".json").write_text(
        json.dumps({"machine": m, "command": command, "stall": stalled, **fair}, indent=1)
    )
    s = stalled
    lines = [
        "# The engine seam: a stopped engine, and two keys (issue 48)",
        "",
        f"Machine: {describe(m)}. Command: `{command}`. The server (`stallfree serve --sim`: gateway and",
        "engine process) and this load client share the machine's cores.",
        "",
        f"## The engine stopped {s['stop_s']:g} s while {s['requests']} requests arrive",
        "",
        *table(
            ["what", "measured"],
            [
                (
                    "/healthz during the stop: probes, slowest",
                    f"{s['healthz_probes_during_stop']}, {s['healthz_slowest_ms']} ms",
                ),
                ("/healthz not 200, whole run", s["healthz_failed"]),
                ("/readyz false after the stop", f"{s['readyz_false_after_s']} s"),
                ("/readyz true again after the resume", f"{s['readyz_true_after_resume_s']} s"),
                ("the canary stream heard", ", ".join(f"{k} at {t} s" for k, t in s["canary_heard"])),
                (
                    "WebSocket: accepted / ended exactly once with done",
                    f"{s['ws_accepted']} / {s['ws_accepted_ended_once']}",
                ),
                ("WebSocket: refused", s["ws_refused"]),
                ("WebSocket: most ends of one id", s["ws_ends_per_id_max"]),
                ("HTTP: statuses", s["http_statuses"]),
                ("500s", s["http_500s"]),
                ("KV blocks in use after", s["kv_used_after"]),
                (
                    "SIGTERM with the engine stopped again: exited after",
                    f"{s['sigterm_while_stopped_s']} s (status {s['exit_status']})",
                ),
            ],
            "lr",
        ),
        "",
        "## Key B beside key A's flood (`--shed-load --ttft-slo-ms 2000 --tbt-slo-ms 200`)",
        "",
        *table(
            ["key A's prompts", "B sent", "B refused", "B TTFT p50", "B TTFT max", "A's statuses"],
            [
                (
                    name,
                    r["b_sent"],
                    r["b_refused"],
                    f"{r['b_ttft_p50_ms']} ms",
                    f"{r['b_ttft_max_ms']} ms",
                    r["a_statuses"],
                )
                for name, r in (
                    ("10-minute targets of their own", fair["far_targets"]),
                    ("the server's target", fair["server_target"]),
                )
            ],
            "lrrrrl",
        ),
        "",
        "Four requests of 500 tokens from A with n choices, then 27 of B's at once: "
        + "; ".join(
            f"n = {b['n']}: B refused {b['b_refused']} of {b['b_sent']}, TTFT p50 {b['b_ttft_p50_ms']} ms"
            for b in fair["choices_bursts"]
        )
        + ".",
        "",
        "Key A asking for more than it was granted (status codes): " + json.dumps(fair["overreach"]),
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    print(f"wrote {out}.md")


if __name__ == "__main__":
    main()
