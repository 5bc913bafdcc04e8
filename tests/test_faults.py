"""Fault containment: an exception anywhere in an iteration fails only the
requests it touched; an engine that cannot go on stops cleanly (every stream
gets its error, health checks say so, the process exits non-zero); nothing
hangs and KV returns to baseline."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx
import pytest
from websockets.asyncio.client import connect

from bench.servers import StallfreeServer
from stallfree.core import faults
from stallfree.core.sched.engine import Engine
from stallfree.gateway.settings import GatewaySettings
from tests.server import sim_server
from tests.wsclient import collect, recv, send


@pytest.fixture(autouse=True)
def disarmed():
    faults.disarm()
    yield
    faults.disarm()


@pytest.fixture(scope="module")
def server():
    s = sim_server(max_num_seqs=RUNNING)
    yield s
    s.stop()


RUNNING = 4  # requests running at once: the rest wait, outside every iteration
# point -> (calls let through before it raises, requests of the failed iteration that fail)
EXPECTED = {
    "schedule": (0, 0),  # raised before any item was formed: nobody was touched
    "allocate": (2, 2),  # two decodes were in the batch when the third allocation raised
    "sample": (0, RUNNING),  # the whole batch ran, none of it produced tokens
    "update": (0, RUNNING),
    "fan_out": (0, 1),  # one request's delivery raised; the rest of the iteration went out
}


async def stream_with_fault(server, point: str, after: int, streams: int = RUNNING + 2, max_tokens: int = 400):
    """Start streams (RUNNING run, two wait), arm the point once the running ones
    decode, then collect every stream."""
    async with connect(server.ws_url) as ws:
        ids = [f"g{i}" for i in range(streams)]
        for i in ids:
            await send(ws, type="generate", id=i, prompt=f"user {i} " * 40, max_tokens=max_tokens)
        decoding = set()
        early = {i: [] for i in ids}
        while len(decoding) < RUNNING:
            f = await recv(ws)
            early[f["id"]].append(f)
            if f["type"] == "token":
                decoding.add(f["id"])
        faults.arm(point, after=after)
        later = await asyncio.wait_for(collect(ws, ids), 30)  # no hang: every stream ends
    return {i: early[i] + later[i] for i in ids}


@pytest.mark.parametrize("point", faults.POINTS)
async def test_a_fault_fails_only_the_requests_it_touched(server, point):
    after, failing = EXPECTED[point]
    frames = await stream_with_fault(server, point, after)
    ends = [f[-1] for f in frames.values()]
    errors = [e for e in ends if e["type"] == "error"]
    done = [e for e in ends if e["type"] == "done"]
    assert all(e["code"] == "internal" for e in errors)
    assert len(errors) == failing, errors
    assert len(done) == len(ends) - failing and all(e["finish_reason"] == "length" for e in done)
    assert not faults._armed  # the fault did fire
    assert server.wait_kv_baseline() == 0
    assert httpx.get(server.url + "/healthz").status_code == 200
    assert httpx.get(server.url + "/readyz").status_code == 200
    # and the engine serves new requests as before
    async with connect(server.ws_url) as ws:
        await send(ws, type="generate", id="after", prompt="hello", max_tokens=5)
        assert (await collect(ws, ["after"]))["after"][-1]["type"] == "done"


async def test_a_request_that_breaks_every_schedule_is_failed_and_the_engine_goes_on(server):
    """Two failed iterations in a row fail everything queued; then the engine recovers."""
    faults.arm("schedule", times=2)
    async with connect(server.ws_url) as ws:
        await send(ws, type="generate", id="victim", prompt="x " * 20, max_tokens=5)
        frames = await collect(ws, ["victim"])
        assert frames["victim"][-1]["type"] == "error" and frames["victim"][-1]["code"] == "internal"
        await send(ws, type="generate", id="next", prompt="x " * 20, max_tokens=5)
        assert (await collect(ws, ["next"]))["next"][-1]["type"] == "done"
    assert server.wait_kv_baseline() == 0


@pytest.mark.slow
async def test_a_broken_engine_stops_cleanly():
    """Every iteration fails: after MAX_FAILED_ITERATIONS in a row the engine gives up;
    every stream has its error, health checks report it, new requests get 503, the
    server shuts down."""
    s = sim_server()
    try:
        faults.arm("sample", times=1000)
        async with connect(s.ws_url) as ws:
            for i in range(Engine.MAX_FAILED_ITERATIONS):  # one failed iteration each
                await send(ws, type="generate", id=f"g{i}", prompt="hi " * 10, max_tokens=50)
                end = (await asyncio.wait_for(collect(ws, [f"g{i}"]), 30))[f"g{i}"][-1]
                assert end["type"] == "error" and end["code"] == "internal"
        deadline = time.monotonic() + 10
        while s.client.fatal is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert s.client.fatal is not None and "in a row failed" in s.client.fatal
        health = httpx.get(s.url + "/healthz")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert httpx.get(s.url + "/readyz").status_code == 503
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        s.thread.join(15)
        assert not s.thread.is_alive()  # the server shut itself down
    finally:
        faults.disarm()
        s.thread.join(15)


@pytest.mark.slow
async def test_watchdog_notices_a_step_thread_that_died():
    s = sim_server()
    try:
        s.loop.stop()  # behind the client's back: the thread just ends
        deadline = time.monotonic() + 5
        while s.client.fatal is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert s.client.fatal == "the engine stopped running"
        assert httpx.get(s.url + "/healthz").status_code == 503
    finally:
        s.thread.join(15)


@pytest.mark.slow
async def test_watchdog_notices_an_iteration_that_never_ends():
    """Slowed 200x, the iteration runs far past its prediction: stalled, then hung."""
    s = sim_server(time_scale=200.0, settings=GatewaySettings(stall_grace_s=0.1, hung_engine_s=0.5))
    try:
        async with connect(s.ws_url) as ws:
            await send(ws, type="generate", id="slow", prompt="word " * 400, max_tokens=5)
            frames = await asyncio.wait_for(collect(ws, ["slow"]), 10)
        assert frames["slow"][-1]["type"] == "error" and frames["slow"][-1]["code"] == "internal"
        assert "the engine has answered nothing for" in s.client.fatal
    finally:
        s.thread.join(15)


@pytest.mark.slow
def test_the_server_process_exits_non_zero_when_the_engine_breaks():
    env = {"STALLFREE_FAULTS": "sample:0:1000"}
    server = StallfreeServer("--sim", "--sim-time-scale", "0.02", env=env)
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal"
        for _ in range(Engine.MAX_FAILED_ITERATIONS):  # more failing iterations until the engine gives up
            try:
                httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
            except httpx.HTTPError:
                break  # already exiting
        assert server.proc.wait(30) == 1
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_faults_are_off_unless_armed():
    code = "from core import faults; print(faults._armed)"
    env = {k: v for k, v in os.environ.items() if k != "STALLFREE_FAULTS"}
    assert subprocess.check_output([sys.executable, "-c", code], env=env, text=True).strip() == "{}"
