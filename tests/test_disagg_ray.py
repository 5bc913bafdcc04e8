"""Disaggregated serving on Ray: 2 prefill and 2 decode sim replicas, the
gateway in this process. Sim replicas here sample a hash of the whole
context they read back from their paged cache, so a prompt's KV that
arrives wrong, misplaced or incomplete changes the tokens."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
import pytest
import ray
from openai import OpenAI
from websockets.asyncio.client import connect

from bench.servers import StallfreeServer
from stallfree.core.build import build_sim_engine
from stallfree.core.cluster.stats import prompt_hashes
from stallfree.core.sched.config import SchedulerConfig
from stallfree.core.sched.request import FinishReason, Request, SamplingParams, Timeline
from stallfree.scaleout.board import BOARD, PREFILL_BOARD
from stallfree.scaleout.remote import RemoteEngine
from stallfree.scaleout.spec import Handoff, Job, ReplicaSpec
from tests.otlp import TRACE_ID, attrs
from tests.ray_cluster import RayCluster
from tests.wsclient import check_stream, collect, recv, send

pytestmark = pytest.mark.slow  # each module starts a Ray cluster


@pytest.fixture(scope="module")
def cluster():
    c = RayCluster(prefill=2)
    yield c
    c.stop()


def colocated_tokens(cluster: RayCluster, prompt: str, n: int) -> list[int]:
    """What one engine computing the prompt itself samples."""
    engine, _ = build_sim_engine(
        cluster.spec.scheduler, None, cluster.spec.kv_cache_gib, time_scale=0.0, read_context=True
    )
    req = Request("r", cluster.tokenizer.encode(prompt), SamplingParams(max_tokens=n, ignore_eos=True), 0)
    engine.add_request(req)
    while engine.has_work:
        engine.step()
    return req.output_token_ids


def kill(replica: str) -> None:
    names = ray.util.list_named_actors(all_namespaces=True)
    actor = next(a for a in names if replica in a["name"])
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)


async def placed(board, before: set[str], timeout: float = 5.0) -> tuple[str, str]:
    """The first request placed on that pool since ``before``: (request id, replica)."""
    deadline = time.monotonic() + timeout
    while not (new := [rid for rid in board.placed if rid not in before]):
        assert time.monotonic() < deadline, "nothing was placed"
        await asyncio.sleep(0.005)
    return new[0], board.placed[new[0]]


def all_free(cluster: RayCluster, timeout: float = 15.0) -> None:
    used = cluster.wait_kv_baseline(timeout)
    assert len(used) == 4 and not any(used.values()), used


async def test_the_stream_is_colocated_serving_s_and_the_kv_lands_in_the_decoder_s_cache(cluster):
    prompt = "the prompt's KV moves between replicas " * 12  # ~100 tokens: full blocks and a partial one
    async with connect(cluster.ws_url, additional_headers={"traceparent": f"00-{TRACE_ID}-{'4' * 16}-01"}) as ws:
        await send(ws, type="generate", id="kv", prompt=prompt, max_tokens=16, ignore_eos=True)
        frames = (await collect(ws, ["kv"]))["kv"]
    check_stream(frames, 16)
    tokens = [t for f in frames if f["type"] == "token" for t in f["token_ids"]]
    assert tokens == colocated_tokens(cluster, prompt, 16)
    rid = next(r for r in reversed(BOARD.placed) if r.startswith("ws-"))
    assert PREFILL_BOARD.placed[rid] in PREFILL_BOARD.stats and BOARD.placed[rid] in BOARD.stats
    # the decode replica's prefix cache holds the imported blocks under the prompt's own hashes
    ids = cluster.tokenizer.encode(prompt)
    hashes = set(prompt_hashes(ids[:-1], 16))
    await settle(lambda: hashes <= set(BOARD.stats[BOARD.placed[rid]].cached))  # once a report says so
    all_free(cluster)
    # the trace: the prefill replica's span, then the decode replica's, which says where the KV came from
    spans = cluster.receiver.spans

    def ours(name):
        return [s for s in spans if s.name == name and s.trace_id.hex() == TRACE_ID]

    await asyncio.to_thread(cluster.receiver.wait_for, lambda _: ours("engine.prefill") and ours("engine.replica"))
    prefill, decode = ours("engine.prefill")[0], ours("engine.replica")[0]
    assert attrs(prefill)["stallfree.replica"] == attrs(decode)["stallfree.prefill_replica"]
    assert prefill.end_time_unix_nano <= decode.start_time_unix_nano + 1_000_000
    assert attrs(decode)["stallfree.kv_fetch_ms"] > 0


def test_the_choices_of_one_prompt_share_its_prefill(cluster):
    client = OpenAI(base_url=cluster.url + "/v1", api_key="none")
    prompt = "three choices, one prefill " * 10
    out = client.completions.create(model="smol", prompt=prompt, max_tokens=6, n=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 18
    assert len({c.text for c in out.choices}) == 1  # greedy, from the same imported KV
    head = out.id.split("-", 1)[1]
    assert f"cmpl-{head}" in PREFILL_BOARD.placed
    assert not {f"cmpl-{head}-1", f"cmpl-{head}-2"} & set(PREFILL_BOARD.placed)
    assert {f"cmpl-{head}", f"cmpl-{head}-1", f"cmpl-{head}-2"} <= set(BOARD.placed)
    all_free(cluster)


async def test_cancel_while_the_prompt_is_computed_frees_the_prefill_replica_s_kv(cluster):
    async with connect(cluster.ws_url) as ws:
        before = set(PREFILL_BOARD.placed)
        await send(ws, type="generate", id="c", prompt="w " * 7000, max_tokens=4, ignore_eos=True)
        assert (await recv(ws))["type"] == "accepted"
        rid, _ = await placed(PREFILL_BOARD, before)
        deadline = time.monotonic() + 30  # the prefill replica reports its KV while the prompt is computed
        while sum(cluster.kv_used().values()) == 0:
            assert time.monotonic() < deadline, "no replica reported the prompt's KV while it was computed"
            await asyncio.sleep(0.05)
        await send(ws, type="cancel", id="c")
        frames = (await collect(ws, ["c"]))["c"]
    assert frames[-1]["finish_reason"] == "cancelled"
    all_free(cluster, timeout=3)  # far sooner than the prompt would take: the prefill was aborted there
    assert rid not in BOARD.placed  # never reached a decode replica


async def test_a_prefill_replica_dying_mid_prompt_is_replaced_for_that_prompt(cluster):
    cluster.wait_ready(4, timeout=90)
    async with connect(cluster.ws_url) as ws:
        before = set(PREFILL_BOARD.placed)
        prompt = "w " * 7000  # its prefill outlasts the kill
        await send(ws, type="generate", id="p", prompt=prompt, max_tokens=6, ignore_eos=True)
        accepted = await recv(ws)
        rid, first = await placed(PREFILL_BOARD, before)
        kill(first)
        frames = [accepted, *(await collect(ws, ["p"]))["p"]]
    check_stream(frames, 6)
    assert PREFILL_BOARD.placed[rid] != first
    t = frames[-1]["timings"]  # the prompt's phase is the prefill replica's (and the transfer), not a wait
    assert t["prefill_ms"] > t["queue_wait_ms"]
    tokens = [t for f in frames if f["type"] == "token" for t in f["token_ids"]]
    assert tokens == colocated_tokens(cluster, prompt, 6)
    cluster.wait_ready(4, timeout=90)
    all_free(cluster)


async def test_a_decode_replica_dying_after_it_took_the_kv_ends_the_stream_with_an_error(cluster):
    cluster.wait_ready(4, timeout=90)
    async with connect(cluster.ws_url) as ws:
        await send(ws, type="generate", id="d", prompt="z " * 300, max_tokens=7000, ignore_eos=True)
        assert (await recv(ws))["type"] == "accepted"
        assert (await recv(ws))["type"] == "token"  # the KV arrived and decoding began
        rid = next(r for r in reversed(BOARD.placed) if r.startswith("ws-"))
        kill(BOARD.placed[rid])
        frames = (await collect(ws, ["d"]))["d"]
        assert frames[-1]["type"] == "error" and frames[-1]["code"] == "internal"
        await send(ws, type="generate", id="after", prompt="still there? " * 5, max_tokens=5, ignore_eos=True)
        check_stream((await collect(ws, ["after"]))["after"], 5)
    body = cluster.wait_ready(4, timeout=90)
    assert body["replicas"] == 4
    all_free(cluster)


async def test_serve_disaggregate_command(cluster):
    """``stallfree serve --sim --disaggregate 1:1`` joins this module's Ray
    cluster with a prefill and a decode application of its own, streams what
    colocated serving would, and removes both when it stops."""
    address = ray.get_runtime_context().gcs_address
    proc = StallfreeServer(
        *("--sim", "--sim-time-scale", "0.05", "--disaggregate", "1:1", "--ray-address", address),
        *("--ray-app", "cli-disagg", "--kv-cache-gib", "0.25", "--max-num-seqs", "64", "--token-budget", "512"),
    )
    try:
        assert httpx.get(proc.url + "/readyz", timeout=5).json()["replicas"] == 2
        async with connect(proc.ws_url) as ws:
            await send(ws, type="generate", id="cli", prompt="disaggregated " * 30, max_tokens=20, ignore_eos=True)
            frames = (await collect(ws, ["cli"]))["cli"]
        check_stream(frames, 20)
        proc.proc.terminate()
        assert proc.proc.wait(60) in (0, 15, -15)
        apps = ray.serve.status().applications
        assert "cli-disagg" not in apps and "cli-disagg-prefill" not in apps
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()


class FakeHandle:
    """A DeploymentHandle stand-in: each method an async function of the call's argument."""

    def __init__(self, **methods) -> None:
        self.methods, self.calls = methods, []

    def options(self, method_name: str, **_) -> FakeHandle.Bound:
        return FakeHandle.Bound(self, method_name)

    class Bound:
        def __init__(self, handle: FakeHandle, name: str) -> None:
            self.handle, self.name = handle, name

        def remote(self, arg=None) -> FakeHandle.Response:
            self.handle.calls.append((self.name, arg))
            return FakeHandle.Response(self.handle.methods[self.name](arg))

    class Response:
        def __init__(self, coro) -> None:
            self.task = asyncio.ensure_future(coro)

        def __await__(self):
            return self.task.__await__()

        def cancel(self) -> None:
            self.task.cancel()


def remote_engine(decode: FakeHandle, prefill: FakeHandle, outputs: list) -> RemoteEngine:
    spec = ReplicaSpec(SchedulerConfig(), sim=True)
    engine = RemoteEngine(decode, spec, 2, 1000, prefill=prefill)  # type: ignore[arg-type]
    engine.listener = SimpleNamespace(on_step=outputs.append, on_fatal=print, on_replicas=lambda stats: None)
    return engine


async def settle(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)


def handoff(job: Job, n: int) -> Handoff:
    return Handoff(f"p{n}", job.request.num_prompt_tokens - 1, [f"ticket{n}"], Timeline(0))


async def test_kv_that_cannot_be_fetched_any_more_is_computed_again():
    prefills = []

    async def prefill(job):
        prefills.append(job)
        return handoff(job, len(prefills))

    async def submit(job):
        if job.kv.ticket == ["ticket1"]:  # its prefill replica died since: the fetch fails there
            raise RuntimeError("owner died")
        return "d0"

    outputs: list = []
    decode = FakeHandle(submit=submit)
    engine = remote_engine(decode, FakeHandle(prefill=prefill), outputs)
    engine.submit(Request("r", list(range(40)), SamplingParams(max_tokens=4), 0))
    await settle(lambda: engine._inflight["r"].replica == "d0")
    assert len(prefills) == 2 and [job.kv.ticket for _, job in decode.calls] == [["ticket1"], ["ticket2"]]
    assert not outputs  # nothing ended: the request runs on d0


async def test_the_choices_of_a_prompt_await_one_prefill_and_a_cancel_of_all_stops_it():
    release, cancelled = asyncio.Event(), []

    async def prefill(job):
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancelled.append(job.request.request_id)
            raise
        return handoff(job, 1)

    outputs: list = []
    decode = FakeHandle(submit=lambda job: asyncio.sleep(0, "d0"))
    prefiller = FakeHandle(prefill=prefill)
    engine = remote_engine(decode, prefiller, outputs)
    engine.submit(Request("a", list(range(40)), SamplingParams(max_tokens=4), 0))
    engine.submit(Request("a-1", list(range(40)), SamplingParams(max_tokens=4), 0, prefill_after="a"))
    await settle(lambda: len(prefiller.calls) == 1)
    engine.abort("a")
    await asyncio.sleep(0.01)
    assert not cancelled  # "a-1" still wants that prompt
    engine.abort("a-1")
    await settle(lambda: len(outputs) == 2)
    assert cancelled == ["a"] and len(prefiller.calls) == 1 and not decode.calls
    assert {o.outputs[0].finish_reason for o in outputs} == {FinishReason.ABORT}


async def test_a_decode_replica_lost_before_the_first_token_hands_the_same_kv_to_another():
    prefills = []

    async def prefill(job):
        prefills.append(job)
        return handoff(job, len(prefills))

    replicas = iter(("d0", "d1"))
    decode = FakeHandle(submit=lambda job: asyncio.sleep(0, next(replicas)))
    outputs: list = []
    engine = remote_engine(decode, FakeHandle(prefill=prefill), outputs)
    engine.submit(Request("r", list(range(40)), SamplingParams(max_tokens=4), 0))
    await settle(lambda: engine._inflight["r"].replica == "d0")
    engine._replica_lost("d0", "killed")  # what its feed's end reports
    await settle(lambda: engine._inflight["r"].replica == "d1")
    assert len(prefills) == 1 and [job.kv.ticket for _, job in decode.calls] == [["ticket1"], ["ticket1"]]
    assert not outputs
