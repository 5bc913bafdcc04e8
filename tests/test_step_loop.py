"""The engine's dedicated thread: inbox, one callback per iteration, survival."""

import gc
import threading
import time
from types import SimpleNamespace

import pytest

from stallfree.core.analysis.cost_model import ARTICLE_GPU, CostModel
from stallfree.core.analysis.sim_runner import SimRunner
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.engine import Engine
from stallfree.core.sched.step_loop import EngineStopped, StepLoop, on_own_thread
from tests.simkit import request


class Recorder:
    def __init__(self):
        self.steps = []
        self.threads = set()
        self.done = {}
        self.reasons = []
        self.cond = threading.Condition()

    def on_fatal(self, reason):
        self.reasons.append(reason)

    def on_step(self, out):
        with self.cond:
            self.steps.append(out)
            self.threads.add(threading.current_thread().name)
            for o in out.outputs:
                if o.finish_reason:
                    self.done[o.request_id] = o
            self.cond.notify_all()

    def wait_for(self, predicate, timeout=10):
        with self.cond:
            assert self.cond.wait_for(predicate, timeout), "timed out"


@pytest.fixture
def loop():
    # real time: each iteration sleeps its predicted cost (~1 ms here)
    cost = CostModel(hardware=ARTICLE_GPU.__class__("fast", 400e12, 3e12 * 5, 0.001))
    engine = Engine(SchedulerConfig(token_budget=64, max_num_seqs=16), CacheConfig(512, 4), SimRunner(cost, 4))
    rec = Recorder()
    loop = StepLoop(engine)
    loop.start(rec)
    yield loop, rec
    loop.stop()
    assert not loop.alive


def test_outputs_come_once_per_iteration_on_the_step_thread(loop):
    loop, rec = loop
    for i in range(5):
        loop.submit(request(f"r{i}", 10, max_tokens=6))
    rec.wait_for(lambda: len(rec.done) == 5)
    assert rec.threads == {"stallfree-step"}
    ids = [s.iteration.iteration for s in rec.steps if s.iteration]
    assert ids == sorted(set(ids))  # one callback per iteration, in order
    tokens = sum(len(o.new_token_ids) for s in rec.steps for o in s.outputs)
    assert tokens == 30
    assert all(o.end.num_output_tokens == 6 for o in rec.done.values())


def test_abort_from_another_thread_frees_kv(loop):
    loop, rec = loop
    loop.submit(request("long", 20, max_tokens=10_000))
    rec.wait_for(lambda: any(o.request_id == "long" for s in rec.steps for o in s.outputs))
    assert loop.abort("long").result(5) is True
    rec.wait_for(lambda: "long" in rec.done)
    assert rec.done["long"].finish_reason == "abort"
    assert loop.call(lambda: loop.engine.kv.num_free_blocks).result(5) == 512


def test_reconfigure_and_refusals(loop):
    loop, _ = loop
    warnings = loop.reconfigure({"chunking": "none", "token_budget": 8}).result(5)
    assert warnings
    assert loop.call(lambda: loop.engine.config.chunking).result(5) == "none"
    with pytest.raises(ValueError, match="cannot be changed at runtime"):
        loop.reconfigure({"max_num_seqs": 1}).result(5)


def test_thread_survives_runner_and_callback_failures(loop):
    loop, rec = loop
    runner = loop.engine.runner
    real = runner.execute
    failures = iter([RuntimeError("boom")])

    def flaky(batch):
        err = next(failures, None)
        if err:
            raise err
        return real(batch)

    runner.execute = flaky
    loop.submit(request("a", 4, max_tokens=2))
    rec.wait_for(lambda: "a" in rec.done)
    assert rec.done["a"].finish_reason == "error"
    loop.listener = SimpleNamespace(on_step=lambda out: 1 / 0, on_fatal=rec.on_fatal)  # a broken consumer
    loop.submit(request("b", 4, max_tokens=2))
    deadline = time.monotonic() + 10
    while loop.call(lambda: loop.engine.has_work).result(5):  # b ran, its outputs went to the broken consumer
        assert time.monotonic() < deadline
        time.sleep(0.01)
    loop.listener = rec
    loop.submit(request("c", 4, max_tokens=2))
    rec.wait_for(lambda: "c" in rec.done)
    assert loop.alive


def test_each_iteration_says_whether_its_thread_computed_or_waited(loop):
    loop, rec = loop
    runner = loop.engine.runner
    real = runner.execute

    def computes(batch):  # 5 ms of this thread's CPU however busy the machine is
        until = time.thread_time() + 0.005
        while time.thread_time() < until:
            pass
        return real(batch)

    def blocks(batch):
        time.sleep(0.02)
        return real(batch)

    def collects(batch):
        gc.collect()
        return real(batch)

    records = {}
    for name, execute in (("computes", computes), ("blocks", blocks), ("collects", collects)):
        runner.execute = execute
        loop.submit(request(name, 4, max_tokens=1))
        rec.wait_for(lambda name=name: name in rec.done)
        records[name] = next(s.iteration for s in rec.steps if s.iteration and name in s.iteration.request_ids)
    busy, idle = records["computes"], records["blocks"]
    assert busy.thread_cpu_ns >= 5_000_000
    assert idle.thread_cpu_ns < idle.duration_ns / 2 and idle.thread_waits >= 1  # asleep: the core given away
    assert 0 < records["collects"].collector_ns <= records["collects"].duration_ns


def test_a_broken_engine_fails_everything_and_nothing_waits_forever(loop):
    loop, rec = loop
    reasons = rec.reasons
    loop.engine.runner.execute = lambda batch: 1 / 0  # every iteration fails
    for i in range(Engine.MAX_FAILED_ITERATIONS):
        loop.submit(request(f"r{i}", 4, max_tokens=2))
        rec.wait_for(lambda i=i: f"r{i}" in rec.done)
        assert rec.done[f"r{i}"].finish_reason == "error"
    deadline = time.monotonic() + 5
    while loop.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not loop.alive and len(reasons) == 1 and "in a row failed" in reasons[0]
    assert loop.engine.kv.num_used_blocks == 0
    with pytest.raises(EngineStopped):  # refused at once, never queued
        loop.call(lambda: 1).result(1)


def test_on_own_thread_returns_what_its_function_returns_and_raises_what_it_raises():
    caller = threading.current_thread()
    assert on_own_thread(lambda: threading.current_thread() is not caller)

    def fails() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        on_own_thread(fails)
