"""The gateway never waits on the engine process (issue 48, findings 1 and 2):
commands to an engine that reads nothing never block the event loop, a full
outbox refuses at once, one reply nobody waits for drops no other message,
the engine's sender is bounded, and a stalled engine is noticed in seconds,
told to every stream, and never keeps SIGTERM from ending the server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from websockets.asyncio.client import connect

from bench.servers import StallfreeServer
from stallfree.core.sched.engine_process import _Sender
from stallfree.core.sched.wire import Fatal, Frames, decode
from stallfree.gateway.engine.backend import EngineBusy
from stallfree.gateway.engine.process import EngineProcess
from tests.engines import roomy_engine
from tests.server import sim_server
from tests.simkit import request
from tests.test_engine_process import Recorder, result, until
from tests.wsclient import recv, send

LONG_PROMPT = 7000  # tokens: a pickled submit of about 20 KiB, as the probe sent


def engine_pid(server: StallfreeServer) -> int:
    children = subprocess.check_output(["pgrep", "-P", str(server.proc.pid)], text=True).split()
    (pid,) = [int(p) for p in children if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    return pid


class Stopped:
    """SIGSTOP a process, and SIGCONT it after ``rescue_s`` whatever happens (so
    that a test of today's blocking code ends, failed, instead of hanging)."""

    def __init__(self, pid: int, rescue_s: float) -> None:
        self.pid = pid
        os.kill(pid, signal.SIGSTOP)
        self.rescue = threading.Timer(rescue_s, self.resume)
        self.rescue.start()

    def resume(self) -> None:
        self.rescue.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)


async def test_commands_to_an_engine_that_reads_nothing_never_block_the_loop():
    proc = EngineProcess(roomy_engine)
    rec = Recorder()
    proc.start(rec)
    stopped = Stopped(proc.process.pid, rescue_s=8.0)
    try:
        slowest = 0.0
        futures = []
        for i in range(40):  # about 800 KiB: a dozen times the pipe's buffer
            start = time.monotonic()
            futures.append(proc.submit(request(f"big{i}", LONG_PROMPT, max_tokens=2)))
            slowest = max(slowest, time.monotonic() - start)
        assert slowest < 0.1, f"a submit blocked the event loop for {slowest:.1f} s"
        stopped.resume()
        for future in futures:
            await result(future)
        await until(lambda: len(rec.finished()) == 40)
    finally:
        stopped.resume()
        proc.stop()


async def test_a_full_outbox_refuses_submits_and_still_takes_aborts():
    proc = EngineProcess(roomy_engine, outbox_bytes=256 << 10)
    rec = Recorder()
    proc.start(rec)
    stopped = Stopped(proc.process.pid, rescue_s=20.0)
    try:
        sent = []
        refused = None
        for i in range(100):
            try:
                proc.submit(request(f"q{i}", LONG_PROMPT, max_tokens=50))
            except EngineBusy as exc:
                refused = exc
                break
            sent.append(f"q{i}")
        assert refused is not None and "has not read" in str(refused)
        assert 10 < len(sent) < 100
        aborted = proc.abort(sent[-1])  # never refused: it frees what a request holds
        stopped.resume()
        assert await result(aborted) is True
        await until(lambda: len(rec.finished()) == len(sent))
        assert set(rec.finished()) == set(sent)  # each ended once, nothing lost
    finally:
        stopped.resume()
        proc.stop()


async def test_a_reply_nobody_waits_for_any_more_drops_no_other_message():
    proc = EngineProcess(roomy_engine)
    rec = Recorder()
    proc.start(rec)
    try:
        await result(proc.submit(request("r", 8, max_tokens=300, ignore_eos=True)))
        proc.abort("nobody").cancel()  # its caller gave up: its reply arrives to nobody
        seen = {proc.last_step_ns}
        while len(seen) < 30:  # the loop reads nothing meanwhile: the reply and many steps arrive in one read
            seen.add(proc.last_step_ns)
        await until(lambda: "r" in rec.finished())
        assert len(rec.tokens("r")) == 300
    finally:
        proc.stop()


def test_the_engines_sender_waits_for_a_gateway_that_reads_nothing():
    read_end, write_end = os.pipe()
    sender = _Sender(write_end, capacity=8)
    putter = threading.Thread(target=lambda: [sender.put(Fatal(f"{i}" + "x" * 100_000)) for i in range(100)])
    putter.start()
    putter.join(1.0)
    assert putter.is_alive(), "100 messages queued without anybody reading: the queue is unbounded"
    received = []
    reader = threading.Thread(target=lambda: received.extend(iter(lambda: os.read(read_end, 1 << 20), b"")))
    reader.start()
    putter.join(10)
    assert not putter.is_alive()  # read, the pipe takes them all
    sender.close()
    os.close(write_end)
    reader.join(10)
    os.close(read_end)
    frames = Frames().feed(b"".join(received))
    assert sum(len(decode(f)) for f in frames) == 100  # every message, in frames of at most 256


@pytest.fixture
def served():
    server = StallfreeServer("--sim", "--sim-time-scale", "0.02")
    yield server
    server.stop()


async def probe_health(url: str, until_s: float, worst: list[float]) -> None:
    """Ask /healthz every 100 ms until ``until_s`` (monotonic); the slowest answer goes in worst."""
    async with httpx.AsyncClient(timeout=30) as http:
        while time.monotonic() < until_s:
            start = time.monotonic()
            r = await http.get(url + "/healthz")
            assert r.status_code == 200
            worst[0] = max(worst[0], time.monotonic() - start)
            await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_a_stopped_engine_is_noticed_told_and_nothing_is_lost(served):
    """The engine stopped 6 s while 60 requests arrive: /healthz answers at once,
    /readyz turns false and the open stream hears ``stalled`` within seconds,
    requests are refused (503) or accepted, and after the resume every accepted
    one ends exactly once."""
    pid = engine_pid(served)
    async with connect(served.ws_url, max_size=None) as ws, httpx.AsyncClient(timeout=60) as http:
        await send(ws, type="generate", id="canary", prompt="hi", max_tokens=5000, ignore_eos=True)
        assert (await recv(ws))["type"] == "accepted"
        stopped = Stopped(pid, rescue_s=6.0)
        stop_at = time.monotonic()
        worst = [0.0]
        health = asyncio.create_task(probe_health(served.url, stop_at + 7.0, worst))
        for i in range(40):
            await send(ws, type="generate", id=f"g{i}", prompt="tell me more " * 40, max_tokens=4)
        posts = [
            asyncio.create_task(http.post(served.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}))
            for _ in range(20)
        ]
        while (await http.get(served.url + "/readyz")).status_code == 200:
            assert time.monotonic() - stop_at < 5.0, "/readyz still true 5 s after the engine stopped"
            await asyncio.sleep(0.1)
        not_ready_s = time.monotonic() - stop_at
        ends: dict[str, list[str]] = {}
        told = []
        while time.monotonic() < stop_at + 30:
            frame = await recv(ws, timeout=30)
            if frame["type"] in ("stalled", "resumed") and frame["id"] == "canary":
                told.append((frame["type"], time.monotonic() - stop_at))
            if frame["type"] in ("done", "error"):
                ends.setdefault(frame["id"], []).append(frame["type"])
            if len([i for i in ends if i.startswith("g")]) == 40 and ("resumed" in dict(told)):
                break
        await health
        replies = await asyncio.gather(*posts)
    assert not_ready_s < 5.0 and worst[0] < 1.0, (not_ready_s, worst)
    assert told[0][0] == "stalled" and told[0][1] < 5.0 and told[-1][0] == "resumed", told
    assert all(len(kinds) == 1 for kinds in ends.values()), ends  # each generation ended exactly once
    refused = [i for i, kinds in ends.items() if kinds == ["error"]]
    assert len(ends) == 40 and all(kinds == ["done"] for i, kinds in ends.items() if i not in refused)
    assert {r.status_code for r in replies} <= {200, 503}
    assert all(r.json()["error"]["code"] == "unavailable" for r in replies if r.status_code == 503)
    assert (await asyncio.to_thread(httpx.get, served.url + "/readyz")).status_code == 200
    assert served.wait_kv_baseline() == 0
    stopped.resume()


@pytest.mark.slow
def test_sigterm_ends_the_server_while_its_engine_is_stopped():
    server = StallfreeServer("--sim", "--sim-time-scale", "0.02")
    stopped = None
    try:
        pid = engine_pid(server)
        body = {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # it streams
            stopped = Stopped(pid, rescue_s=30.0)
            start = time.monotonic()
            os.kill(server.proc.pid, signal.SIGTERM)
            for _ in range(20):  # a flood meanwhile: refused (shutting down), or the server is gone
                with contextlib.suppress(httpx.HTTPError):
                    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
                    assert r.status_code in (429, 503), r.text
            os.kill(server.proc.pid, signal.SIGTERM)  # a second one changes nothing but haste
            status = server.proc.wait(20)
            took = time.monotonic() - start
        assert took < 10.0, f"SIGTERM took {took:.1f} s"
        assert status in (0, -signal.SIGTERM)  # uvicorn raises the signal again once it has shut down
    finally:
        if stopped is not None:
            stopped.resume()
        server.stop()


# -- five more attacks ----------------------------------------------------------------------
async def test_a_cancel_flood_sends_the_engine_one_abort():
    """2,000 cancels of one generation: one abort command, not 2,000 (each would
    be a command in the engine's inbox, or on a stopped engine's pipe)."""
    server = sim_server(time_scale=0.02)
    aborts = []
    real = server.loop.abort
    server.client.backend.abort = lambda rid: (aborts.append(rid), real(rid))[1]  # type: ignore[method-assign]
    try:
        async with connect(server.ws_url, close_timeout=0.5) as ws:  # (the late cancels' errors are left unread)
            await send(ws, type="generate", id="g", prompt="hi", max_tokens=5000, ignore_eos=True)
            assert (await recv(ws))["type"] == "accepted"
            for _ in range(2000):
                await send(ws, type="cancel", id="g")
            while (frame := await recv(ws))["type"] != "done":
                pass
        assert frame["finish_reason"] == "cancelled" and len(aborts) == 1
    finally:
        server.stop()


@pytest.mark.slow
async def test_a_flapping_engine_tells_each_stall_once_and_loses_nothing(served):
    """Stopped three times for 3 s: the stream hears stalled, resumed, three
    times in turn, keeps its tokens in order, and settings changes meanwhile
    are refused at once (503), not left hanging."""
    pid = engine_pid(served)
    told = []
    indexes = []
    async with connect(served.ws_url, max_size=None) as ws, httpx.AsyncClient(timeout=30) as http:
        await send(ws, type="generate", id="c", prompt="hi", max_tokens=8000, ignore_eos=True)
        assert (await recv(ws))["type"] == "accepted"
        for _ in range(3):
            stopped = Stopped(pid, rescue_s=3.0)
            while (frame := await recv(ws))["type"] != "stalled":
                indexes += [frame["index"]] if frame["type"] == "token" else []
            told.append(frame["type"])
            start = time.monotonic()
            r = await http.put(served.url + "/api/config", json={"token_budget": 600})
            assert r.status_code == 503 and time.monotonic() - start < 1.0
            stopped.rescue.join()
            while (frame := await recv(ws))["type"] != "resumed":
                indexes += [frame["index"]] if frame["type"] == "token" else []
            told.append(frame["type"])
        await send(ws, type="cancel", id="c")
        while (frame := await recv(ws))["type"] not in ("done", "error"):
            indexes += [frame["index"]] if frame["type"] == "token" else []
    assert told == ["stalled", "resumed"] * 3 and frame["type"] == "done"
    assert indexes == sorted(set(indexes))  # in order, none twice


@pytest.mark.slow
def test_the_openai_client_streams_through_a_stall(served):
    """The stall notice on SSE is a comment: the official client reads past it."""
    pid = engine_pid(served)
    client = OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(
        model="m", prompt="hi", max_tokens=3000, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = 0
    stopped = None
    for _ in stream:
        chunks += 1
        if chunks == 5:
            stopped = Stopped(pid, rescue_s=3.5)
    assert stopped is not None and not stopped.rescue.is_alive()  # it went through the whole stall
    assert chunks >= 3000 // 8  # tokens arrive several to a chunk at most
