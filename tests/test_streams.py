"""Per-request streams: bounded queue, coalescing overflow, slow-consumer cut-off,
and both ends of every stream closed however its request ends."""

import asyncio
import gc
import time
import warnings

import anyio
import httpx
import pytest
from websockets.asyncio.client import connect

from stallfree.core.sched.request import FinishReason
from stallfree.gateway.engine.streams import Delta, RequestStream
from stallfree.gateway.observe.telemetry import MAX_SERIES
from tests.server import sim_server
from tests.wsclient import collect, recv, send


def drain(s: RequestStream) -> list[Delta]:
    got = []
    while (d := s.get_nowait()) is not None:
        got.append(d)
    return got


def test_overflow_coalesces_into_one_delta_in_order():
    s = RequestStream("r", capacity=2, slow_consumer_s=60)
    for i in range(6):
        assert s.put([i], emit_ns=i, finish_reason=None, end=None)
    assert s.put([6], emit_ns=6, finish_reason="length", end=None)
    got = drain(s)
    assert [d.token_ids for d in got] == [[0], [1], [2, 3, 4, 5, 6]]
    assert [d.first_index for d in got] == [0, 1, 2]
    assert got[-1].finish_reason == "length" and got[-1].emit_ns == 6


async def test_a_consumer_woken_by_on_put_gets_tokens_as_they_come():
    s = RequestStream("r", capacity=4, slow_consumer_s=60)
    results = []
    wake = anyio.Event()

    def on_put() -> None:
        wake.set()

    s.on_put = on_put

    async def consume():
        nonlocal wake
        while True:
            await wake.wait()
            wake = anyio.Event()
            for d in drain(s):
                results.append(d.token_ids)
                if d.finish_reason:
                    return

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        for i in range(10):
            await anyio.sleep(0)
            s.put([i], i, "stop" if i == 9 else None, None)
    assert [t for r in results for t in r] == list(range(10))


def test_hopelessly_behind_is_reported_then_failed():
    s = RequestStream("r", capacity=1, slow_consumer_s=0.05)
    assert s.put([0], 0, None, None)
    assert s.put([1], 1, None, None)  # starts the overflow clock
    assert s.put([2], 2, None, None)
    time.sleep(0.06)
    assert not s.put([3], 3, None, None)  # unread for longer than slow_consumer_s
    s.fail(FinishReason.SLOW_CONSUMER)
    first, last = drain(s)
    assert first.token_ids == [0]
    assert last.finish_reason == FinishReason.SLOW_CONSUMER and last.token_ids == []
    assert s.put([4], 4, None, None)  # ignored once finished
    assert s.get_nowait() is None


def test_a_consumer_that_catches_up_restarts_the_overflow_clock():
    s = RequestStream("r", capacity=1, slow_consumer_s=0.05)
    s.put([0], 0, None, None)
    s.put([1], 1, None, None)  # overflow: the clock starts
    time.sleep(0.06)
    assert len(drain(s)) == 2  # caught up
    s.put([2], 2, None, None)
    s.put([3], 3, None, None)  # a new overflow, a new clock
    assert s.put([4], 4, None, None)


def test_fail_wakes_the_consumer():
    s = RequestStream("r", capacity=4, slow_consumer_s=60)
    woken = []
    s.on_put = lambda: woken.append(1)
    s.fail(FinishReason.ABORT)
    assert woken and drain(s)[0].finish_reason == FinishReason.ABORT


@pytest.mark.parametrize("overflow", [False, True])
@pytest.mark.parametrize("end", ["finish", "fail"])
def test_the_final_delta_is_the_last_the_consumer_gets(overflow, end):
    s = RequestStream("r", capacity=2, slow_consumer_s=60)
    for i in range(5 if overflow else 1):
        s.put([i], i, None, None)
    if end == "finish":
        s.put([9], 9, FinishReason.LENGTH, None)
    else:
        s.fail(FinishReason.ABORT)
    got = drain(s)
    assert got[-1].finish_reason == (FinishReason.LENGTH if end == "finish" else FinishReason.ABORT)
    assert all(d.finish_reason is None for d in got[:-1])
    if end == "finish":
        assert [t for d in got for t in d.token_ids] == [*range(5 if overflow else 1), 9]
    s.put([10], 10, None, None)
    assert s.get_nowait() is None


def test_a_consumer_that_gives_up_has_later_output_ignored():
    s = RequestStream("r", capacity=2, slow_consumer_s=60)
    s.put([0], 0, None, None)
    s.close()
    assert s.put([1], 1, FinishReason.ABORT, None)  # the engine's abort arrives later: no error
    s.fail(FinishReason.ERROR)
    assert s.get_nowait() is None


def unclosed(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, ResourceWarning) and "Unclosed" in str(w.message)]


async def test_no_stream_is_left_unclosed_however_requests_end():
    """Finished, cancelled and abandoned requests over both APIs, and a dashboard socket."""
    server = sim_server()
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always", ResourceWarning)
            async with connect(server.ws_url) as ws:
                await send(ws, type="generate", id="done", prompt="hi", max_tokens=4, ignore_eos=True)
                await send(ws, type="generate", id="cancelled", prompt="hi", max_tokens=500, ignore_eos=True)
                await send(ws, type="cancel", id="cancelled")
                assert {f[-1]["type"] for f in (await collect(ws, ["done", "cancelled"])).values()} == {"done"}
                await send(ws, type="generate", id="left", prompt="hi", max_tokens=500, ignore_eos=True)
                while (await recv(ws))["type"] != "token":
                    pass
            async with connect(server.ws_url.replace("/v1/stream", "/ws/telemetry")) as ws:
                assert (await recv(ws))["type"] == "telemetry"
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                body = {"prompt": "hi", "max_tokens": 3}
                assert (await http.post("/v1/completions", json=body)).status_code == 200
                r = await http.post("/v1/completions", json={**body, "stream": True})
                assert r.text.endswith("data: [DONE]\n\n")
                body = {"prompt": "hi", "max_tokens": 500, "ignore_eos": True, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            break  # the client goes away mid-stream
            deadline = time.monotonic() + 10
            while server.client.num_in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert server.client.num_in_flight == 0
            state = server.server.server_state
            deadline = time.monotonic() + 10
            while state.connections or state.tasks:  # the server is done with every connection and its app task
                assert time.monotonic() < deadline, (len(state.connections), len(state.tasks))
                await asyncio.sleep(0.02)
            gc.collect()
        assert unclosed(record) == []
    finally:
        server.stop()


async def test_finished_streams_give_back_their_dashboard_series():
    """The dashboard draws MAX_SERIES streams gap by gap; each finished request frees its series
    (a last token observed after its request's finish once took a series nobody freed, and after
    MAX_SERIES requests the dashboard drew no gap at all)."""
    server = sim_server()
    try:
        async with connect(server.ws_url) as ws:
            for i in range(MAX_SERIES + 2):
                await send(ws, type="generate", id=f"r{i}", prompt="hi", max_tokens=4, ignore_eos=True)
                await collect(ws, [f"r{i}"])
            async with connect(server.ws_url.replace("/v1/stream", "/ws/telemetry")) as dash:
                await recv(dash)  # whatever was pending before
                await send(ws, type="generate", id="last", prompt="hi", max_tokens=12, ignore_eos=True)
                await collect(ws, ["last"])
                gaps: list = []
                for _ in range(50):  # frames come at most ten a second
                    gaps += (await recv(dash))["gaps"]
                    if len(gaps) == 11:  # a gap before each token but the first
                        break
        assert len(gaps) == 11 and len({slot for slot, *_ in gaps}) == 1
    finally:
        server.stop()
