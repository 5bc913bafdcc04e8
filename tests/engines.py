"""Simulated engines the tests build in an engine process.

A spawned engine process imports the module its factory lives in. From a test
module that meant the OpenAI client, httpx and pytest: 1.7 s of imports before
each engine started. This module imports only the core: 0.1 s.
"""

from __future__ import annotations

import sys
import threading

from stallfree.core.analysis.cost_model import CostModel, HardwareSpec
from stallfree.core.analysis.sim_runner import SimRunner
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.engine import Engine
from stallfree.core.sched.engine_process import BuiltEngine

FAST = HardwareSpec("fast", 400e12, 15e12, 0.001)  # about 1 ms an iteration


class HangingRunner(SimRunner):
    """Never returns from an iteration that holds a request named ``hang-*``."""

    def execute(self, batch):  # type: ignore[no-untyped-def]
        if any(item.request.request_id.startswith("hang") for item in batch.items):
            threading.Event().wait()
        return super().execute(batch)


def fast_engine(hang: bool = False) -> BuiltEngine:
    """A simulated engine of about 1 ms an iteration."""
    runner = (HangingRunner if hang else SimRunner)(CostModel(hardware=FAST), 4)
    engine = Engine(SchedulerConfig(token_budget=64, max_num_seqs=16), CacheConfig(512, 4), runner)
    return BuiltEngine(engine, "test-sim", {"runner": "test"})


def hanging_engine() -> BuiltEngine:
    return fast_engine(hang=True)


def interval_engine() -> BuiltEngine:
    """The fast engine, telling the switch interval its process runs under."""
    built = fast_engine()
    built.facts["switch_interval_s"] = sys.getswitchinterval()
    return built


def thread_engine() -> BuiltEngine:
    """The fast engine, telling whether it was built on the engine process's main thread."""
    built = fast_engine()
    built.facts["built_on_main"] = threading.current_thread() is threading.main_thread()
    return built


def broken_factory() -> BuiltEngine:
    raise ValueError("no such model: nowhere.gguf")


def roomy_engine() -> BuiltEngine:
    """Fast iterations with room for 7,000-token prompts."""
    runner = SimRunner(CostModel(hardware=FAST), 16, time_scale=0.01)
    engine = Engine(SchedulerConfig(token_budget=1024, max_num_seqs=16), CacheConfig(8192, 16), runner)
    return BuiltEngine(engine, "test-sim")
