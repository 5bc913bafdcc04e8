"""Traces (a real OTLP/HTTP receiver), Prometheus metrics, request logs, compose file."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs
from websockets.asyncio.client import connect

from stallfree.core.build import build_sim_engine
from stallfree.core.sched.config import SchedulerConfig
from stallfree.gateway.observe.observers import Observer
from stallfree.gateway.observe.tracing import Tracing
from stallfree.gateway.settings import GatewaySettings
from tests.otlp import TRACE_ID, OtlpReceiver, attrs
from tests.server import RunningServer

ROOT = Path(__file__).resolve().parent.parent
PARENT_ID = "00f067aa0ba902b7"


def traced_server(monkeypatch, endpoint: str, iteration_sample: float = 0.0) -> RunningServer:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "stallfree-test")
    tracing = Tracing.from_env(iteration_sample)
    assert tracing is not None
    engine, tokenizer = build_sim_engine(SchedulerConfig(token_budget=96, max_num_seqs=16), time_scale=0.02)
    return RunningServer(engine, tokenizer, GatewaySettings(model_name="smol"), tracing=tracing)


def test_tracing_is_off_without_an_endpoint(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert Tracing.from_env() is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert Tracing.from_env() is None


async def test_span_tree_phases_and_parent_links(monkeypatch):
    receiver = OtlpReceiver()
    server = traced_server(monkeypatch, receiver.url, iteration_sample=1.0)
    try:
        traceparent = f"00-{TRACE_ID}-{PARENT_ID}-01"
        async with connect(server.ws_url, additional_headers={"traceparent": traceparent}) as ws:
            frame = {"type": "generate", "id": "a", "prompt": "tell me " * 150, "max_tokens": 6, "ignore_eos": True}
            await ws.send(orjson.dumps(frame).decode())
            while orjson.loads(await ws.recv())["type"] != "done":
                pass
        r = await asyncio.to_thread(
            httpx.post,
            server.url + "/v1/chat/completions",
            timeout=30,
            headers={"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"},
            json={"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert r.status_code == 200

        def both_exported(spans: list) -> bool:
            """Both requests' decode spans and their SERVER roots (a root ends, and is exported, after its decode)."""
            roots = {attrs(x).get("gen_ai.operation.name") for x in spans if x.kind == 2}
            return sum(x.name == "decode" for x in spans) >= 2 and {"text_completion", "chat"} <= roots

        await asyncio.to_thread(receiver.wait_for, both_exported)
        roots = {attrs(s)["gen_ai.operation.name"]: s for s in receiver.spans if s.kind == 2}  # SERVER
        ws_root, chat_root = roots["text_completion"], roots["chat"]
        assert ws_root.name == "text_completion smol" and chat_root.name == "chat smol"
        assert ws_root.trace_id.hex() == TRACE_ID and ws_root.parent_span_id.hex() == PARENT_ID
        assert chat_root.trace_id.hex() == "1" * 32 and chat_root.parent_span_id.hex() == "2" * 16
        a = attrs(ws_root)
        assert a["gen_ai.request.model"] == "smol" and a["gen_ai.usage.output_tokens"] == 6
        assert a["gen_ai.usage.input_tokens"] > 300 and a["gen_ai.response.finish_reasons"] == ["length"]
        assert a["stallfree.good"] and a["stallfree.ttft_slo_ms"] == 0  # no targets: completing is enough
        children = {s.name: s for s in receiver.spans if s.parent_span_id == ws_root.span_id}
        assert set(children) == {"queue_wait", "prefill", "decode"}
        q, p, d = children["queue_wait"], children["prefill"], children["decode"]
        # the phases tile the request exactly
        assert q.start_time_unix_nano == ws_root.start_time_unix_nano
        assert q.end_time_unix_nano == p.start_time_unix_nano and p.end_time_unix_nano == d.start_time_unix_nano
        assert d.end_time_unix_nano == ws_root.end_time_unix_nano
        chunks = [e for e in p.events if e.name == "chunk"]
        assert len(chunks) >= 4  # a 300-token prompt at budget 96
        assert sum(attrs(e)["stallfree.chunk_tokens"] for e in chunks) == a["gen_ai.usage.input_tokens"]
        assert [attrs(e)["stallfree.prefix_len"] for e in chunks] == sorted(
            attrs(e)["stallfree.prefix_len"] for e in chunks
        )
        da = attrs(d)
        assert da["gen_ai.usage.output_tokens"] == 6
        assert da["stallfree.max_gap_ms"] >= da["stallfree.itl_p99_ms"] >= da["stallfree.itl_p50_ms"] > 0
        iterations = [s for s in receiver.spans if s.name == "engine.iteration"]
        assert iterations and any(link.span_id == ws_root.span_id for s in iterations for link in s.links)
    finally:
        server.stop()
        receiver.stop()


@pytest.mark.slow
async def test_collector_down_costs_nothing_but_a_warning(monkeypatch):
    server = traced_server(monkeypatch, "http://127.0.0.1:9")  # nothing listens there
    try:
        async with connect(server.ws_url) as ws:
            for i in range(4):
                frame = {"type": "generate", "id": f"g{i}", "prompt": "hello", "max_tokens": 20, "ignore_eos": True}
                await ws.send(orjson.dumps(frame).decode())
            done = 0
            while done < 4:
                f = orjson.loads(await asyncio.wait_for(ws.recv(), 20))
                assert f["type"] != "error"
                done += f["type"] == "done"
    finally:
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 10  # shutdown does not hang on the dead collector


def sample(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


async def test_metrics_change_as_requests_run():
    engine, tokenizer = build_sim_engine(SchedulerConfig(token_budget=96, max_num_seqs=16), time_scale=0.02)
    server = RunningServer(engine, tokenizer)
    try:
        before = (await asyncio.to_thread(httpx.get, server.url + "/metrics")).text
        assert sample(before, "stallfree_ttft_seconds_count") == 0
        async with connect(server.ws_url) as ws:
            for i in range(3):
                frame = {"type": "generate", "id": f"g{i}", "prompt": "x " * 200, "max_tokens": 10, "ignore_eos": True}
                await ws.send(orjson.dumps(frame).decode())
            await ws.send('{"type": "cancel", "id": "nope"}')
            done = 0
            while done < 3:
                done += orjson.loads(await ws.recv())["type"] == "done"
        after = (await asyncio.to_thread(httpx.get, server.url + "/metrics")).text
        assert sample(after, "stallfree_ttft_seconds_count") == 3
        assert sample(after, "stallfree_itl_seconds_count") == 27  # every gap: 3 x (10 - 1)
        assert sample(after, "stallfree_generation_tokens_total") == 30
        assert sample(after, "stallfree_prompt_tokens_total") > 600
        assert sample(after, "stallfree_requests_finished_total", finish_reason="length") == 3
        assert sample(after, "stallfree_requests_good_total") == 3
        assert sample(after, "stallfree_errors_total", code="invalid_request") == 1
        assert sample(after, "stallfree_iteration_duration_seconds_count") > 10
        buckets = [sample(after, "stallfree_itl_seconds_bucket", le=le) for le in ("0.001", "0.002", "+Inf")]
        assert buckets == sorted(buckets) and buckets[-1] == 27  # 1 ms buckets exist, cumulative
        assert sample(after, "stallfree_token_budget") == 96
        assert sample(after, "stallfree_chunking_mode", stallfree_chunking_mode="stall_free") == 1
        assert sample(after, "stallfree_kv_blocks", state="free") > 0
        q = sample(after, "stallfree_queue_wait_seconds_sum")
        p = sample(after, "stallfree_prefill_seconds_sum")
        d = sample(after, "stallfree_decode_seconds_sum")
        assert q + p + d == pytest.approx(sample(after, "stallfree_e2e_seconds_sum"), rel=1e-6)
    finally:
        server.stop()


async def test_one_log_event_per_finished_request_without_text():
    engine, tokenizer = build_sim_engine(SchedulerConfig(token_budget=96, max_num_seqs=16), time_scale=0.02)
    server = RunningServer(engine, tokenizer)
    try:
        with capture_logs() as logs:
            async with connect(server.ws_url) as ws:
                frame = {"type": "generate", "id": "g", "prompt": "secret words", "max_tokens": 4, "ignore_eos": True}
                await ws.send(orjson.dumps(frame).decode())
                while orjson.loads(await ws.recv())["type"] != "done":
                    pass
        finished = [e for e in logs if e["event"] == "request_finished"]
        assert len(finished) == 1
        e = finished[0]
        assert e["completion_tokens"] == 4 and e["finish_reason"] == "length"
        assert {"queue_wait_ms", "prefill_ms", "decode_ms", "ttft_ms", "max_gap_ms"} <= set(e)
        assert e["good"] and e["ttft_met"] and e["tbt_met"]
        assert "prompt" not in e and "secret" not in str(e)
    finally:
        server.stop()


class BrokenObserver(Observer):
    """Raises on every event."""

    def on_submit(self, *args: object) -> None:
        raise RuntimeError("broken")

    on_counts = on_iteration = on_tokens = on_finish = on_submit


async def test_a_failing_observer_costs_nobody_their_tokens_nor_the_other_observers_their_events():
    engine, tokenizer = build_sim_engine(SchedulerConfig(token_budget=96, max_num_seqs=16), time_scale=0.02)
    server = RunningServer(engine, tokenizer)
    server.client.observers.insert(0, BrokenObserver())
    try:
        with capture_logs() as logs:
            async with connect(server.ws_url) as ws:
                frame = {"type": "generate", "id": "g", "prompt": "hello", "max_tokens": 6, "ignore_eos": True}
                await ws.send(orjson.dumps(frame).decode())
                while (f := orjson.loads(await asyncio.wait_for(ws.recv(), 20)))["type"] != "done":
                    assert f["type"] != "error"
        assert f["finish_reason"] == "length" and f["usage"]["completion_tokens"] == 6
        failed = [e for e in logs if e["event"] == "observer_failed"]
        assert failed and all(e["observer"] == "BrokenObserver" for e in failed)
        assert [e["completion_tokens"] for e in logs if e["event"] == "request_finished"] == [6]
        metrics = (await asyncio.to_thread(httpx.get, server.url + "/metrics")).text
        assert sample(metrics, "stallfree_generation_tokens_total") == 6
        assert sample(metrics, "stallfree_requests_finished_total", finish_reason="length") == 1
    finally:
        server.stop()


def test_compose_file_is_valid_against_the_compose_spec():
    compose = ROOT / "docker-compose.yml"
    checker = shutil.which("check-jsonschema") or str(Path(sys_prefix()) / "bin" / "check-jsonschema")
    out = subprocess.run(
        [checker, "--builtin-schema", "vendor.compose-spec", str(compose)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = compose.read_text()
    assert "jaegertracing/all-in-one" in text and "OTEL_EXPORTER_OTLP_ENDPOINT" in text
    assert (ROOT / "Dockerfile").exists()


def sys_prefix() -> str:
    import sys

    return sys.prefix
