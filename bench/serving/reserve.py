"""The TTFT reserve (``ttft_reserve``) against none, at fixed rates of a production trace.

    .venv/bin/python -m bench.serving.reserve --profile bench/results/profile-....json \
        --slos strict=153,relaxed=765 --rates 2.83,8 [--reserves 0,0.5] [--requests 200] [--repeats 2]

One ``stallfree serve`` (one compute thread, the capacity benchmark's flags),
reconfigured live between trials: for each SLO, its TBT target (strict: the
target serve derived at start-up, its default; relaxed: the SLO itself, where
the TTFT deadlines rather than the TBT target decide how early prompts run)
and the 2 s TTFT target, at each reserve. Every trial replays the same first
``--requests`` of the Azure LLM 2023 conversation trace at the trial's mean
rate through the OpenAI streaming API (``bench.serving.capacity``'s replay
and reading: P99 of every gap, scheduling delay from the server's histogram);
the configurations alternate within each repeat. The SLOs are given (the
capacity record's, so the rates can be vLLM's capacities there). Reported per
configuration and rate, medians over the repeats: TBT p50, p99 and worst gap,
TTFT p50 and p99, the scheduling delay's median, and whether the SLO was met
(P99 within it, the scheduling delay's and TTFT's medians within 2 s, nothing failed).

``--simulated``: no server; the same trials in the simulator (the real
scheduler on the profile's cost model, ``--strict-target-ms`` for the target
serve would derive), and for each SLO and reserve the capacity the simulator
finds (``bench.serving.capacity``'s search and rule).

Writes a new bench/results/reserve-<date>.{json,md} (``reserve_sim`` with ``--simulated``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.record import OUT, dated, describe, machine, table
from bench.serving.capacity import MAX_MODEL_LEN, MODEL_DIR, TBT_BUDGET, TRACE_SPECS, stallfree_at, trial_summary
from stallfree.core.analysis.capacity_search import SLO, Trial, search, trial_from
from stallfree.core.analysis.profiler import Profile
from stallfree.core.analysis.simulator import report, simulate, trace_arrivals
from stallfree.core.analysis.traces import read_trace, replay
from stallfree.core.model.embedded import load_tokenizer
from stallfree.core.model.model_runner import resolve_dtype
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.loadtest.clients import OpenAITarget

FIGURES = ("itl_p50_ms", "itl_p99_ms", "max_gap_ms", "ttft_p50_ms", "ttft_p99_ms", "scheduling_delay_p50_ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", type=Path, required=True, help="the server's cost model")
    ap.add_argument("--slos", default="strict=153,relaxed=765", help="name=P99 TBT ms, comma-separated")
    ap.add_argument("--rates", default="2.83", help="requests/s, comma-separated")
    ap.add_argument("--reserves", default="0,0.5", help="ttft_reserve values, comma-separated")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--warmup", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--simulated", action="store_true", help="the simulator on the profile, no server")
    ap.add_argument("--strict-target-ms", type=float, default=0.0, help="--simulated: serve's derived TBT target")
    args = ap.parse_args()
    if args.simulated:
        return simulated(args)
    dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    slos = {name: float(ms) for name, ms in (s.split("=") for s in args.slos.split(","))}
    rates = [float(r) for r in args.rates.split(",")]
    reserves = [float(r) for r in args.reserves.split(",")]
    spec = TRACE_SPECS["azure"]
    rows = read_trace(spec.file)
    tokenizer = load_tokenizer()
    base = dated("reserve")
    logs = OUT / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sf = stallfree_at(dtype, args.profile, log=logs / "reserve-stallfree.log")
    started = httpx.get(sf.url + "/api/config", timeout=30).json()["scheduler"]
    targets = {
        name: {"tbt_slo_ms": started["tbt_slo_ms"] if name == "strict" else ms, "ttft_slo_ms": 2000.0}
        for name, ms in slos.items()
    }
    doc: dict[str, Any] = {
        "command": "python -m bench.serving.reserve " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "dtype": dtype,
        "profile": str(args.profile),
        "trace": f"{spec.name}: {spec.describe(args.requests)}",
        "slos_ms": slos,
        "targets": targets,
        "trials": [],
    }
    engines = {"stallfree": OpenAITarget(sf.url + "/v1", "smollm2")}
    try:
        for repeat in range(args.repeats):
            for rate in rates:
                for name, slo_ms in slos.items():
                    for reserve in reserves:
                        config = {**targets[name], "ttft_reserve": reserve}
                        httpx.put(sf.url + "/api/config", json=config, timeout=30).raise_for_status()
                        window = replay(rows, spec.at(rate, args.requests))
                        _, summary = trial_summary(engines, "stallfree", window, tokenizer, args.warmup, slo_ms)
                        met = trial_from(rate, summary).meets(SLO(slo_ms))
                        doc["trials"].append(
                            {"repeat": repeat, "rate": rate, "slo": name, "reserve": reserve, "met": met}
                            | {k: summary[k] for k in (*FIGURES, "errors")}
                        )
                        print(
                            f"{name:>8} {rate:6.2f} req/s reserve {reserve:.2f}: "
                            + " ".join(f"{k} {summary[k]:.0f}" for k in FIGURES)
                            + f" {'met' if met else 'missed'}",
                            file=sys.stderr,
                            flush=True,
                        )
                        base.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    finally:
        sf.stop()
    write(base, doc)
    print(base.with_suffix(".md").read_text())


def simulated(args: argparse.Namespace) -> None:
    """The same trials in the simulator, and each configuration's simulated capacity."""
    slos = {name: float(ms) for name, ms in (s.split("=") for s in args.slos.split(","))}
    spec = TRACE_SPECS["azure"]
    rows = read_trace(spec.file)
    cost = Profile.load(args.profile).cost_model
    targets = {
        name: {"tbt_slo_ms": args.strict_target_ms if name == "strict" else ms, "ttft_slo_ms": 2000.0}
        for name, ms in slos.items()
    }

    def summary(rate: float, name: str, reserve: float) -> dict[str, Any]:
        config = SchedulerConfig(
            token_budget=TBT_BUDGET,
            max_num_seqs=64,
            max_model_len=MAX_MODEL_LEN,
            tbt_slo_ms=targets[name]["tbt_slo_ms"],
            ttft_slo_ms=targets[name]["ttft_slo_ms"],
            ttft_reserve=reserve,
        )
        window = replay(rows, spec.at(rate, args.requests))
        return report(simulate(trace_arrivals(window), config, CacheConfig(5825, 16), cost))["summary"]

    doc: dict[str, Any] = {
        "command": "python -m bench.serving.reserve " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "dtype": "the profile's",
        "profile": str(args.profile),
        "trace": f"{spec.name}: {spec.describe(args.requests)}",
        "slos_ms": slos,
        "targets": targets,
        "trials": [],
        "capacity": [],
    }
    for rate in (float(r) for r in args.rates.split(",")):
        for name, slo_ms in slos.items():
            for reserve in (float(r) for r in args.reserves.split(",")):
                got = summary(rate, name, reserve)
                met = trial_from(rate, got).meets(SLO(slo_ms))
                doc["trials"].append(
                    {"repeat": 0, "rate": rate, "slo": name, "reserve": reserve, "met": met}
                    | {k: got[k] for k in FIGURES}
                )
    for name, slo_ms in slos.items():
        for reserve in (float(r) for r in args.reserves.split(",")):

            def run(rate: float, name: str = name, reserve: float = reserve) -> Trial:
                return trial_from(rate, summary(rate, name, reserve))

            rate = search(run, SLO(slo_ms), first=1.0, tolerance=0.025).rate
            doc["capacity"].append({"slo": name, "reserve": reserve, "capacity": rate})
    write(dated("reserve_sim"), doc)


def write(base: Path, doc: dict[str, Any]) -> None:
    rows = []
    keys = sorted({(t["slo"], t["rate"], t["reserve"]) for t in doc["trials"]})
    for slo, rate, reserve in keys:
        trials = [t for t in doc["trials"] if (t["slo"], t["rate"], t["reserve"]) == (slo, rate, reserve)]
        row: dict[str, Any] = {"SLO": f"{slo} ({doc['slos_ms'][slo]:g} ms)", "rate": rate, "reserve": reserve}
        for k in FIGURES:
            values = [t[k] for t in trials]
            row[k] = f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"
        row["met"] = f"{sum(t['met'] for t in trials)} of {len(trials)}"
        rows.append(row)
    doc["table"] = rows
    base.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    md = [
        f"# The TTFT reserve against none ({doc['date']})",
        "",
        f"`{doc['command']}`; {describe(doc['machine'])}; {doc['dtype']}, one compute thread; "
        f"{doc['trace']}; server's cost model {doc['profile']}.",
        f"Targets per SLO (TTFT 2 s both): {json.dumps(doc['targets'])}. Medians over the repeats "
        "[lowest-highest]; `met`: P99 gap within the SLO, scheduling delay's and TTFT's medians within 2 s, "
        "nothing failed.",
        "",
        *table(list(rows[0]), [list(r.values()) for r in rows], "lrr" + "r" * len(FIGURES) + "r"),
        "",
    ]
    if doc.get("capacity"):
        md += [
            f"Simulated capacity ({SLO(0.0).describe().split(', ', 1)[1]}, P99 TBT within the SLO; search to 2.5 %):",
            "",
            *table(
                ["SLO", "reserve", "capacity (req/s)"],
                [[c["slo"], c["reserve"], f"{c['capacity']:.2f}"] for c in doc["capacity"]],
                "lrr",
            ),
            "",
        ]
    base.with_suffix(".md").write_text("\n".join(md))


if __name__ == "__main__":
    if not MODEL_DIR.exists():
        sys.exit("run bench/peers/vllm/install.sh and bench/peers/vllm/convert.sh first")
    main()
