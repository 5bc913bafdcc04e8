"""Capacity with and without a busy neighbour, side by side: what a modest
background load on the machine costs each engine (issue 50 asks stallfree's
to stay within 15 % of its quiet capacity).

    .venv/bin/python -m bench.serving.contention --trace prefill-heavy --slo-ms 185 \\
        --first 1.8,1.0 --duty 0.25 --vllm-budget 64 --profile bench/results/profile-....json

Each engine (stallfree with its TBT target at the SLO, and vLLM at one
budget if given) is searched twice on the same requests and the same SLO:
once on a quiet machine, once while ``bench.serving.neighbour`` copies
memory ``--duty`` of the time in a process of its own. The searches'
trials alternate one by one, so the machine's drift falls on all of them
alike; the capacity rule, the servers and the client are
``bench.serving.capacity``'s, the SLO given (a capacity record's, so the
figures sit beside it). Writes bench/results/contention-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.record import OUT, dated, describe, machine, table
from bench.servers import free_port, stop
from bench.serving.capacity import (
    TBT_BUDGET,
    TOLERANCE,
    TRACE_SPECS,
    Run,
    Trials,
    alternate,
    confirm,
    stallfree_at,
    summary_of,
    vllm_at,
    write,
)
from stallfree.core.analysis.capacity_search import SLO, Search
from stallfree.core.analysis.traces import read_trace
from stallfree.core.model.embedded import load_tokenizer
from stallfree.core.model.model_runner import resolve_dtype
from stallfree.loadtest.clients import OpenAITarget


def plan(trace: str, slo: SLO, first: list[float], duty: float, budget: int, max_trials: int) -> list[Run]:
    """Each engine's search on a quiet machine and beside the neighbour, each from its first rate."""
    engines = {"stallfree-tbt": {"tbt_slo_ms": slo.tbt_p99_ms, "ttft_slo_ms": 0.0, "token_budget": TBT_BUDGET}}
    if budget:
        engines[f"vllm-{budget}"] = {}
    runs = []
    for (engine, config), rate in zip(engines.items(), first, strict=False):
        for busy in (0.0, duty):
            search = Search(slo, rate, TOLERANCE, max_trials=max_trials, lowest=rate / 16)
            runs.append(Run(engine, trace, "given", search, config, busy))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", choices=list(TRACE_SPECS), default="prefill-heavy")
    ap.add_argument("--slo-ms", type=float, required=True, help="the P99 TBT SLO (a capacity record's)")
    ap.add_argument("--first", required=True, help="where each search starts, req/s: stallfree[,vLLM]")
    ap.add_argument("--duty", type=float, default=0.25, help="the share of the time the neighbour works")
    ap.add_argument("--vllm-budget", type=int, default=64, help="vLLM's max_num_batched_tokens (0: stallfree alone)")
    ap.add_argument("--requests", type=int, default=100, help="every trial: the trace's first N requests")
    ap.add_argument("--warmup", type=float, default=0.1, help="share of the requests left out of the figures")
    ap.add_argument("--max-trials", type=int, default=5, help="per search")
    ap.add_argument("--confirm", type=int, default=0, help="runs more at each capacity and the failing rate above")
    ap.add_argument("--profile", type=Path, required=True, help="stallfree's cost model")
    ap.add_argument("--dtype", default="auto", help="both engines; auto: stallfree's choice on this CPU")
    args = ap.parse_args()
    first = [float(r) for r in args.first.split(",")]
    if args.vllm_budget and len(first) < 2:
        sys.exit("--first needs a rate for vLLM too (stallfree,vLLM)")
    spec = TRACE_SPECS[args.trace]
    slo = SLO(args.slo_ms)
    dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    base = dated("contention")
    logs = OUT / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "command": "python -m bench.serving.contention " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "dtype": dtype,
        "trace": spec.name,
        "replay": spec.describe(args.requests),
        "slo": slo.describe(),
        "duty": args.duty,
        "trials": [],
    }
    sf = stallfree_at(dtype, args.profile, log=logs / "contention-stallfree.log")
    vl, vl_port = None, free_port()
    trial = Trials(
        {spec.name: read_trace(spec.file)}, {spec.name: spec}, load_tokenizer(), sf.url, args.requests, args.warmup
    )
    trial.engines = {"stallfree": OpenAITarget(sf.url + "/v1", "smollm2")}
    runs = plan(spec.name, slo, first, args.duty, args.vllm_budget, args.max_trials)
    try:
        if args.vllm_budget:
            vl = vllm_at(vl_port, args.vllm_budget, dtype, logs / f"contention-vllm-{args.vllm_budget}.log")
            trial.engines[f"vllm-{args.vllm_budget}"] = OpenAITarget(f"http://127.0.0.1:{vl_port}/v1", "smollm2")
        alternate(runs, trial, doc, base)
        confirm(runs, trial, doc, base, args.confirm)
    finally:
        if vl is not None:
            stop(vl)
        sf.stop()
    report(runs, doc, base)


def report(runs: list[Run], doc: dict[str, Any], base: Path) -> None:
    """Per engine: the quiet capacity, the capacity beside the neighbour, their ratio, and the figures at each."""
    rows, cells = [], []
    for quiet, busy in zip(runs[::2], runs[1::2], strict=True):
        pair = {}
        for name, r in (("quiet", quiet), ("neighbour", busy)):
            there = [t for t in doc["trials"] if t["engine"] == r.engine and t.get("neighbour", 0.0) == r.neighbour]
            pair[name] = summary_of(r, there)
        ratio = (
            pair["neighbour"]["capacity_req_per_s"] / pair["quiet"]["capacity_req_per_s"]
            if pair["quiet"]["capacity_req_per_s"]
            else 0.0
        )
        rows.append({"engine": quiet.engine, **pair, "ratio": ratio})
        for name, s in pair.items():
            keys = ("itl_p50_ms", "itl_p99_ms", "max_gap_ms", "ttft_p50_ms", "ttft_p99_ms")
            cells.append(
                [
                    quiet.engine,
                    name,
                    f"{s['capacity_req_per_s']:.3g}",
                    *(f"{s.get(k) or 0.0:.0f}" for k in keys),
                    s["trials"],
                    s.get("runs_at_capacity", ""),
                ]
            )
    doc["contention"] = rows
    write(base, doc)
    lines = [
        "# Capacity beside a busy neighbour",
        "",
        f"`{doc['command']}` on {describe(doc['machine'])}, {doc['date']}; dtype {doc['dtype']}, one compute thread "
        f"each; {doc['trace']}, {doc['replay']}; SLO: {doc['slo']} (and P50 TTFT <= 2 s). The neighbour "
        f"(`bench.serving.neighbour`) copied a 64 MiB buffer {doc['duty']:.0%} of every 100 ms during each of its "
        "searches' trials; the searches' trials alternated one by one.",
        "",
        *table(
            [
                "engine",
                "machine",
                "capacity (req/s)",
                "TBT p50",
                "p99",
                "worst gap",
                "TTFT p50",
                "p99",
                "trials",
                "every run at that rate",
            ],
            cells,
            "llrrrrrrrl",
        ),
        "",
        *(f"- {r['engine']}: beside the neighbour / quiet **{r['ratio']:.2f}**" for r in rows),
        "",
        f"Every trial: `{base.with_suffix('.json').name}`.",
    ]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
