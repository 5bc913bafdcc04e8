"""The scheduler's sharing rules on paper: the simulator (article GPU, 8B
model) runs each scenario with the rule on and off.

    .venv/bin/python -m bench.simulator.scheduler_scenarios

short-behind-long: short-first (``long_prefill_tokens`` default) vs off.
multi-tenant: the ``fair`` policy vs ``fcfs``.
Writes a new bench/results/scheduler_scenarios-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench.record import dated, table
from stallfree.core.analysis.cost_model import CostModel
from stallfree.core.analysis.simulator import report, scenario, simulate
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.timings import percentile

RUNS = [  # (scenario, label, settings, "small" request ids start with, "big" ones)
    ("short-behind-long", "short first (default)", {}, "S", "L"),
    ("short-behind-long", "off: oldest partial first", {"long_prefill_tokens": 1 << 20}, "S", "L"),
    ("multi-tenant", "fair", {"policy": "fair"}, "t", "F"),
    ("multi-tenant", "fcfs", {"policy": "fcfs"}, "t", "F"),
]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help, not a run
    rows = []
    for name, label, settings, small, big in RUNS:
        arrivals, defaults = scenario(name)
        rep = report(simulate(arrivals, SchedulerConfig(**defaults, **settings), CacheConfig(8192), CostModel()))
        reqs = rep["requests"]
        smalls = [r["ttft_ms"] for rid, r in reqs.items() if rid.startswith(small)]
        bigs = [r["ttft_ms"] for rid, r in reqs.items() if rid.startswith(big)]
        decoders = [r["max_gap_ms"] for rid, r in reqs.items() if rid[0] in "BD" or rid.startswith(small)]
        rows.append(
            {
                "scenario": name,
                "rule": label,
                "small_ttft_p50_ms": percentile(smalls, 50),
                "small_ttft_p99_ms": percentile(smalls, 99),
                "big_ttft_p50_ms": percentile(bigs, 50),
                "big_ttft_p99_ms": percentile(bigs, 99),
                "max_gap_ms": max(decoders),
                "throughput_tokens_per_s": rep["summary"]["throughput_tokens_per_s"],
            }
        )
    command = "python -m bench.simulator.scheduler_scenarios"
    base = dated("scheduler_scenarios")
    base.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=2))
    lines = [
        "# Scheduler sharing rules in the simulator (article GPU, Llama-3-8B roofline)",
        "",
        f"`{command}`. short-behind-long: the small requests are the ten 200-token prompts, the big one "
        "the 32,768-token prompt, max gap over the 64 decoding streams and the shorts. multi-tenant: small = "
        "tenants t1..t4, big = the flooding tenant, max gap over all.",
        "",
    ]
    cells = [
        [
            r["scenario"],
            r["rule"],
            *(f"{r[k]:.0f}" for k in ("small_ttft_p50_ms", "small_ttft_p99_ms", "big_ttft_p50_ms", "big_ttft_p99_ms")),
            f"{r['max_gap_ms']:.1f}",
            f"{r['throughput_tokens_per_s']:,.0f}",
        ]
        for r in rows
    ]
    header = ["scenario", "rule", "small TTFT p50 ms", "small p99 ms", "big TTFT p50 ms", "big p99 ms", "max gap ms"]
    lines += table([*header, "tokens/s"], cells, "llrrrrrr")
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), file=sys.stdout)


if __name__ == "__main__":
    main()
