"""OpenAI-compatible API, operations endpoints, limits, auth, shutdown."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import orjson
import pytest
from openai import APITimeoutError, AsyncOpenAI, BadRequestError, OpenAI
from websockets.asyncio.client import connect

from stallfree.gateway.settings import GatewaySettings
from tests.server import sim_server


def openai_client(server, key="unused"):
    return OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


@pytest.mark.parametrize("which", ["server", "tiny"])
def test_official_client_chat_and_completions(which, request):
    srv = request.getfixturevalue(which)
    client = openai_client(srv)
    assert client.models.list().data[0].id
    chat = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.object == "chat.completion" and chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 7 and chat.usage.prompt_tokens > 10
    assert isinstance(chat.choices[0].message.content, str)
    comp = client.completions.create(model="m", prompt="Once upon", max_tokens=5, extra_body={"ignore_eos": True})
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 5
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Count"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    comp_stream = list(
        client.completions.create(model="m", prompt="A", max_tokens=4, stream=True, extra_body={"ignore_eos": True})
    )
    assert comp_stream[-1].choices[0].finish_reason == "length"
    assert text == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert srv.wait_kv_baseline() == 0


def test_greedy_is_deterministic_over_http(tiny):
    client = openai_client(tiny)
    a = client.completions.create(model="m", prompt="Hello", max_tokens=8, temperature=0)
    b = client.completions.create(model="m", prompt="Hello", max_tokens=8, temperature=0)
    assert a.choices[0].text == b.choices[0].text


async def test_streaming_disconnect_aborts_and_frees_kv(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        body = {"model": "m", "prompt": "x " * 200, "max_tokens": 7000, "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.aiter_lines()
            while not (await anext(lines)).startswith("data: {"):
                pass
            assert server.kv_used() > 0
    assert await asyncio.to_thread(server.wait_kv_baseline) == 0


async def test_non_streaming_disconnect_aborts(server):
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=0.5)
    with pytest.raises(APITimeoutError):  # the client gives up and hangs up
        await client.completions.create(model="m", prompt="y " * 100, max_tokens=7000, extra_body={"ignore_eos": True})
    assert await asyncio.to_thread(server.wait_kv_baseline) == 0


BAD_HTTP = [
    (b"not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (orjson.dumps({"model": "m", "prompt": "x", "max_tokens": -1}), "max_tokens"),
    (orjson.dumps({"model": "m", "prompt": "x", "temperature": "hot"}), "temperature"),
    (orjson.dumps({"model": "m", "prompt": "x", "top_p": 0}), "top_p"),
    (orjson.dumps({"model": "m", "prompt": 5}), "prompt must be a string"),
    (orjson.dumps({"model": "m"}), "exactly one of"),
    (orjson.dumps({"model": "m", "prompt": "x", "n": 17}), "n must be an integer in [1, 16]"),
    (orjson.dumps({"model": "m", "prompt": "x", "logprobs": 21}), "logprobs must be an integer in [0, 20]"),
    (orjson.dumps({"model": "m", "prompt": "x", "stop": [1]}), "stop"),
    (orjson.dumps({"model": "m", "prompt": "x " * 9000}), "context limit"),
    (b'{"prompt": "' + b"a" * (2 << 20) + b'"}', "larger than"),
]


@pytest.mark.parametrize(("body", "message"), BAD_HTTP)
def test_bad_http_inputs(server, body, message):
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert message in err["message"] and err["type"] == "invalid_request_error"


def test_nan_and_bad_chat_messages(server):
    nan = b'{"model": "m", "prompt": "x", "temperature": NaN}'
    assert httpx.post(server.url + "/v1/completions", content=nan).status_code == 400
    for messages in ([], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 3}], "hi"):
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": "m", "messages": messages})
        assert r.status_code == 400, messages
    with pytest.raises(BadRequestError, match=r"prompt_too_long|context limit"):
        openai_client(server).chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 9000}])


BAD_WS = [
    ("not json", "invalid_request"),
    ('"just a string"', "invalid_request"),
    ('{"type": "dance"}', "invalid_request"),
    ('{"type": "generate", "prompt": "x"}', "invalid_request"),  # no id
    ('{"type": "generate", "id": 5, "prompt": "x"}', "invalid_request"),
    ('{"type": "generate", "id": "a"}', "invalid_request"),  # neither prompt nor messages
    ('{"type": "generate", "id": "a", "prompt": "x", "max_tokens": "many"}', "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "temperature": -1}', "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "seed": 1.5}', "invalid_request"),
    ('{"type": "generate", "id": "a", "messages": [{"role": "user"}]}', "invalid_request"),
    ('{"type": "cancel", "id": "nope"}', "invalid_request"),
    ('{"type": "generate", "id": "a", "prompt": "' + "w " * 9000 + '"}', "prompt_too_long"),
    ('{"type": "generate", "id": "a", "prompt": "' + "a" * (2 << 20) + '"}', "invalid_request"),
]


async def test_bad_ws_frames_get_errors_and_the_connection_keeps_serving(server):
    async with connect(server.ws_url, max_size=None) as ws, connect(server.ws_url) as bystander:
        await bystander.send(
            orjson.dumps({"type": "generate", "id": "b", "prompt": "hi", "max_tokens": 30, "ignore_eos": True}).decode()
        )
        for frame, code in BAD_WS:
            await ws.send(frame)
            reply = orjson.loads(await asyncio.wait_for(ws.recv(), 20))
            assert reply["type"] == "error" and reply["code"] == code, (frame[:60], reply)
        await ws.send(b"\x00\x01binary")
        reply = orjson.loads(await asyncio.wait_for(ws.recv(), 20))
        assert reply["code"] == "invalid_request" and "binary" in reply["message"]
        # duplicate id while the first is still running
        gen = {"type": "generate", "id": "dup", "prompt": "x", "max_tokens": 2000, "ignore_eos": True}
        await ws.send(orjson.dumps(gen).decode())
        await ws.send(orjson.dumps(gen).decode())
        frames = []
        while not any(f.get("code") == "invalid_request" for f in frames):
            frames.append(orjson.loads(await asyncio.wait_for(ws.recv(), 20)))
        await ws.send(orjson.dumps({"type": "cancel", "id": "dup"}).decode())
        # the same connection still works
        await ws.send(orjson.dumps({"type": "ping"}).decode())
        while (f := orjson.loads(await asyncio.wait_for(ws.recv(), 20)))["type"] != "pong":
            pass
        # and the bystander was served in full
        done = None
        while done is None:
            f = orjson.loads(await asyncio.wait_for(bystander.recv(), 20))
            done = f if f["type"] == "done" else None
        assert done["usage"]["completion_tokens"] == 30
    assert await asyncio.to_thread(server.wait_kv_baseline) == 0


@pytest.mark.slow
async def test_overloaded_when_too_many_waiting():
    # every iteration takes ~2.5 s: the first two requests wait for their first token
    srv = sim_server(time_scale=50.0, settings=GatewaySettings(max_waiting=2), token_budget=80, max_num_seqs=64)
    try:
        body = {"model": "m", "prompt": "z", "max_tokens": 1}
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            first = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(2)]
            while len(srv.client.admission.unstarted) < 2:
                await asyncio.sleep(0.01)
            third = await http.post("/v1/completions", json=body)
            assert third.status_code == 429
            assert third.json()["error"]["code"] == "overloaded"
            assert [r.status_code for r in await asyncio.gather(*first)] == [200, 200]
    finally:
        srv.stop()


def test_health_ready_and_live_config(server):
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(server.url + "/readyz").status_code == 200
    view = httpx.get(server.url + "/api/config").json()
    assert view["scheduler"]["chunking"] == "stall_free" and "token_budget" in view["live_settings"]
    r = httpx.put(server.url + "/api/config", json={"chunking": "none", "token_budget": 1024})
    assert r.status_code == 200 and r.json()["scheduler"]["chunking"] == "none"
    assert httpx.put(server.url + "/api/config", json={"chunking": "maybe"}).status_code == 400
    assert httpx.put(server.url + "/api/config", json={"max_num_seqs": 3}).status_code == 400
    assert httpx.put(server.url + "/api/config", content=b"{").status_code == 400
    r = httpx.put(server.url + "/api/config", json={"chunking": "stall_free", "token_budget": 512})
    assert r.json()["scheduler"]["token_budget"] == 512


def test_tbt_target_is_a_live_setting_with_its_prediction_in_metrics(server):
    assert "tbt_slo_ms" in httpx.get(server.url + "/api/config").json()["live_settings"]
    r = httpx.put(server.url + "/api/config", json={"tbt_slo_ms": 80})
    assert r.status_code == 200 and r.json()["scheduler"]["tbt_slo_ms"] == 80
    assert httpx.get(server.url + "/api/config").json()["scheduler"]["tbt_slo_ms"] == 80
    for bad in (-1, "fast", True, 1e9, None):
        r = httpx.put(server.url + "/api/config", json={"tbt_slo_ms": bad})
        assert r.status_code == 400, bad
        assert r.json()["error"]["code"] == "invalid_request" and "tbt_slo_ms" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/api/config").json()["scheduler"]["tbt_slo_ms"] == 80  # refused: unchanged
    out = openai_client(server).completions.create(model="m", prompt="hello " * 30, max_tokens=8)
    assert out.usage.completion_tokens == 8
    metrics = httpx.get(server.url + "/metrics").text
    assert "stallfree_tbt_slo_seconds 0.08" in metrics
    count = next(
        line for line in metrics.splitlines() if line.startswith("stallfree_iteration_prediction_error_ratio_count")
    )
    assert float(count.split()[-1]) >= 8  # one per iteration: predicted beside measured
    httpx.put(server.url + "/api/config", json={"tbt_slo_ms": 0})


def test_api_keys_on_http():
    srv = sim_server(settings=GatewaySettings(api_keys=("k1", "k2"), admin_keys=("op",)))
    try:
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        r = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer op"}).status_code == 200
        assert httpx.put(srv.url + "/api/config", json={"token_budget": 600}).status_code == 401
        ok = httpx.put(srv.url + "/api/config", json={"token_budget": 600}, headers={"Authorization": "Bearer op"})
        assert ok.status_code == 200
        assert httpx.get(srv.url + "/api/config").status_code == 200  # reading is open
        assert httpx.get(srv.url + "/healthz").status_code == 200
        out = openai_client(srv, key="k1").completions.create(model="m", prompt="x", max_tokens=2)
        assert out.usage.completion_tokens >= 1
    finally:
        srv.stop()


@pytest.mark.parametrize("share", [False, True])
def test_prefix_cache_is_per_api_key_unless_shared(share):
    """Key 2 must not learn from cached_tokens (or TTFT) that key 1 sent a prompt."""
    srv = sim_server(settings=GatewaySettings(api_keys=("k1", "k2"), share_prefix_cache=share))
    try:
        body = {"prompt": "The password of the vault is 7d2f-91ac, keep it. " * 12, "max_tokens": 2}

        def cached(key: str) -> tuple[int, int]:
            r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]

        assert cached("k1")[0] == 0
        other, prompt_tokens = cached("k2")
        assert prompt_tokens > 64
        if share:
            assert other >= prompt_tokens - 16
        else:
            assert other == 0  # a wrong guess and a right one look the same
        assert cached("k1")[0] >= prompt_tokens - 16  # the same key hits its own prompt
    finally:
        srv.stop()


@pytest.mark.slow
async def test_graceful_shutdown_finishes_or_cancels_in_flight_streams():
    srv = sim_server(time_scale=0.05, settings=GatewaySettings(drain_timeout_s=0.5))
    async with connect(srv.ws_url) as ws:
        await ws.send(
            orjson.dumps(
                {"type": "generate", "id": "short", "prompt": "a", "max_tokens": 3, "ignore_eos": True}
            ).decode()
        )
        await ws.send(
            orjson.dumps(
                {"type": "generate", "id": "long", "prompt": "b", "max_tokens": 7000, "ignore_eos": True}
            ).decode()
        )
        while orjson.loads(await ws.recv())["type"] != "token":
            pass
        srv.server.handle_exit(signal.SIGTERM, None)  # what uvicorn calls on SIGTERM
        deadline = time.monotonic() + 10
        while srv.client.accepting:  # the drain starts on the server's loop
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        r = await asyncio.to_thread(httpx.post, srv.url + "/v1/completions", json={"prompt": "late"})
        assert r.status_code == 429 and "shutting down" in r.json()["error"]["message"]
        ends = {}
        while len(ends) < 2:
            f = orjson.loads(await asyncio.wait_for(ws.recv(), 20))
            if f["type"] in ("done", "error"):
                ends[f["id"]] = f
        assert ends["short"]["finish_reason"] == "length"
        assert ends["long"]["finish_reason"] == "cancelled"
    deadline = time.monotonic() + 20
    while srv.thread.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not srv.thread.is_alive() and not srv.loop.alive


async def test_per_key_token_rate_limit_answers_429_with_retry_after():
    settings = GatewaySettings(api_keys=("k1", "k2"), key_token_rate=20.0, key_token_burst_s=1.0)
    srv = sim_server(settings=settings)
    try:
        body = {"prompt": "word " * 50, "max_tokens": 4}
        first = httpx.post(srv.url + "/v1/completions", json=body, headers={"Authorization": "Bearer k1"})
        assert first.status_code == 200  # the bucket (20 tokens) goes ~35 tokens into debt
        again = httpx.post(srv.url + "/v1/completions", json=body, headers={"Authorization": "Bearer k1"})
        assert again.status_code == 429 and again.json()["error"]["code"] == "overloaded"
        assert int(again.headers["retry-after"]) >= 1
        other = httpx.post(srv.url + "/v1/completions", json=body, headers={"Authorization": "Bearer k2"})
        assert other.status_code == 200  # another key has its own bucket
        async with connect(srv.ws_url, additional_headers={"Authorization": "Bearer k1"}) as ws:
            await ws.send(orjson.dumps({"type": "generate", "id": "a", "prompt": "hi"}).decode())
            f = orjson.loads(await ws.recv())
            assert f["type"] == "error" and f["code"] == "overloaded" and f["retry_after_s"] >= 1
    finally:
        srv.stop()
