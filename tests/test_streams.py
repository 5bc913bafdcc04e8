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

from core.sched.request import FinishReason
from gateway.streams import RequestStream
from gateway.telemetry import MAX_SERIES
from tests.server import sim_server
from tests.test_gateway_ws import collect, recv, send


async def test_overflow_coalesces_into_one_delta_in_order():
    s = RequestStream("r", capacity=2, slow_consumer_s=60)
    for i in range(6):
        assert s.put([i], emit_ns=i, finish_reason=None, request=None)
    assert s.put([6], emit_ns=6, finish_reason="length", request=None)
    got = [await s.get() for _ in range(3)]
    assert [d.token_ids for d in got] == [[0], [1], [2, 3, 4, 5, 6]]
    assert [d.first_index for d in got] == [0, 1, 2]
    assert got[-1].finish_reason == "length" and got[-1].emit_ns == 6


async def test_consumer_waiting_gets_tokens_as_they_come():
    s = RequestStream("r", capacity=4, slow_consumer_s=60)
    results = []

    async def consume():
        while True:
            d = await s.get()
            results.append(d.token_ids)
            if d.finish_reason:
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        for i in range(10):
            await anyio.sleep(0)
            s.put([i], i, "stop" if i == 9 else None, None)
    assert [t for r in results for t in r] == list(range(10))


async def test_hopelessly_behind_is_reported_then_failed():
    s = RequestStream("r", capacity=1, slow_consumer_s=0.05)
    assert s.put([0], 0, None, None)
    assert s.put([1], 1, None, None)  # starts the overflow clock
    assert s.put([2], 2, None, None)
    time.sleep(0.06)
    assert not s.put([3], 3, None, None)  # unread for longer than slow_consumer_s
    s.fail(FinishReason.SLOW_CONSUMER)
    assert (await s.get()).token_ids == [0]
    last = await s.get()
    assert last.finish_reason == FinishReason.SLOW_CONSUMER and last.token_ids == []
    assert s.put([4], 4, None, None)  # ignored once finished


async def test_fail_wakes_a_waiting_consumer():
    s = RequestStream("r", capacity=4, slow_consumer_s=60)
    async with anyio.create_task_group() as tg:
        got = []

        async def consume():
            got.append(await s.get())

        tg.start_soon(consume)
        await anyio.sleep(0.01)
        s.fail(FinishReason.ABORT)
    assert got[0].finish_reason == FinishReason.ABORT


def open_ends(s: RequestStream) -> tuple[int, int]:
    """(send, receive) ends of the stream's memory channel still open."""
    stats = s._recv.statistics()
    return stats.open_send_streams, stats.open_receive_streams


@pytest.mark.parametrize("overflow", [False, True])
@pytest.mark.parametrize("end", ["finish", "fail"])
async def test_the_final_delta_closes_the_send_end_and_taking_it_the_receive_end(overflow, end):
    s = RequestStream("r", capacity=2, slow_consumer_s=60)
    for i in range(5 if overflow else 1):
        s.put([i], i, None, None)
    if end == "finish":
        s.put([9], 9, FinishReason.LENGTH, None)
    else:
        s.fail(FinishReason.ABORT)
    assert open_ends(s) == (0, 1)
    got = []
    while (d := s.get_nowait()) is not None:  # after the send end closed: buffered, then the pending final
        got.append(d)
        if d.finish_reason is not None:
            break
    assert got[-1].finish_reason == (FinishReason.LENGTH if end == "finish" else FinishReason.ABORT)
    if end == "finish":
        assert [t for d in got for t in d.token_ids] == [*range(5 if overflow else 1), 9]
    assert open_ends(s) == (0, 0)


async def test_a_consumer_that_gives_up_closes_both_ends_and_later_output_is_ignored():
    s = RequestStream("r", capacity=2, slow_consumer_s=60)
    s.put([0], 0, None, None)
    s.close()
    assert open_ends(s) == (0, 0)
    assert s.put([1], 1, FinishReason.ABORT, None)  # the engine's abort arrives later: no error
    s.fail(FinishReason.ERROR)


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
            await asyncio.sleep(0.2)  # the abandoned streams' consumers finish on the server's loop
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
