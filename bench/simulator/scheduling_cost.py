"""What scheduling one iteration costs with many requests waiting: what an
overloaded server's step thread pays before the model runs.

    .venv/bin/python -m bench.simulator.scheduling_cost [--waiting 100,1000,10000] [--running 256] [--steps 20]

An engine on the simulator (``SimRunner``, virtual clock: the model costs
nothing here) with ``--running`` requests decoding and ``--waiting`` more
queued behind them (``max_num_seqs`` = the running count, so none is
admitted while the others decode); each step's ``Scheduler.schedule`` is
timed, for every policy, without and with a TTFT target (the deadline
order), and so is the step's ``Engine.counts`` (what the snapshot carries
after each iteration: with TTFT targets, admission's forecast of the queue).
Each queue is timed as it arrived, then 10 s later (past a 2 s target, short
of the 30 s starvation ceiling) and 40 s later (past both): what a queue's
age changes is which prompts can still make their targets.
Medians and the slowest of ``--steps`` iterations after two warm-up steps,
wall time on this process's thread. Writes a new
bench/results/scheduling_cost-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from bench.record import dated, describe, machine, table
from stallfree.core.analysis.cost_model import CostModel
from stallfree.core.analysis.sim_runner import SimRunner, VirtualClock
from stallfree.core.sched.config import CacheConfig, Policy, SchedulerConfig
from stallfree.core.sched.engine import Engine
from tests.simkit import request

BLOCK = 16
PROMPT = 64  # tokens a request's prompt
OUTPUT = 10_000  # tokens a request may generate: the running ones never finish during a run
AGES_S = (0.0, 10.0, 40.0)  # how long the queue has waited when timed


def build(policy: Policy, ttft_slo_ms: float, running: int, waiting: int) -> Engine:
    """``running`` requests decoding, ``waiting`` queued (five tenants, three priorities)."""
    clock = VirtualClock()
    cost = CostModel()
    blocks = running * (PROMPT + 200) // BLOCK + waiting * PROMPT // BLOCK + 64
    config = SchedulerConfig(
        token_budget=max(512, running), max_num_seqs=running, policy=policy, ttft_slo_ms=ttft_slo_ms
    )
    engine = Engine(config, CacheConfig(blocks, BLOCK), SimRunner(cost, BLOCK, clock), clock, cost)
    for i in range(running):
        engine.add_request(request(f"r{i}", PROMPT, OUTPUT, ignore_eos=True))
    while engine.scheduler.waiting:  # prefill them all; then every iteration decodes all of them
        engine.step()
    for i in range(waiting):
        req = request(f"w{i}", PROMPT, 16, clock(), priority=i % 3, ignore_eos=True)
        req.tenant = f"t{i % 5}"
        engine.add_request(req)
    return engine


def timed(engine: Engine, steps: int) -> tuple[list[float], list[float]]:
    """Each step's ``schedule`` and ``counts`` calls, seconds."""
    sched = engine.scheduler
    schedule, counts = sched.schedule, engine.counts
    spent: list[float] = []
    counted: list[float] = []

    def measured(now_ns: int):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return schedule(now_ns)
        finally:
            spent.append(time.perf_counter() - start)

    def measured_counts():  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return counts()
        finally:
            counted.append(time.perf_counter() - start)

    sched.schedule = measured  # type: ignore[method-assign]
    engine.counts = measured_counts  # type: ignore[method-assign]
    for _ in range(steps + 2):
        engine.step()
    return spent[2:], counted[2:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--waiting", default="100,1000,10000")
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    waiting = [int(w) for w in args.waiting.split(",")]
    rows = []
    for policy in Policy:
        for ttft in (0.0, 2000.0):
            for n in waiting:
                engine = build(policy, ttft, args.running, n)
                assert len(engine.scheduler.running) == args.running and len(engine.scheduler.waiting) == n
                arrived_ns = engine.clock()
                for waited_s in AGES_S:
                    engine.clock.now_ns = max(engine.clock(), arrived_ns + int(waited_s * 1e9))
                    spent, counted = timed(engine, args.steps)
                    rows.append(
                        {
                            "policy": policy.value,
                            "ttft_slo_ms": ttft,
                            "waiting": n,
                            "waited_s": waited_s,
                            "median_ms": statistics.median(spent) * 1e3,
                            "max_ms": max(spent) * 1e3,
                            "counts_median_ms": statistics.median(counted) * 1e3,
                            "counts_max_ms": max(counted) * 1e3,
                        }
                    )
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    command = f"python -m bench.simulator.scheduling_cost {' '.join(sys.argv[1:])}".strip()
    m = machine()
    base = dated("scheduling_cost")
    base.with_suffix(".json").write_text(json.dumps({"command": command, "machine": m, "rows": rows}, indent=2))
    lines = [
        "# One iteration's scheduling with many requests waiting",
        "",
        f"`{command}` on {describe(m)}; {args.running} requests decoding, the rest waiting; "
        f"`Scheduler.schedule` per iteration, median and slowest of {args.steps} [ms]; "
        "beside it the step's `Engine.counts` (admission's forecast, under a TTFT target).",
        "",
    ]
    cells = [
        [
            r["policy"],
            "on" if r["ttft_slo_ms"] else "off",
            r["waiting"],
            f"{r['waited_s']:g}",
            f"{r['median_ms']:.2f}",
            f"{r['max_ms']:.2f}",
            f"{r['counts_median_ms']:.2f}",
            f"{r['counts_max_ms']:.2f}",
        ]
        for r in rows
    ]
    header = ["policy", "TTFT target", "waiting", "waited s"]
    header += ["median ms", "slowest ms", "counts median ms", "counts slowest ms"]
    lines += table(header, cells, "llrrrrrr")
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
