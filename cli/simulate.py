"""``stallfree simulate``: run a workload through the real scheduler on a virtual clock."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from cli.options import (
    add_cost_args,
    add_disaggregate_args,
    add_json_arg,
    add_kv_args,
    add_scheduler_args,
    cost_model,
    emit,
    kv_link,
    scheduler_config,
)
from core.analysis.simulator import SCENARIOS
from core.cluster.router import ROUTERS
from core.sched.config import CacheConfig


def add_parser(sub: Any) -> argparse.ArgumentParser:
    s: argparse.ArgumentParser = sub.add_parser("simulate", help=__doc__.split(": ", 1)[1].rstrip("."))
    src = s.add_mutually_exclusive_group()
    src.add_argument("--scenario", default="seed-figure3", choices=SCENARIOS, help="default %(default)s")
    src.add_argument("--trace", type=Path, help="JSONL workload: t, prompt_tokens, output_tokens[, prefix, ...]")
    add_scheduler_args(s)
    add_kv_args(s)
    add_cost_args(s)
    s.add_argument("--profile", type=Path, help="cost model from `stallfree profile` (this machine's real model)")
    s.add_argument("--iterations", action="store_true", help="also print every iteration")
    c = s.add_argument_group(
        "replicas (--replicas N: N engines behind a router on the multi-turn chat workload; "
        "the scenario and trace options do not apply)"
    )
    c.add_argument("--replicas", type=int, help="number of engine replicas")
    c.add_argument("--router", default="all", help=f"{', '.join(ROUTERS)}, a comma list, or all (default)")
    c.add_argument("--conversations", type=int, help="conversations in all (default 50 per replica)")
    c.add_argument("--rate", type=float, help="conversations started per second (default 2 per replica)")
    c.add_argument("--turns", type=int, default=6, help="turns per conversation (default %(default)s)")
    c.add_argument("--system-tokens", type=int, default=1024, help="shared system prompt (default %(default)s)")
    c.add_argument("--seed", type=int, default=0)
    add_disaggregate_args(s, "the scenario or trace on P prefill + D decode workers, beside chunked prefill on P+D")
    add_json_arg(s)
    return s


def run_disaggregated(args: argparse.Namespace) -> None:
    from core.analysis.disagg_sim import format_side_by_side, simulate_colocated, simulate_disaggregated
    from core.analysis.profiler import Profile
    from core.analysis.simulator import load_trace, scenario

    arrivals, defaults = (load_trace(args.trace), {}) if args.trace else scenario(args.scenario)
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
    from core.analysis.chat_workload import ChatWorkload
    from core.analysis.cluster_sim import cluster_report, format_table, simulate_cluster
    from core.cluster.router import make_router

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
    from core.analysis.profiler import Profile
    from core.analysis.simulator import format_report, load_trace, report, scenario, simulate

    defaults: dict[str, Any] = {}
    if args.trace:
        arrivals = load_trace(args.trace)
    else:
        arrivals, defaults = scenario(args.scenario)
    config = scheduler_config(args, defaults)
    cache = CacheConfig(args.kv_blocks, args.block_size, not args.no_prefix_caching)
    cost = Profile.load(args.profile).cost_model if args.profile else cost_model(args)
    result = simulate(arrivals, config, cache, cost)
    for warning in result.engine.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    rep = report(result)
    rep["scenario"] = str(args.trace) if args.trace else args.scenario
    emit(args, rep, format_report(rep, show_iterations=args.iterations))
