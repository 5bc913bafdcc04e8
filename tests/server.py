"""Run the real gateway (uvicorn, port 0) in a background thread for tests."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch

from stallfree.core.build import build_sim_engine
from stallfree.core.model.loader import load_tiny
from stallfree.core.model.model_runner import ModelRunner
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.engine import Engine
from stallfree.core.sched.step_loop import StepLoop
from stallfree.gateway.engine.client import EngineClient
from stallfree.gateway.server import make_server
from stallfree.gateway.settings import GatewaySettings


class RunningServer:
    def __init__(self, engine: Engine, tokenizer, settings: GatewaySettings | None = None, tracing=None) -> None:
        self.loop = StepLoop(engine)
        self.client = EngineClient(self.loop, tokenizer, settings or GatewaySettings(), tracing)
        self.server = make_server(self.client, "127.0.0.1", 0)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/stream"

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Every iteration waits at the runner until the block ends: admitted
        requests stay unstarted for as long as a test needs them there (no
        slow clock standing in). Nothing may call ``engine_call`` inside it."""
        runner = self.loop.engine.runner
        gate = threading.Event()
        execute = runner.execute

        def held_execute(batch):
            gate.wait()
            return execute(batch)

        runner.execute = held_execute
        try:
            yield
        finally:
            gate.set()
            del runner.execute  # the class's method again

    def unstarted(self) -> int:
        """Requests queued in the engine without a first token."""
        return len(self.client.admission.unstarted)

    def engine_call(self, fn):
        """Run fn on the step thread (the only thread that may touch the engine)."""
        return self.loop.call(fn).result(10)

    def kv_used(self) -> int:
        return self.engine_call(lambda: self.loop.engine.kv.num_used_blocks)

    def wait_kv_baseline(self, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        while (used := self.kv_used()) and time.monotonic() < deadline:
            time.sleep(0.02)
        return used

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive()


def sim_server(time_scale: float = 0.02, settings: GatewaySettings | None = None, **sched) -> RunningServer:
    """Simulated runner: each iteration sleeps a (scaled) cost-model time."""
    sched.setdefault("max_num_seqs", 128)
    sched.setdefault("token_budget", 512)
    engine, tokenizer = build_sim_engine(SchedulerConfig(**sched), kv_cache_gib=1.5, time_scale=time_scale)
    return RunningServer(engine, tokenizer, settings)


def tiny_server(settings: GatewaySettings | None = None, **sched) -> RunningServer:
    loaded = load_tiny()
    runner = ModelRunner(loaded, 512, 16, torch.float32, torch.device("cpu"))
    sched = {"max_num_seqs": 16, "max_model_len": 1024, **sched}
    engine = Engine(SchedulerConfig(**sched), CacheConfig(512, 16), runner)
    return RunningServer(engine, loaded.tokenizer, settings)
