"""``stallfree simulate``: run a workload through the real scheduler on a virtual clock."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from stallfree.cli.options import (
    add_cost_args,
    add_disaggregate_args,
    add_json_arg,
    add_kv_args,
    add_replay_args,
    add_scheduler_args,
    cost_model,
    emit,
    kv_link,
    replay_of,
    scheduler_config,
)
from stallfree.core.analysis.simulator import SCENARIOS
from stallfree.core.cluster.router import ROUTERS
from stallfree.core.sched.config import CacheConfig


def add_parser(sub: Any) -> argparse.ArgumentParser:
    s: argparse.ArgumentParser = sub.add_parser("simulate", help=__doc__.split(": ", 1)[1].rstrip("."))
    src = s.add_mutually_exclusive_group()
    src.add_argument("--scenario", default="seed-figure3", choices=SCENARIOS, help="default %(default)s")
    src.add_argument(
        "--trace", type=Path, help="a trace: Azure .csv, Mooncake .jsonl, or JSONL of t, prompt_tokens, output_tokens"
    )
    add_replay_args(s)
    cap = s.add_argument_group("capacity (Sarathi-Serve's: the highest rate meeting a TBT SLO; needs --trace)")
    cap.add_argument(
        "--capacity",
        metavar="SLO",
        help="search the highest rate at which P99 TBT <= SLO and P50 scheduling delay <= 2 s, with a token budget, "
        "a TBT target of the SLO, unchunked, and disaggregated with --disaggregate: strict or relaxed (5x or 25x "
        "the decode-only iteration), or the SLO in ms",
    )
    cap.add_argument(
        "--slo-batch", type=int, default=8, help="decodes in the decode-only iteration (default %(default)s)"
    )
    add_scheduler_args(s)
    add_kv_args(s)
    add_cost_args(s)
    s.add_argument("--profile", type=Path, help="cost model from `stallfree profile` (this machine's real model)")
    s.add_argument("--iterations", action="store_true", help="also print every iteration")
    s.add_argument(
        "--shed-load",
        action="store_true",
        help="with --ttft-slo-ms: refuse at arrival what the queue alone makes late, as the server's --shed-load",
    )
    s.add_argument(
        "--draft-acceptance",
        type=float,
        help="with --speculate: every decode proposes drafts and the simulated model keeps each with this "
        "probability (the workload's acceptance rate, 0-1); with --capacity: adds the TBT target with speculation",
    )
    c = s.add_argument_group(
        "replicas (--replicas N: N engines behind a router on the multi-turn chat workload, --rate "
        "conversations started per second, default 2 per replica; the scenario and trace options do not apply)"
    )
    c.add_argument("--replicas", type=int, help="number of engine replicas")
    c.add_argument("--router", default="all", help=f"{', '.join(ROUTERS)}, a comma list, or all (default)")
    c.add_argument("--conversations", type=int, help="conversations in all (default 50 per replica)")
    c.add_argument("--turns", type=int, default=6, help="turns per conversation (default %(default)s)")
    c.add_argument("--system-tokens", type=int, default=1024, help="shared system prompt (default %(default)s)")
    c.add_argument("--seed", type=int, default=0)
    add_disaggregate_args(s, "the scenario or trace on P prefill + D decode workers, beside chunked prefill on P+D")
    add_json_arg(s)
    return s


def run_disaggregated(args: argparse.Namespace) -> None:
    from stallfree.core.analysis.disagg_sim import format_side_by_side, simulate_colocated, simulate_disaggregated
    from stallfree.core.analysis.profiler import Profile
    from stallfree.core.analysis.simulator import load_trace, scenario

    arrivals, defaults = (load_trace(args.trace, replay_of(args)), {}) if args.trace else scenario(args.scenario)
    config = scheduler_config(args, defaults)
    cache = CacheConfig(args.kv_blocks, args.block_size, not args.no_prefix_caching)
    cost = Profile.load(args.profile).cost_model if args.profile else cost_model(args)
    p, d = args.disaggregate
    disagg = simulate_disaggregated(arrivals, p, d, kv_link(args), config, cache, cost)
    colocated = simulate_colocated(arrivals, p + d, config, cache, cost)
    name = str(args.trace) if args.trace else args.scenario
    doc = {"scenario": name, "link_gbps": args.link_gbps, "disaggregated": disagg, "colocated": colocated}
    emit(args, doc, format_side_by_side(disagg, colocated, f"{name} {p}:{d}"))


def run_replicas(args: argparse.Namespace) -> None:
    from stallfree.core.analysis.chat_workload import ChatWorkload
    from stallfree.core.analysis.cluster_sim import cluster_report, format_table, simulate_cluster
    from stallfree.core.cluster.router import make_router

    n = args.replicas
    if n < 1:
        raise ValueError("--replicas must be >= 1")
    routers = ROUTERS if args.router == "all" else tuple(args.router.split(","))
    workload = ChatWorkload(
        conversations=args.conversations or 50 * n,
        rate_per_s=args.rate or 2.0 * n,
        turns=args.turns,
        system_tokens=args.system_tokens,
        seed=args.seed,
    )
    defaults = {"token_budget": 512, "max_num_seqs": 128, "max_model_len": 32768}
    config = scheduler_config(args, defaults)
    cache = CacheConfig(args.kv_blocks, args.block_size, not args.no_prefix_caching)
    cost = cost_model(args)
    rows = []
    for name in routers:
        router = make_router(name, cost, seed=args.seed)
        rows.append(cluster_report(simulate_cluster(workload, n, router, config, cache, cost)))
    doc = {"workload": dataclasses.asdict(workload), "kv_blocks": args.kv_blocks, "routers": rows}
    emit(args, doc, format_table(rows))


def run(args: argparse.Namespace) -> None:
    if args.replicas is not None:
        return run_replicas(args)
    if args.disaggregate is not None:
        return run_disaggregated(args)
    from stallfree.core.analysis.profiler import Profile
    from stallfree.core.analysis.simulator import format_report, load_trace, report, scenario, simulate

    if args.capacity is not None:
        return run_capacity(args)
    defaults: dict[str, Any] = {}
    if args.trace:
        arrivals = load_trace(args.trace, replay_of(args))
    else:
        arrivals, defaults = scenario(args.scenario)
    config = scheduler_config(args, defaults)
    cache = CacheConfig(args.kv_blocks, args.block_size, not args.no_prefix_caching)
    cost = Profile.load(args.profile).cost_model if args.profile else cost_model(args)
    result = simulate(arrivals, config, cache, cost, args.draft_acceptance, args.shed_load)
    for warning in result.engine.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    rep = report(result)
    rep["scenario"] = str(args.trace) if args.trace else args.scenario
    emit(args, rep, format_report(rep, show_iterations=args.iterations))


def run_capacity(args: argparse.Namespace) -> None:
    """Capacity under the SLO for each way of scheduling, on the trace."""
    from stallfree.core.analysis.capacity_search import RELAXED, SLO, STRICT
    from stallfree.core.analysis.profiler import Profile
    from stallfree.core.analysis.simulated_capacity import Setup, capacities, goodput_capacities
    from stallfree.core.analysis.traces import read_trace

    if args.trace is None:
        raise ValueError("--capacity needs --trace")
    setup = Setup(
        read_trace(args.trace),
        replay_of(args),
        scheduler_config(args, {}),
        CacheConfig(args.kv_blocks, args.block_size, not args.no_prefix_caching),
        Profile.load(args.profile).cost_model if args.profile else cost_model(args),
        args.disaggregate,
        kv_link(args) if args.disaggregate is not None else None,
        args.draft_acceptance,
    )
    decode_ms, context = setup.decode_iteration_ms(args.slo_batch)
    multiples = {"strict": STRICT, "relaxed": RELAXED}
    try:
        slo_ms = decode_ms * multiples[args.capacity] if args.capacity in multiples else float(args.capacity)
    except ValueError:
        raise ValueError(f"--capacity: strict, relaxed or the SLO in ms, not {args.capacity!r}") from None
    slo = SLO(slo_ms)
    own_rate = setup.own_rate()
    rows = capacities(setup, slo, args.slo_batch, args.rate or own_rate)
    doc = {
        "trace": str(args.trace),
        "replay": f"{replay_of(args).describe()}; every trial replays this window at its rate",
        "slo": slo.describe(),
        "decode_iteration_ms": decode_ms,
        "slo_basis": f"{args.slo_batch} decodes at context {context} (the window's median prompt)",
        "trace_rate_req_per_s": own_rate,
        "modes": rows,
    }
    if setup.config.ttft_slo_ms:
        doc["ttft_slo_ms"] = setup.config.ttft_slo_ms
        doc["goodput"] = goodput_capacities(setup, slo, setup.config.ttft_slo_ms, args.rate or own_rate)
    emit(args, doc, format_capacity(doc))


def format_capacity(doc: dict[str, Any]) -> str:
    from stallfree.core.analysis.simulated_capacity import figures_at_capacity

    lines = [
        f"capacity on {doc['trace']} ({doc['replay']}; the window's own rate {doc['trace_rate_req_per_s']:.3g} req/s)",
        f"SLO: {doc['slo']} (decode-only iteration {doc['decode_iteration_ms']:.3g} ms: {doc['slo_basis']})",
        "",
        f"  {'mode':<36} {'req/s':>8} {'TTFT p50':>9} {'p99':>8} {'TBT p50':>8} {'p99':>8} {'max gap':>8}"
        f" {'sched p50':>9}  (ms, at capacity)",
    ]
    for row in doc["modes"]:
        figures = figures_at_capacity(row)
        lines.append(
            f"  {row['mode']:<36} {row['capacity_req_per_s']:>8.4g} {figures[0]:>9.1f} {figures[1]:>8.1f}"
            f" {figures[2]:>8.2f} {figures[3]:>8.2f} {figures[4]:>8.1f} {figures[5]:>9.1f}"
        )
    if "goodput" in doc:
        lines += [
            "",
            f"goodput capacity: at least 90 % of the requests good (TTFT <= {doc['ttft_slo_ms']:g} ms and their own "
            "P99 gap within the SLO; refused ones not good)",
            f"  {'mode':<36} {'req/s':>8} {'good':>6} {'refused':>8} {'TTFT p50':>9} {'p99':>8}  (at capacity)",
        ]
        for row in doc["goodput"]:
            at = row["at_capacity"] or {}
            nan = float("nan")
            lines.append(
                f"  {row['mode']:<36} {row['goodput_capacity_req_per_s']:>8.4g} {at.get('good_share', nan):>6.1%}"
                f" {at.get('shed_requests', 0):>8} {at.get('ttft_p50_ms', nan):>9.1f}"
                f" {at.get('ttft_p99_ms', nan):>8.1f}"
            )
    return "\n".join(lines)
