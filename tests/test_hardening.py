"""Hostile and sloppy input against the real gateway (simulated engine): strict
types and ranges for every field, admission under a burst, cross-origin
refusals, and the protocol edges (timeouts, oversized frames, methods,
current gauges)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import httpx
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from stallfree.core.sched.config import RANGES
from stallfree.gateway.settings import GatewaySettings
from tests.server import sim_server
from tests.wsclient import collect, recv, send

VOCAB = 49152  # the simulated runner's: the embedded tokenizer's


# field -> bad values; each must be refused with a message naming the field
BAD_FIELDS = {
    "max_tokens": [0, -1, 1.5, "5", True, 10**9],
    "temperature": [-1, "hot", True, 1000],
    "top_p": [0, 1.5, "x", False],
    "top_k": [-1, 1.5, "x", VOCAB + 1, 100000],
    "seed": ["x", 1.5, 2**64, True],
    "stop": [5, [1], ["x"] * 17, ["x" * 300]],
    "ignore_eos": ["yes", 1, "true"],
    "priority": ["x", 1.5, 2**40],
    "traceparent": [5, ["x"]],
}
HTTP_ONLY = {
    "stream": ["yes", 1],
    "stream_options": ["x", {"include_usage": "yes"}, {"bogus": True}],
    "model": [5, ["m"]],
    "user": [5],
}
WS_ONLY = {"timestamps": ["yes", 1]}

HTTP_CASES = [(f, v) for f, vs in (BAD_FIELDS | HTTP_ONLY).items() for v in vs]
WS_CASES = [(f, v) for f, vs in (BAD_FIELDS | WS_ONLY).items() for v in vs]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("field", "value"), HTTP_CASES)
def test_every_http_field_is_typed_and_bounded(server, endpoint, field, value):
    body = {"prompt": "hi"} if endpoint == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(server.url + endpoint, json={**body, field: value}, timeout=30)
    assert r.status_code == 400, (field, value, r.text)
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and field in err["message"], err


async def test_every_websocket_field_is_typed_and_bounded(server):
    async with connect(server.ws_url) as ws:
        for n, (field, value) in enumerate(WS_CASES):
            frame = {"type": "generate", "id": f"g{n}", "prompt": "hi", field: value}
            await ws.send(json.dumps(frame))  # the stdlib writes integers past 64 bits too
            reply = await recv(ws)
            assert reply["type"] == "error" and reply["code"] == "invalid_request", (field, value, reply)
            assert field in reply["message"], reply


def test_null_means_the_documented_default(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16  # the completions default
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "temperature": None, "max_tokens": 2})
    assert r.status_code == 200


# setting -> bad values for PUT /api/config
BAD_SETTINGS = {
    "token_budget": [0, 1e15, 1.5, "512", True, 2**21],
    "max_partial_prefills": [0, -1, "2", None],
    "chunking": ["maybe", 1, None],
    "policy": ["random", None],
    "dynamic_chunking": ["yes", 1, None],
    "max_defer_s": [1e300, 0, -1, "30", True, None],
}


@pytest.mark.slow
def test_every_live_setting_is_typed_and_bounded_and_a_refusal_changes_nothing(server):
    assert set(BAD_SETTINGS) == set(RANGES) & set(BAD_SETTINGS)
    before = httpx.get(server.url + "/api/config").json()["scheduler"]
    for field, values in BAD_SETTINGS.items():
        for value in values:
            r = httpx.put(server.url + "/api/config", json={"token_budget": 700, field: value})
            assert r.status_code == 400, (field, value)
            assert field in r.json()["error"]["message"]
    assert httpx.get(server.url + "/api/config").json()["scheduler"] == before
    # the value that used to kill the step thread is refused, and the engine still serves
    assert httpx.put(server.url + "/api/config", json={"max_defer_s": 1e300}).status_code == 400
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200


async def test_a_request_with_a_huge_top_k_is_refused_and_spares_its_batch(server):
    async with connect(server.ws_url) as ws:
        await send(ws, type="generate", id="ok", prompt="hi", max_tokens=20, ignore_eos=True)
        await send(ws, type="generate", id="big", prompt="hi", max_tokens=20, top_k=100000, temperature=1)
        frames = await collect(ws, ["ok", "big"])
    assert frames["big"][-1]["type"] == "error" and "top_k" in frames["big"][-1]["message"]
    assert frames["ok"][-1]["type"] == "done" and frames["ok"][-1]["usage"]["completion_tokens"] == 20


async def test_the_waiting_limit_holds_under_a_burst():
    """150 requests at once over HTTP with room for 8: exactly 142 are refused
    while the engine is held, and the 8 are served once it runs."""
    srv = sim_server(settings=GatewaySettings(max_waiting=8), token_budget=80, max_num_seqs=64)
    try:
        body = {"prompt": "z", "max_tokens": 1}
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=httpx.Limits(max_connections=200)) as h:
            with srv.held():
                pending = {asyncio.create_task(h.post("/v1/completions", json=body)) for _ in range(150)}
                refused = []
                while len(refused) < 142:
                    done, pending = await asyncio.wait(pending, timeout=20, return_when=asyncio.FIRST_COMPLETED)
                    assert done, f"{len(refused)} answered; the others are all waiting"
                    refused += [t.result() for t in done]
            admitted = await asyncio.gather(*pending)
        assert [r.status_code for r in refused] == [429] * 142
        assert [r.status_code for r in admitted] == [200] * 8
    finally:
        srv.stop()


# -- cross-origin ---------------------------------------------------------------
async def test_websocket_origin_is_never_taken_from_the_host_header(server):
    rebinding = {"Host": "evil.example:8000"}
    with pytest.raises(InvalidStatus):
        async with connect(server.ws_url, origin="http://evil.example:8000", additional_headers=rebinding):
            pass
    async with connect(server.ws_url, origin="http://127.0.0.1:8000") as ws:
        await send(ws, type="ping")
        assert (await recv(ws))["type"] == "pong"


def test_browser_requests_from_other_origins_cannot_change_anything(server):
    evil = {"Origin": "https://evil.example", "Content-Type": "text/plain"}
    body = orjson.dumps({"prompt": "hi", "max_tokens": 2})
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("PUT", "/api/config")):
        r = httpx.request(method, server.url + path, content=body, headers=evil)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", (method, path)
    cross_site = {"Sec-Fetch-Site": "cross-site"}
    assert httpx.post(server.url + "/v1/completions", content=body, headers=cross_site).status_code == 403
    same = {"Origin": f"http://localhost:{server.port}"}
    assert httpx.post(server.url + "/v1/completions", content=body, headers=same).status_code == 200
    assert httpx.post(server.url + "/v1/completions", content=body).status_code == 200  # no Origin: not a browser


@pytest.mark.slow
def test_configured_origins_and_host_names_are_allowed():
    settings = GatewaySettings(allowed_origins=("https://app.example",))
    srv = sim_server(settings=settings)
    try:
        ok = httpx.post(
            srv.url + "/v1/completions",
            json={"prompt": "hi", "max_tokens": 1},
            headers={"Origin": "https://app.example"},
        )
        assert ok.status_code == 200
        local = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, headers={"Origin": "http://localhost"})
        assert local.status_code == 403  # an allow-list replaces the defaults
    finally:
        srv.stop()
    srv = sim_server(settings=GatewaySettings(host_names=("gpu-box",)))
    try:
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"prompt": "hi", "max_tokens": 1},
            headers={"Origin": "http://gpu-box:8000"},
        )
        assert r.status_code == 200
    finally:
        srv.stop()


# -- protocol edges ---------------------------------------------------------------
async def test_every_socket_must_authenticate_in_time():
    """Both sockets go through one check: same timeout, same error frame, same close."""
    srv = sim_server(settings=GatewaySettings(api_keys=("k",), auth_timeout_s=0.3))
    try:
        errors = []
        for path in ("/v1/stream", "/ws/telemetry"):
            async with connect(f"ws://127.0.0.1:{srv.port}{path}") as ws:
                start = time.monotonic()
                f = await recv(ws, timeout=5)
                waited = time.monotonic() - start
                with pytest.raises(ConnectionClosed) as closed:
                    await recv(ws, timeout=5)
            assert closed.value.rcvd.code == 1008
            assert 0.25 < waited < 3, path
            errors.append(f)
        assert errors[0] == errors[1]
        assert errors[0]["type"] == "error" and errors[0]["code"] == "unauthorized" and "within" in errors[0]["message"]
    finally:
        srv.stop()


async def test_a_wrong_first_frame_is_refused_alike_on_both_sockets():
    srv = sim_server(settings=GatewaySettings(api_keys=("k",), auth_timeout_s=5))
    try:
        for path in ("/v1/stream", "/ws/telemetry"):
            for first in ('{"type":"auth","api_key":"nope"}', '{"type":"ping"}', "not json"):
                async with connect(f"ws://127.0.0.1:{srv.port}{path}") as ws:
                    await ws.send(first)
                    f = await recv(ws, timeout=5)
                    assert f["code"] == "unauthorized" and f["message"].startswith("send {'type': 'auth'"), (path, f)
                    with pytest.raises(ConnectionClosed):
                        await recv(ws, timeout=5)
            async with connect(f"ws://127.0.0.1:{srv.port}{path}") as ws:
                await send(ws, type="auth", api_key="k")
                assert (await recv(ws, timeout=5))["type"] == "authenticated"
    finally:
        srv.stop()


async def test_an_oversized_frame_gets_an_error_frame_before_the_close():
    srv = sim_server(settings=GatewaySettings(max_frame_bytes=1000))
    try:
        async with connect(srv.ws_url) as ws:
            await ws.send("x" * 2000)  # over our limit, under the protocol's: error, socket stays
            f = await recv(ws)
            assert f["type"] == "error" and "larger than 1000" in f["message"]
            await send(ws, type="ping")
            assert (await recv(ws))["type"] == "pong"
            await ws.send(orjson.dumps({"type": "ping", "pad": "\u20ac" * 400}).decode())  # 424 characters, 1224 bytes
            f = await recv(ws)
            assert f["type"] == "error" and "larger than 1000" in f["message"]
            await send(ws, type="generate", id="running", prompt="hi", max_tokens=4000, ignore_eos=True)
            while (await recv(ws))["type"] != "token":
                pass
            await ws.send("y" * 5000)  # over the protocol's cap (4x): an error per generation and the frame's, 1009
            ends = {}
            while len(ends) < 2:
                f = await recv(ws)
                if f["type"] == "error":
                    ends[f["id"]] = f
            assert all(f["code"] == "invalid_request" and "too large" in f["message"] for f in ends.values())
            assert set(ends) == {"running", None}
            with pytest.raises(ConnectionClosed) as closed:
                await recv(ws)
            assert closed.value.rcvd.code == 1009
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_trickled_body_times_out():
    srv = sim_server(settings=GatewaySettings(body_timeout_s=0.5))
    try:
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"prompt":'
            )
            sock.settimeout(10)
            start = time.monotonic()
            reply = b""
            while b'"timeout"' not in reply and (chunk := sock.recv(4096)):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b'"timeout"' in reply
        assert time.monotonic() - start < 5
    finally:
        srv.stop()


def test_methods_answer_as_http_says(server):
    before = httpx.get(server.url + "/api/config").json()
    head = httpx.head(server.url + "/api/config")
    assert head.status_code == 200 and head.content == b""
    assert httpx.get(server.url + "/api/config").json() == before  # HEAD changed nothing
    for method, path, allow in (
        ("GET", "/v1/completions", "POST"),
        ("GET", "/v1/chat/completions", "POST"),
        ("POST", "/healthz", "GET, HEAD"),
        ("DELETE", "/api/config", "GET, HEAD, PUT"),
    ):
        r = httpx.request(method, server.url + path)
        assert r.status_code == 405, (method, path)
        assert set(r.headers["allow"].split(", ")) == set(allow.split(", "))
    assert httpx.get(server.url + "/no/such/page").status_code == 404
    assert httpx.get(server.url + "/").status_code == 200  # the dashboard


def _gauge(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.slow
async def test_gauges_are_current_after_a_disconnect_without_another_iteration():
    srv = sim_server(time_scale=0.05)
    try:
        async with connect(srv.ws_url) as ws:
            for i in range(4):
                await send(ws, type="generate", id=f"g{i}", prompt="p " * 50, max_tokens=5000, ignore_eos=True)
            seen = set()
            while len(seen) < 4:
                f = await recv(ws)
                if f["type"] == "token":
                    seen.add(f["id"])
            metrics = httpx.get(srv.url + "/metrics").text
            assert _gauge(metrics, "stallfree_requests_running") == 4
        deadline = time.monotonic() + 10  # the disconnect reaches the engine within an iteration or two
        while _gauge(metrics := httpx.get(srv.url + "/metrics").text, "stallfree_requests_running"):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert _gauge(metrics, 'stallfree_kv_blocks{state="used"}') == 0
    finally:
        srv.stop()


@pytest.mark.slow
async def test_openai_streams_cut_by_a_drain_finish_as_cancelled_not_stop():
    srv = sim_server(time_scale=0.05, settings=GatewaySettings(drain_timeout_s=0.3))
    body = {"prompt": "b", "max_tokens": 5000, "ignore_eos": True, "stream": True}
    reasons = []
    async with (
        httpx.AsyncClient(base_url=srv.url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as r,
    ):
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if not reasons:
                srv.server.handle_exit(signal.SIGTERM, None)  # what uvicorn calls on SIGTERM
                reasons.append(None)
            reasons += [c["finish_reason"] for c in orjson.loads(line[6:])["choices"] if c["finish_reason"]]
    assert reasons[-1] == "cancelled"
    srv.thread.join(20)


async def test_one_key_cannot_fill_the_whole_waiting_room():
    """A key that floods gets at most max_waiting_per_key of the room; another
    key is still admitted (before, the flood took all 256 places and every
    other key got 429). The engine is held until the other key's request is
    queued beside the flood's four."""
    settings = GatewaySettings(max_waiting=8, max_waiting_per_key=4, api_keys=("flood", "other"))
    srv = sim_server(settings=settings, token_budget=80, max_num_seqs=64)
    try:
        body = {"prompt": "z", "max_tokens": 1}
        limits = httpx.Limits(max_connections=64)
        async with (
            httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits, headers={"X-API-Key": "flood"}) as flood,
            httpx.AsyncClient(base_url=srv.url, timeout=120, headers={"X-API-Key": "other"}) as other,
        ):
            with srv.held():
                pending = {asyncio.create_task(flood.post("/v1/completions", json=body)) for _ in range(20)}
                refused = []
                while len(refused) < 16:  # the refusals come back at once; the 4 admitted wait on the held engine
                    done, pending = await asyncio.wait(pending, timeout=20, return_when=asyncio.FIRST_COMPLETED)
                    assert done, f"{len(refused)} refused; the others are all waiting"
                    refused += [t.result() for t in done]
                reply = asyncio.create_task(other.post("/v1/completions", json=body))
                deadline = time.monotonic() + 20
                while srv.unstarted() < 5 and not reply.done():  # the flood's four and the other key's one
                    assert time.monotonic() < deadline, "the other key's request never reached the engine"
                    await asyncio.sleep(0.005)  # polling a condition: the gateway runs on its own thread
                assert not reply.done()  # not refused: queued beside the flood's four
            admitted = await asyncio.gather(*pending)
            answered = await reply  # before its client closes, which would cut it off unread
        assert all(r.status_code == 429 and "this API key" in r.json()["error"]["message"] for r in refused)
        assert [r.status_code for r in admitted] == [200] * 4
        assert answered.status_code == 200
    finally:
        srv.stop()
