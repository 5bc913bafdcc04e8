"""Ray, simulated engine replicas and a gateway in this process, for the scale-out tests."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from stallfree.core.sched.config import SchedulerConfig
from stallfree.gateway.engine.client import EngineClient
from stallfree.gateway.observe.tracing import Tracing
from stallfree.gateway.server import make_server
from stallfree.gateway.settings import GatewaySettings
from stallfree.scaleout import app
from stallfree.scaleout.board import BOARD, PREFILL_BOARD
from stallfree.scaleout.remote import RemoteEngine
from stallfree.scaleout.spec import ReplicaSpec
from tests.otlp import OtlpReceiver


class RayCluster:
    """Ray, 2 sim replicas behind the cost router, and the gateway on port 0,
    both tracing to an in-test OTLP receiver. ``prefill``: that many prefill
    replicas too, the 2 others decoding (disaggregated serving)."""

    def __init__(self, prefill: int = 0) -> None:
        from stallfree.core.build import build_sim_engine

        self.receiver = OtlpReceiver()
        self.env = pytest.MonkeyPatch()
        for name, value in (
            ("OTEL_EXPORTER_OTLP_ENDPOINT", self.receiver.url),
            ("OTEL_BSP_SCHEDULE_DELAY", "50"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "2"),
            ("OTEL_SERVICE_NAME", "stallfree-test"),
        ):
            self.env.setenv(name, value)  # the replicas get them from start_ray's runtime_env
        self.tracing = Tracing.from_env()

        _, self.tokenizer = build_sim_engine(SchedulerConfig(), kv_cache_gib=0.01)
        self.spec = ReplicaSpec(
            SchedulerConfig(max_num_seqs=64, token_budget=512),
            sim=True,
            sim_time_scale=0.2,
            sim_read_context=prefill > 0,  # tokens that hash the KV read back: it must arrive intact
            kv_cache_gib=0.5,
            stats_period_s=0.1,
        )
        self.replicas = 2 + prefill
        app.start_ray(None, self.replicas, 1, object_store_gib=0.5)
        handle = app.deploy(self.spec, 2, "least_loaded" if prefill else "cost")
        prefill_handle = app.deploy(self.spec, prefill, "cost", pool="prefill") if prefill else None

        self.backend = RemoteEngine(
            handle, self.spec, self.replicas, self.tokenizer.vocab_size, self.tracing.traceparent, prefill_handle
        )
        self.client = EngineClient(self.backend, self.tokenizer, GatewaySettings(model_name="smol"), self.tracing)
        self.server = make_server(self.client, "127.0.0.1", 0)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url, self.ws_url = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/v1/stream"
        self.wait_ready(self.replicas)

    def readyz(self) -> dict:
        return httpx.get(self.url + "/readyz", timeout=5).json()

    def wait_ready(self, n: int, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while (body := self.readyz()).get("replicas_ready", 0) < n or not body["ready"]:
            assert time.monotonic() < deadline, f"replicas not ready: {body}"
            time.sleep(0.1)
        return body

    def kv_used(self) -> dict[str, int]:
        """Each replica's used KV blocks, prefill replicas' included."""
        return {name: s.kv_used_blocks for b in (BOARD, PREFILL_BOARD) for name, s in b.stats.items()}

    def wait_kv_baseline(self, timeout: float = 15.0) -> dict[str, int]:
        """Each replica's used KV blocks once all are back to 0 (or as they stood at the deadline)."""
        deadline = time.monotonic() + timeout
        while any(self.kv_used().values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.kv_used()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        app.shutdown()
        self.receiver.stop()
        self.env.undo()
