"""WebSocket protocol against the real server (simulated runner unless noted)."""

from __future__ import annotations

import asyncio
import itertools
import socket
import time

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus
from websockets.protocol import Protocol, Side, State

from bench.servers import StallfreeServer
from stallfree.gateway.edge.ws_protocol import text_frame_header
from stallfree.gateway.settings import GatewaySettings
from tests.server import sim_server, tiny_server
from tests.wsclient import check_stream, collect, recv, send


def test_frames_written_together_parse_as_separate_text_frames():
    """The writer's own frame headers, at each length encoding's edges, as a client reads them."""
    sizes = [0, 1, 125, 126, 127, 65535, 65536, 70000]
    client = Protocol(Side.CLIENT, state=State.OPEN, max_size=None)
    client.receive_data(b"".join(text_frame_header(n) + bytes([65 + n % 26]) * n for n in sizes))
    frames = client.events_received()
    assert [(f.fin, len(f.data)) for f in frames] == [(True, n) for n in sizes]
    assert all(f.data == bytes([65 + len(f.data) % 26]) * len(f.data) for f in frames)


async def test_many_clients_multiplexed_ids(server):
    async def one_connection(c):
        async with connect(server.ws_url) as ws:
            for g in range(3):
                await send(
                    ws, type="generate", id=f"g{g}", prompt=f"client {c} gen {g}", max_tokens=10 + g, ignore_eos=True
                )
            frames = await collect(ws, [f"g{g}" for g in range(3)])
            for g in range(3):
                check_stream(frames[f"g{g}"], 10 + g)

    await asyncio.gather(*(one_connection(c) for c in range(12)))
    assert server.wait_kv_baseline() == 0


async def test_chat_messages_and_ping(server):
    async with connect(server.ws_url) as ws:
        await send(ws, type="ping")
        assert await recv(ws) == {"type": "pong"}
        await send(
            ws, type="generate", id="c1", messages=[{"role": "user", "content": "hello"}], max_tokens=5, ignore_eos=True
        )
        frames = (await collect(ws, ["c1"]))["c1"]
        assert frames[0]["prompt_tokens"] > 20  # the chat template's system prompt is included
        check_stream(frames, 5)


async def test_cancel_mid_stream_frees_kv(server):
    async with connect(server.ws_url) as ws:
        await send(ws, type="generate", id="long", prompt="x " * 300, max_tokens=5000, ignore_eos=True)
        assert (await recv(ws))["type"] == "accepted"
        assert (await recv(ws))["type"] == "token"
        assert server.kv_used() > 0
        await send(ws, type="cancel", id="long")
        frames = (await collect(ws, ["long"]))["long"]
        assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "cancelled"
        assert frames[-1]["usage"]["completion_tokens"] < 5000
    assert server.wait_kv_baseline() == 0


async def test_disconnect_mid_stream_frees_kv_and_spares_others(server):
    async with connect(server.ws_url) as other:
        await send(other, type="generate", id="o", prompt="other", max_tokens=60, ignore_eos=True)
        ws = await connect(server.ws_url)
        for i in range(4):
            await send(ws, type="generate", id=f"d{i}", prompt="y " * 200, max_tokens=7000, ignore_eos=True)
        seen = 0
        while seen < 8:
            if (await recv(ws))["type"] == "token":
                seen += 1
        await ws.close()
        check_stream((await collect(other, ["o"]))["o"], 60)
    assert server.wait_kv_baseline() == 0


@pytest.mark.slow
async def test_slow_reader_does_not_slow_the_others():
    """One client stops reading. The server keeps the others' streams going,
    coalesces the slow one's tokens once its socket is full, then cuts it off
    as a slow consumer and frees its KV. The others' gaps stay as before.
    The server runs in its own process so client and server share no GIL."""
    server = StallfreeServer(
        "--sim",
        "--sim-time-scale",
        "0.005",
        "--slow-consumer-s",
        "0.5",
        "--max-num-seqs",
        "128",
        "--kv-cache-gib",
        "8",  # room for every stream: no preemption muddying the gaps
        "--send-buffer-kib",
        "32",  # with the client's small receive buffer: backpressure within a second
    )
    try:

        async def gaps_of_others(n=4, tokens=120):
            async with connect(server.ws_url) as ws:
                for i in range(n):
                    await send(ws, type="generate", id=f"o{i}", prompt="fast", max_tokens=tokens, ignore_eos=True)
                stamps = {f"o{i}": [] for i in range(n)}
                frames = await collect_timed(ws, stamps)
                for i in range(n):
                    check_stream(frames[f"o{i}"], tokens)
                return [b - a for s in stamps.values() for a, b in itertools.pairwise(s)]

        baseline = await gaps_of_others()
        # a small receive buffer (no autotuning to 32 MB) and no reading at the
        # TCP level: real backpressure reaches the server
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        slow = await connect(server.ws_url, sock=sock, max_queue=1, ping_interval=None)
        slow.transport.pause_reading()
        n_slow = 32
        for i in range(n_slow):
            await send(slow, type="generate", id=f"s{i}", prompt="z " * 50, max_tokens=7000, ignore_eos=True)
        with_slow: list[float] = []
        deadline = time.monotonic() + 60
        while await asyncio.to_thread(server.kv_used):  # until the slow streams are cut off
            assert time.monotonic() < deadline, "slow consumer never cut off"
            with_slow += await gaps_of_others(tokens=40)
        p99 = sorted(with_slow)[int(len(with_slow) * 0.99)]
        assert p99 < sorted(baseline)[int(len(baseline) * 0.99)] * 3 + 0.02
        metrics = (await asyncio.to_thread(httpx.get, server.url + "/metrics")).text
        cutoffs = next(ln for ln in metrics.splitlines() if ln.startswith("stallfree_slow_consumer_cutoffs_total"))
        assert float(cutoffs.split()[-1]) == n_slow  # counted even though no error frame could be written yet
        assert max(with_slow) < 0.25  # streams blocked behind the slow one would stall for seconds
        slow.transport.resume_reading()
        errors = set()
        while len(errors) < n_slow:
            f = await recv(slow)
            assert f["type"] != "done"
            if f["type"] == "error":
                assert f["code"] == "slow_consumer"
                errors.add(f["id"])
        await slow.close()
    finally:
        server.stop()


async def collect_timed(ws, stamps):
    frames = {i: [] for i in stamps}
    open_ids = set(stamps)
    while open_ids:
        f = await recv(ws)
        frames[f["id"]].append(f)
        if f["type"] == "token":
            stamps[f["id"]].append(time.perf_counter())
        if f["type"] in ("done", "error"):
            open_ids.discard(f["id"])
    return frames


async def test_stop_string_ends_with_stop(server):
    async with connect(server.ws_url) as ws:
        await send(ws, type="generate", id="probe", prompt="stop test", max_tokens=12, ignore_eos=True)
        frames = (await collect(ws, ["probe"]))["probe"]
        text = "".join(f["text"] for f in frames if f["type"] == "token")
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        assert stop.strip()
        await send(ws, type="generate", id="s", prompt="stop test", max_tokens=12, ignore_eos=True, stop=[stop])
        frames = (await collect(ws, ["s"]))["s"]
        got = "".join(f["text"] for f in frames if f["type"] == "token")
        assert frames[-1]["finish_reason"] == "stop"
        assert got == text[: text.index(stop)]
    assert server.wait_kv_baseline() == 0


async def test_origin_allow_list(server):
    with pytest.raises(InvalidStatus):
        async with connect(server.ws_url, origin="https://evil.example"):
            pass
    async with connect(server.ws_url, origin="http://localhost:3000") as ws:
        await send(ws, type="ping")
        assert (await recv(ws))["type"] == "pong"


async def test_api_key_header_or_auth_frame():
    server = sim_server(settings=GatewaySettings(api_keys=("sekret",)))
    try:
        async with connect(server.ws_url, additional_headers={"Authorization": "Bearer sekret"}) as ws:
            await send(ws, type="ping")
            assert (await recv(ws))["type"] == "pong"
        async with connect(server.ws_url) as ws:
            await send(ws, type="auth", api_key="sekret")
            assert (await recv(ws))["type"] == "authenticated"
            await send(ws, type="generate", id="a", prompt="hi", max_tokens=3, ignore_eos=True)
            check_stream((await collect(ws, ["a"]))["a"], 3)
        async with connect(server.ws_url) as ws:
            await send(ws, type="generate", id="a", prompt="hi")
            f = await recv(ws)
            assert f["type"] == "error" and f["code"] == "unauthorized"
        async with connect(server.ws_url) as ws:
            await send(ws, type="auth", api_key="wrong")
            assert (await recv(ws))["code"] == "unauthorized"
    finally:
        server.stop()


async def test_tiny_model_streams_over_websocket():
    server = tiny_server()
    try:
        async with connect(server.ws_url) as ws:
            for i in range(3):
                await send(
                    ws,
                    type="generate",
                    id=f"t{i}",
                    messages=[{"role": "user", "content": f"hi {i}"}],
                    max_tokens=6,
                    ignore_eos=True,
                )
            frames = await collect(ws, ["t0", "t1", "t2"])
            for i in range(3):
                check_stream(frames[f"t{i}"], 6)
        assert server.wait_kv_baseline() == 0
    finally:
        server.stop()


async def test_short_prompts_get_their_first_token_before_a_long_prefill_ends():
    """The tiny model at budget 32: an 800-token prompt takes ~25 iterations to
    prefill; short prompts sent right after it start within a couple."""
    server = tiny_server(token_budget=32)
    try:
        async with connect(server.ws_url) as ws:
            await send(ws, type="generate", id="long", prompt="hello " * 800, max_tokens=4)
            assert (await recv(ws))["type"] == "accepted"
            for i in range(3):
                await send(ws, type="generate", id=f"s{i}", prompt=f"short question {i}", max_tokens=4)
            first_token = []
            while len(first_token) < 4:
                f = await recv(ws)
                if f["type"] == "token" and f["id"] not in first_token:
                    first_token.append(f["id"])
        assert first_token[-1] == "long", first_token
    finally:
        server.stop()


async def test_timestamps_say_when_tokens_were_produced_and_sent(server):
    async with connect(server.ws_url) as ws:
        await send(ws, type="generate", id="t", prompt="hello", max_tokens=6, ignore_eos=True, timestamps=True)
        frames = (await collect(ws, ["t"]))["t"]
        received = time.perf_counter_ns()
    tokens = [f for f in frames if f["type"] == "token"]
    assert len(tokens) == 6
    assert all(0 < f["emit_ns"] <= f["sent_ns"] <= received for f in tokens)  # one monotonic clock
    assert [f["emit_ns"] for f in tokens] == sorted(f["emit_ns"] for f in tokens)
