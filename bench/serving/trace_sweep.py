"""The article's checklist on replayed production traffic: TTFT and TBT
percentiles against the token budget, and against the TBT target.

    .venv/bin/python -m bench.serving.trace_sweep --trace azure --rate 3 [--repeats 2]

One ``stallfree serve`` (1 compute thread), switched live through
/api/config between runs: a token budget per run with no target, then a TBT
target per run (token budget 512); the runs alternate budget and target
values (b1 t1 b2 t2 ...) and repeat. Each run replays the same trace window
(the trace's first ``--duration-s`` of requests at ``--rate``, fresh prompt
text each run so no run hits another's prefix cache) over the OpenAI
streaming API. Reports, per setting, medians over the repeats of TTFT p50 /
p99, TBT p50 / p99, the worst gap and the scheduling delay p50. Writes a new
bench/results/trace_sweep-<date>.{json,md,png}.
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

from bench.record import OUT, dated, describe, machine, table
from bench.servers import StallfreeServer
from bench.serving.capacity import DRAIN_S, MODEL_DIR, TRACE_SPECS, TraceSpec, wait_idle
from stallfree.core.analysis.traces import read_trace, replay
from stallfree.core.model.embedded import load_tokenizer
from stallfree.loadtest.clients import OpenAITarget
from stallfree.loadtest.report import replay_jobs
from stallfree.loadtest.stats import summarize
from stallfree.loadtest.workloads import WordPrompts, trace_jobs

TBT_BUDGET = 512  # with the target: the engine's default (see bench.serving.capacity)
FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "max_gap_ms", "scheduling_delay_p50_ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", choices=list(TRACE_SPECS), default="azure")
    ap.add_argument("--rate", type=float, required=True, help="mean arrival rate, requests/s")
    ap.add_argument("--duration-s", type=float, default=60.0, help="the trace's first N s of requests")
    ap.add_argument("--budgets", default="128,256,512,1024,2048", help="token budgets, no target")
    ap.add_argument("--targets", default="100,200,400,800,1600", help="TBT targets in ms (budget 512)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", type=Path, help="stallfree's cost model (default: the saved one, else measured)")
    args = ap.parse_args()
    spec: TraceSpec = TRACE_SPECS[args.trace]
    tokenizer = load_tokenizer()
    window = replay(read_trace(spec.file), spec.at(args.rate, args.duration_s))
    settings = [("token_budget", int(b)) for b in args.budgets.split(",")]
    targets = [("tbt_slo_ms", float(t)) for t in args.targets.split(",")]
    order = [s for pair in zip(settings, targets, strict=False) for s in pair]
    order += settings[len(targets) :] + targets[len(settings) :]
    logs = OUT / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    serve = ["--model", str(MODEL_DIR), "--threads", "1", "--max-num-seqs", "64", "--max-model-len", "4096"]
    # a target at start-up: the server fits (or loads) its profile
    serve += ["--tbt-slo-ms", "100", "--ttft-slo-ms", "0"]
    if args.profile:
        serve += ["--profile", str(args.profile)]
    sf = StallfreeServer(*serve, log=logs / "trace_sweep-stallfree.log")
    port = sf.port
    url = f"http://127.0.0.1:{port}"
    target = OpenAITarget(url + "/v1", "smollm2")
    runs: list[dict[str, Any]] = []
    try:
        for repeat in range(args.repeats):
            for name, value in order:
                config = {"tbt_slo_ms": 0.0, "token_budget": value} if name == "token_budget" else {}
                if name == "tbt_slo_ms":
                    config = {"tbt_slo_ms": value, "token_budget": TBT_BUDGET}
                httpx.put(url + "/api/config", json=config, timeout=30).raise_for_status()
                wait_idle(url + "/metrics")
                jobs = trace_jobs(window, WordPrompts(tokenizer, seed=int(time.time())))
                # a run still going DRAIN_S after its last arrival is cut (its requests count as errors)
                results, scheduling_delay_ms = replay_jobs(target, jobs, url + "/metrics", args.duration_s + DRAIN_S)
                s = summarize(results, scheduling_delay_ms=scheduling_delay_ms)
                runs.append({"setting": name, "value": value, "repeat": repeat, **s})
                print(
                    f"{name}={value:g} #{repeat}: TTFT p50 {s['ttft_p50_ms']:.0f} p99 {s['ttft_p99_ms']:.0f}, "
                    f"TBT p50 {s['itl_p50_ms']:.0f} p99 {s['itl_p99_ms']:.0f} max {s['max_gap_ms']:.0f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        sf.stop()
    write(args, spec, len(window), runs)


def medians(runs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    values = sorted({r["value"] for r in runs if r["setting"] == name})
    rows = []
    for v in values:
        mine = [r for r in runs if (r["setting"], r["value"]) == (name, v)]
        rows.append({"value": v, **{k: statistics.median(r.get(k, float("nan")) for r in mine) for k in FIGURES}})
    return rows


def write(args: argparse.Namespace, spec: TraceSpec, requests: int, runs: list[dict[str, Any]]) -> None:
    base = dated("trace_sweep")
    command = "python -m bench.serving.trace_sweep " + " ".join(sys.argv[1:])
    by_budget, by_target = medians(runs, "token_budget"), medians(runs, "tbt_slo_ms")
    doc = {
        "command": command,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "trace": {"name": spec.name, "replay": f"{spec.describe(args.duration_s)}, {args.rate:g} req/s"},
        "requests": requests,
        "budget": by_budget,
        "tbt_target": by_target,
        "runs": runs,
    }
    base.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    lines = [
        f"# TTFT and TBT against the token budget and the TBT target, on the {spec.name} trace",
        "",
        f"`{command}` on {describe(doc['machine'])}, {doc['date']}: one `stallfree serve` (1 thread, same weights as "
        f"`bench.serving.capacity`), {requests} requests ({doc['trace']['replay']}), over the OpenAI streaming API; "
        f"medians of {args.repeats} runs, settings alternating. Times in ms.",
        "",
    ]
    keys = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "max_gap_ms", "scheduling_delay_p50_ms")
    cells = [
        [f"{label} {r['value']:g}", *(f"{r[k]:.0f}" for k in keys)]
        for label, rows in (("token budget", by_budget), (f"TBT target (budget {TBT_BUDGET}), ms", by_target))
        for r in rows
    ]
    header = ["setting", "TTFT p50", "p99", "TBT p50", "p99", "worst gap", "sched. delay p50"]
    lines += table(header, cells, "lrrrrrr")
    lines += ["", f"Plot: `{base.with_suffix('.png').name}`; every run: `{base.with_suffix('.json').name}`."]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(by_budget, by_target, base.with_suffix(".png"), spec.name)
    print("\n".join(lines))


def plot(by_budget: list[dict[str, Any]], by_target: list[dict[str, Any]], path: Path, trace: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for row, (rows, xlabel) in enumerate(
        ((by_budget, "token budget (tokens)"), (by_target, f"TBT target, ms (budget {TBT_BUDGET})"))
    ):
        xs = [r["value"] for r in rows]
        a1, a2 = axes[row]
        for pct in ("p50", "p99"):
            a1.plot(xs, [r[f"ttft_{pct}_ms"] for r in rows], marker="o", label=f"TTFT {pct}")
            a2.plot(xs, [r[f"itl_{pct}_ms"] for r in rows], marker="o", label=f"TBT {pct}")
        a2.plot(xs, [r["max_gap_ms"] for r in rows], marker="x", ls=":", label="worst gap")
        if row == 1:
            a2.plot(xs, xs, color="gray", lw=0.8, label="the target")
        for ax, title in ((a1, "TTFT"), (a2, "inter-token gaps")):
            ax.set(xlabel=xlabel, ylabel="ms", title=f"{title}: {trace}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
