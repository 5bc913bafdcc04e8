"""Scale-out across Ray: the gateway in this process, two simulated engine
replicas on a local Ray cluster (started once for the module)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import orjson
import pytest
import ray
import torch
from openai import OpenAI
from websockets.asyncio.client import connect

from bench.servers import StallfreeServer
from stallfree.gateway.engine.client import EngineClient
from stallfree.gateway.server import make_server
from stallfree.gateway.settings import GatewaySettings
from stallfree.scaleout.board import BOARD
from stallfree.scaleout.remote import RemoteEngine
from tests.otlp import TRACE_ID, attrs
from tests.ray_cluster import RayCluster
from tests.wsclient import check_stream, collect, recv, send

pytestmark = pytest.mark.slow  # each module starts a Ray cluster


@pytest.fixture(scope="module")
def cluster():
    c = RayCluster()
    yield c
    c.stop()


async def test_websocket_streams_through_a_replica(cluster):
    before = set(BOARD.placed)
    async with connect(cluster.ws_url) as ws:
        for i in range(4):
            await send(ws, type="generate", id=f"g{i}", prompt=f"hello {i}", max_tokens=12, ignore_eos=True)
        frames = await collect(ws, [f"g{i}" for i in range(4)])
    for f in frames.values():
        check_stream(f, 12)
    placed = {rid: replica for rid, replica in BOARD.placed.items() if rid not in before}
    assert len(placed) == 4 and all(rid.startswith("ws-") for rid in placed)  # each generation placed once
    assert set(placed.values()) <= set(BOARD.stats)  # on replicas that report


def test_openai_api_through_a_replica(cluster):
    client = OpenAI(base_url=cluster.url + "/v1", api_key="none")
    out = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
    chunks = list(
        client.completions.create(
            model="smol", prompt="count", max_tokens=6, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) == 6
    assert chunks[-1].choices[0].finish_reason == "length"
    # n > 1: the choices of one prompt go to one replica, where they share its blocks
    out = client.completions.create(
        model="smol", prompt="share " * 40, max_tokens=5, n=3, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in out.choices] == [0, 1, 2] and out.usage.completion_tokens == 15
    head = out.id.split("-", 1)[1]
    assert len({BOARD.placed[f"cmpl-{head}{suffix}"] for suffix in ("", "-1", "-2")}) == 1


def test_a_repeated_long_system_prompt_lands_where_it_is_cached(cluster):
    client = OpenAI(base_url=cluster.url + "/v1", api_key="none")
    system = "You are a careful assistant. " * 120  # about 700 tokens
    usages = []
    for question in ("first?", "second?", "third?", "fourth?"):
        out = client.chat.completions.create(
            model="smol",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=4,
        )
        usages.append(out.usage)
        reported = {name: stats.seq for name, stats in BOARD.stats.items()}
        deadline = time.monotonic() + 10
        # two reports later (one may have been in flight), the router sees the blocks cached, not only sent
        while any(BOARD.stats[name].seq < seq + 2 for name, seq in reported.items()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    placed = [BOARD.placed[rid] for rid in list(BOARD.placed)[-4:]]
    assert len(set(placed)) == 1, placed
    assert all(u.prompt_tokens_details.cached_tokens >= u.prompt_tokens - 32 for u in usages[1:])


async def test_cancel_and_disconnect_across_the_hop_free_kv_on_the_replica(cluster):
    async with connect(cluster.ws_url) as ws:
        await send(ws, type="generate", id="long", prompt="x " * 300, max_tokens=5000, ignore_eos=True)
        assert (await recv(ws))["type"] == "accepted"
        assert (await recv(ws))["type"] == "token"
        deadline = time.monotonic() + 10
        while not sum(cluster.kv_used().values()):  # until a report shows the blocks it holds
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await send(ws, type="cancel", id="long")
        frames = (await collect(ws, ["long"]))["long"]
        assert frames[-1]["finish_reason"] == "cancelled"
    # far sooner than the 5,000 tokens would take: the abort reached the replica
    assert cluster.wait_kv_baseline(timeout=3) == dict.fromkeys(BOARD.stats, 0)
    ws = await connect(cluster.ws_url)
    for i in range(3):
        await send(ws, type="generate", id=f"d{i}", prompt="y " * 200, max_tokens=7000, ignore_eos=True)
    seen = 0
    while seen < 6:
        seen += (await recv(ws))["type"] == "token"
    await ws.close()
    assert cluster.wait_kv_baseline(timeout=3) == dict.fromkeys(BOARD.stats, 0)


def test_metrics_are_per_replica_and_summed_with_inference_extension_names(cluster):
    text = httpx.get(cluster.url + "/metrics", timeout=5).text
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:gpu_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
        "stallfree_replicas_reporting 2.0",
    ):
        assert name in text
    per_replica = [line for line in text.splitlines() if line.startswith("stallfree_replica_kv_usage{")]
    assert len(per_replica) == 2
    assert cluster.readyz()["replicas"] == 2


async def test_a_killed_replica_ends_its_streams_with_an_error_and_is_replaced(cluster):
    async with connect(cluster.ws_url) as ws:
        await send(ws, type="generate", id="victim", prompt="z " * 100, max_tokens=7000, ignore_eos=True)
        assert (await recv(ws))["type"] == "accepted"
        assert (await recv(ws))["type"] == "token"
        victim_replica = next(r for rid, r in reversed(BOARD.placed.items()) if rid.startswith("ws-"))
        names = ray.util.list_named_actors(all_namespaces=True)
        actor = next(a for a in names if victim_replica in a["name"])
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
        frames = (await collect(ws, ["victim"]))["victim"]
        assert frames[-1]["type"] == "error" and frames[-1]["code"] == "internal"
        # new requests keep being served meanwhile (by the survivor, or retried there)
        await send(ws, type="generate", id="after", prompt="still there?", max_tokens=5, ignore_eos=True)
        check_stream((await collect(ws, ["after"]))["after"], 5)
    body = cluster.wait_ready(2, timeout=90)
    assert victim_replica not in BOARD.stats and body["replicas_ready"] == 2
    assert cluster.wait_kv_baseline() == dict.fromkeys(BOARD.stats, 0)


async def test_a_request_whose_replica_dies_before_its_first_token_is_retried_elsewhere(cluster):
    cluster.wait_ready(2, timeout=90)
    async with connect(cluster.ws_url) as ws:
        before = set(BOARD.placed)
        # a prompt long enough that its prefill outlasts the kill
        await send(ws, type="generate", id="early", prompt="w " * 7000, max_tokens=4, ignore_eos=True)
        accepted = await recv(ws)
        assert accepted["type"] == "accepted"
        deadline = time.monotonic() + 2
        while not (new := [rid for rid in BOARD.placed if rid not in before]):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        request_id, first = new[0], BOARD.placed[new[0]]
        names = ray.util.list_named_actors(all_namespaces=True)
        actor = next(a for a in names if first in a["name"])
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
        check_stream([accepted, *(await collect(ws, ["early"]))["early"]], 4)
        assert BOARD.placed[request_id] != first
    cluster.wait_ready(2, timeout=90)


async def test_serve_replicas_command_streams_and_drains_on_sigterm(cluster):
    """``stallfree serve --sim --replicas 2`` joins this module's Ray cluster,
    serves, and on SIGTERM lets the in-flight stream finish before exiting 0."""

    address = ray.get_runtime_context().gcs_address
    proc = StallfreeServer(
        "--sim",
        "--sim-time-scale",
        "0.05",
        "--replicas",
        "2",
        "--ray-address",
        address,
        "--ray-app",
        "cli-test",
        "--kv-cache-gib",
        "0.25",
        "--drain-timeout-s",
        "20",
    )
    try:
        async with connect(proc.ws_url) as ws:
            await send(ws, type="generate", id="drain", prompt="finish me", max_tokens=300, ignore_eos=True)
            assert (await recv(ws))["type"] == "accepted"
            proc.proc.terminate()
            frames = (await collect(ws, ["drain"]))["drain"]
        assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "length"
        # uvicorn re-raises the signal once drained; Ray's driver handler turns it into exit status 15
        assert proc.proc.wait(60) in (0, 15, -15)
        assert "cli-test" not in ray.serve.status().applications
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()


async def test_dashboard_telemetry_shows_each_replica(cluster):
    async with connect(cluster.url.replace("http", "ws") + "/ws/telemetry") as ws:
        for _ in range(50):
            frame = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
            if frame.get("type") == "telemetry" and frame.get("replicas"):
                break
    assert sorted(r["replica"] for r in frame["replicas"]) == sorted(BOARD.stats)
    assert frame["state"]["kv_free"] == sum(s.kv_free_blocks for s in BOARD.stats.values())


async def test_traces_continue_into_the_replica(cluster):
    async with connect(cluster.ws_url, additional_headers={"traceparent": f"00-{TRACE_ID}-{'3' * 16}-01"}) as ws:
        await send(ws, type="generate", id="t", prompt="trace me " * 50, max_tokens=5, ignore_eos=True)
        check_stream((await collect(ws, ["t"]))["t"], 5)
    spans = cluster.receiver.spans

    def ours(name):
        return [s for s in spans if s.name == name and s.trace_id.hex() == TRACE_ID]

    await asyncio.to_thread(cluster.receiver.wait_for, lambda _: ours("engine.replica") and ours("decode"))
    root = next(s for s in spans if s.trace_id.hex() == TRACE_ID and s.kind == 2)
    replica_span = ours("engine.replica")[0]
    assert replica_span.parent_span_id == root.span_id
    assert attrs(replica_span)["stallfree.replica"] in BOARD.stats
    children = {s.name: s for s in spans if s.parent_span_id == root.span_id}
    assert {"queue_wait", "prefill", "decode", "engine.replica"} <= set(children)
    # the replica's span lies within the request's, and the phases still tile it
    assert root.start_time_unix_nano <= replica_span.start_time_unix_nano
    assert replica_span.end_time_unix_nano <= root.end_time_unix_nano + 1_000_000
    assert children["queue_wait"].end_time_unix_nano == children["prefill"].start_time_unix_nano


async def test_a_second_gateway_with_api_keys_shares_the_replicas(cluster):
    """Gateways are independent ingresses: each opens its own feed on every
    replica, and admission (API keys) stays each gateway's own."""
    backend = RemoteEngine(cluster.backend.handle, cluster.spec, 2, cluster.tokenizer.vocab_size)
    client = EngineClient(backend, cluster.tokenizer, GatewaySettings(api_keys=("sekret",)))
    server = make_server(client, "127.0.0.1", 0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            await asyncio.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        r = await asyncio.to_thread(httpx.post, url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 401
        async with (
            connect(f"ws://127.0.0.1:{port}/v1/stream", additional_headers={"Authorization": "Bearer sekret"}) as ws,
            connect(cluster.ws_url) as other,
        ):
            await send(ws, type="generate", id="k", prompt="with a key", max_tokens=7, ignore_eos=True)
            await send(other, type="generate", id="o", prompt="the first gateway", max_tokens=9, ignore_eos=True)
            check_stream((await collect(ws, ["k"]))["k"], 7)
            check_stream((await collect(other, ["o"]))["o"], 9)
        assert backend.ingress != cluster.backend.ingress
    finally:
        server.should_exit = True
        await asyncio.to_thread(thread.join, 15)
    assert cluster.wait_kv_baseline() == dict.fromkeys(BOARD.stats, 0)


def test_a_replica_builds_its_model_with_the_serve_flags():
    """--compute and --kv-dtype reach each replica's engine, not only a local one."""
    from stallfree.core.sched.config import SchedulerConfig
    from stallfree.scaleout.replica import build
    from stallfree.scaleout.spec import ReplicaSpec

    engine = build(ReplicaSpec(SchedulerConfig(), model="tiny", dtype="fp32", kv_dtype="bf16", kv_cache_gib=0.01))
    assert engine.runner.k_cache.dtype == engine.runner.v_cache.dtype == torch.bfloat16
    assert engine.runner.dtype == torch.float32
