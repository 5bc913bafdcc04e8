"""The engine in a process of its own: the one-message-per-iteration protocol
(ordering, aborts racing completion, settings, a slow gateway) and failure
(death, hangs, start-up errors, no orphans)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect

from bench.servers import StallfreeServer
from stallfree.core.sched.engine import StepOutput
from stallfree.core.sched.request import FinishReason
from stallfree.core.sched.step_loop import EngineStopped
from stallfree.gateway.engine.process import EngineProcess, EngineStartFailed
from tests.engines import broken_factory, fast_engine, hanging_engine, interval_engine, thread_engine
from tests.simkit import request
from tests.wsclient import collect, send


class Recorder:
    """The listener: every step in arrival order, the fatal reason."""

    def __init__(self) -> None:
        self.steps: list[StepOutput] = []
        self.fatal: list[str] = []

    def on_step(self, out: StepOutput) -> None:
        self.steps.append(out)

    def on_fatal(self, reason: str) -> None:
        self.fatal.append(reason)

    def finished(self) -> dict[str, FinishReason]:
        return {o.request_id: o.finish_reason for s in self.steps for o in s.outputs if o.finish_reason is not None}

    def tokens(self, request_id: str) -> list[int]:
        return [t for s in self.steps for o in s.outputs if o.request_id == request_id for t in o.new_token_ids]


async def until(predicate, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    """Let the loop run (it reads the engine's pipe) until predicate holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def result(future: Future) -> object:  # type: ignore[type-arg]
    return await asyncio.wait_for(asyncio.wrap_future(future), 20)


@pytest.fixture
async def engine():
    proc = EngineProcess(fast_engine)
    rec = Recorder()
    proc.start(rec)
    yield proc, rec
    proc.stop()
    assert not proc.process.is_alive()


async def test_outputs_arrive_in_order_once_per_iteration(engine):
    proc, rec = engine
    assert proc.name == "test-sim" and proc.facts == {"runner": "test"}
    for i in range(5):
        await result(proc.submit(request(f"r{i}", 10, max_tokens=6)))
    await until(lambda: len(rec.finished()) == 5)
    iterations = [s.iteration.iteration for s in rec.steps if s.iteration is not None]
    assert iterations == sorted(set(iterations))  # one message each, in order
    assert all(len(rec.tokens(f"r{i}")) == 6 for i in range(5))
    assert set(rec.finished().values()) == {FinishReason.LENGTH}
    assert proc.snapshot.counts.kv_used_blocks == 0  # counts came with the last step
    assert proc.last_step_ns > 0 and proc.busy_since_ns == 0


async def test_aborts_racing_completion_end_a_request_once(engine):
    proc, rec = engine
    for i in range(8):
        proc.submit(request(f"a{i}", 10, max_tokens=4 + i))
        proc.abort(f"a{i}")  # whatever has run by then
    await until(lambda: len(rec.finished()) == 8)
    assert not await result(proc.abort("a0"))  # long finished
    ends = [o.request_id for s in rec.steps for o in s.outputs if o.finish_reason is not None]
    assert sorted(ends) == sorted(set(ends))  # each request ended exactly once
    assert set(rec.finished().values()) <= {FinishReason.ABORT, FinishReason.LENGTH}
    await until(lambda: proc.snapshot.counts.kv_used_blocks == 0)


async def test_settings_change_before_the_caller_hears_back(engine):
    proc, _ = engine
    seen = []
    future = proc.reconfigure({"token_budget": 32})
    future.add_done_callback(lambda f: seen.append(proc.snapshot.config.token_budget))
    assert await result(future) == []
    assert seen == [32]
    with pytest.raises(ValueError, match="token_budget"):
        await result(proc.reconfigure({"token_budget": -1}))
    assert proc.snapshot.config.token_budget == 32  # a refused change changes nothing


async def test_a_slow_gateway_never_holds_up_the_engine(engine):
    proc, rec = engine
    for i in range(4):
        await result(proc.submit(request(f"s{i}", 8, max_tokens=300, ignore_eos=True)))
    # the gateway's loop busy (blocked right here): the engine goes on iterating
    seen = {proc.last_step_ns}
    deadline = time.monotonic() + 20
    while len(seen) < 100:
        assert time.monotonic() < deadline, "the engine stopped while the gateway did not read"
        seen.add(proc.last_step_ns)
    await until(lambda: len(rec.finished()) == 4)
    assert all(len(rec.tokens(f"s{i}")) == 300 for i in range(4))  # nothing lost
    iterations = [s.iteration.iteration for s in rec.steps if s.iteration is not None]
    assert iterations == sorted(set(iterations))


async def test_an_engine_that_dies_fails_everything_that_waits():
    proc = EngineProcess(fast_engine)
    rec = Recorder()
    proc.start(rec)
    try:
        await result(proc.submit(request("long", 8, max_tokens=100_000, ignore_eos=True)))
        os.kill(proc.process.pid, signal.SIGKILL)
        await until(lambda: rec.fatal)
        assert "exited" in rec.fatal[0] and not proc.alive
        with pytest.raises(EngineStopped):
            await result(proc.submit(request("late", 8)))
    finally:
        proc.stop()


async def test_a_hung_iteration_shows_and_the_process_is_killed_on_stop():
    proc = EngineProcess(hanging_engine)
    proc.start(Recorder())
    await result(proc.submit(request("hang-1", 8)))
    await until(lambda: proc.busy_since_ns and time.perf_counter_ns() - proc.busy_since_ns > 0.2e9)
    assert proc.alive  # alive, and busy since: the gateway's watchdog decides
    proc.stop(timeout=0.5)
    assert not proc.process.is_alive()


def test_the_switch_interval_is_set_where_the_step_thread_runs():
    """--switch-interval-ms reaches the engine process, not only the gateway's."""
    proc = EngineProcess(interval_engine, switch_interval_s=0.0025)
    try:
        assert proc.facts["switch_interval_s"] == pytest.approx(0.0025)
    finally:
        proc.stop()
    default = EngineProcess(interval_engine)
    try:
        assert default.facts["switch_interval_s"] == pytest.approx(0.005)  # Python's own, untouched
    finally:
        default.stop()


def test_the_engine_is_built_on_a_thread_of_its_own():
    """Not on the main thread, which reads the gateway's commands: an OpenMP
    team started there would outlive the build (test_kernel_threads)."""
    proc = EngineProcess(thread_engine)
    try:
        assert proc.facts["built_on_main"] is False
    finally:
        proc.stop()


def test_a_factory_that_fails_is_reported_at_start():
    with pytest.raises(EngineStartFailed, match=r"no such model: nowhere\.gguf"):
        EngineProcess(broken_factory)


_ORPHAN = """
import sys, time
from stallfree.gateway.engine.process import EngineProcess
from tests.engines import fast_engine
p = EngineProcess(fast_engine)
print(p.process.pid, flush=True)
time.sleep(600)
"""


def test_the_engine_process_dies_with_its_gateway():
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()  # a crash: no clean-up runs in the parent
    parent.wait()
    deadline = time.monotonic() + 20
    while _running(child):
        assert time.monotonic() < deadline, "the engine process outlived its gateway"
        time.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_leaves_no_process_behind(sig):
    server = StallfreeServer("--sim", "--sim-time-scale", "0.02")
    os.kill(server.proc.pid, sig)  # the gateway alone: it stops its engine
    assert server.proc.wait(60) == 0 or server.proc.returncode == -sig
    deadline = time.monotonic() + 20
    while not _group_gone(server.proc.pid):
        assert time.monotonic() < deadline, "a process of the server's outlived it"
        time.sleep(0.02)


@pytest.mark.slow
async def test_a_killed_engine_process_ends_every_stream_and_the_server():
    server = StallfreeServer("--sim", "--sim-time-scale", "0.02")
    try:
        children = subprocess.check_output(["pgrep", "-P", str(server.proc.pid)], text=True).split()
        engines = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(engines) == 1  # beside it, multiprocessing's resource tracker
        async with connect(server.ws_url) as ws:
            await send(ws, type="generate", id="g", prompt="hi", max_tokens=8000, ignore_eos=True)
            await ws.recv()  # accepted
            os.kill(int(engines[0]), signal.SIGKILL)
            frames = await asyncio.wait_for(collect(ws, ["g"]), 20)
        assert frames["g"][-1]["type"] == "error" and frames["g"][-1]["code"] == "internal"
        assert server.proc.wait(30) == 1
    finally:
        server.stop()
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url + "/healthz", timeout=2)
