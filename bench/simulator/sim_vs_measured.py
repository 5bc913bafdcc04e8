"""The simulator's prediction beside what the real server measured, row by row.

    .venv/bin/stallfree profile --threads 1 --save profile.json   # fit the cost model here
    .venv/bin/python -m bench.simulator.sim_vs_measured --profile profile.json \
        [--compare bench/results/compare-<date>.json]

Replays bench.serving.compare's workloads (decode at 8 and 32 streams; 8 streams
while a 2,000-token prompt arrives, at budgets 512 and 256 and unchunked)
through the real scheduler on the simulated runner with the fitted cost
model, and sets each predicted figure beside stallfree's measured median from
a compare result (the newest by default). Writes a new
bench/results/sim_vs_measured-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.record import OUT, dated, table
from bench.serving.compare import METRICS, PHASES
from stallfree.core.analysis.profiler import Profile
from stallfree.core.analysis.simulator import make_arrival, simulate
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.timings import gaps_ns, percentile, request_timings


def arrivals(scenario: str) -> list:
    """bench.serving.compare's jobs: decodeN (64-token prompts, 128 tokens) or interference."""
    if scenario.startswith("decode"):
        return [make_arrival(0.0, f"decoder{i}", 64, 128) for i in range(int(scenario[6:]))]
    decoders = [make_arrival(0.0, f"decoder{i}", 32, 160) for i in range(8)]
    return [*decoders, make_arrival(2.0, "long", 2000, 8)]


def predict(profile: Profile, phase: str, scenario: str) -> dict[str, dict[str, float]]:
    config = {"max_num_seqs": 64, "max_model_len": 4096, "token_budget": 512, **PHASES[phase][0]}
    result = simulate(arrivals(scenario), SchedulerConfig(**config), CacheConfig(8192, 16), profile.cost_model)
    groups: dict[str, dict[str, float]] = {}
    for group, prefix in (("all", ""), ("decoders", "decoder"), ("long", "long")):
        reqs = [r for rid, r in result.requests.items() if rid.startswith(prefix)]
        if not reqs:
            continue
        gaps = [g / 1e6 for r in reqs for g in gaps_ns(r.timeline)]
        start = min(r.arrival_ns for r in reqs)
        end = max(r.timeline.token_ns[-1] for r in reqs)
        groups[group] = {
            "itl_p50_ms": percentile(gaps, 50),
            "itl_p99_ms": percentile(gaps, 99),
            "max_gap_ms": max(gaps, default=0.0),
            "ttft_p50_ms": percentile([request_timings(r.timeline).ttft_ms for r in reqs], 50),
            "throughput_tokens_per_s": sum(r.num_output_tokens for r in reqs) / ((end - start) / 1e9),
        }
    return groups


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", type=Path, required=True, help="from `stallfree profile --save`")
    ap.add_argument("--compare", type=Path, help="a compare-<date>.json (default: the newest)")
    args = ap.parse_args()
    compare = args.compare or max(OUT.glob("compare-*.json"), key=lambda p: p.stat().st_mtime)
    measured = json.loads(compare.read_text())
    profile = Profile.load(args.profile)
    rows = []
    for phase, scenario, group, key, label, _ in METRICS:
        runs = [
            r for r in measured["runs"] if (r["phase"], r["scenario"], r["engine"]) == (phase, scenario, "stallfree")
        ]
        got = statistics.median(r[group][key] for r in runs)
        want = predict(profile, phase, scenario)[group][key]
        rows.append({"metric": label, "measured": got, "simulated": want, "error_pct": (want - got) / got * 100})
    errors = [abs(r["error_pct"]) for r in rows]
    command = f"python -m bench.simulator.sim_vs_measured {' '.join(sys.argv[1:])}".strip()
    doc = {"command": command, "compare": compare.name, "profile": profile.to_json(), "rows": rows}
    base = dated("sim_vs_measured")
    base.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    hw = profile.hardware
    lines = [
        "# The simulator (fitted cost model, the real scheduler) beside the measured server",
        "",
        f"`{command}`; measured: stallfree's medians in `{compare.name}`; cost model fitted by "
        f"`stallfree profile` ({profile.dtype}, {profile.threads} thread(s)): {hw.flops / 1e9:.0f} GFLOP/s GEMM, "
        f"{(hw.attention_flops or hw.flops) / 1e9:.0f} GFLOP/s attention, {hw.mem_bw / 1e9:.1f} GB/s, "
        f"{hw.overhead_s * 1e3:.1f} ms per iteration, weight reads {'overlapping' if hw.overlap else 'added to'} "
        "compute.",
        "",
    ]
    cells = [[r["metric"], f"{r['measured']:.0f}", f"{r['simulated']:.0f}", f"{r['error_pct']:+.0f}%"] for r in rows]
    lines += table(["metric", "measured", "simulated", "error"], cells, "lrrr")
    lines += ["", f"Mean |error| {statistics.fmean(errors):.1f}%, worst {max(errors):.1f}%."]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
