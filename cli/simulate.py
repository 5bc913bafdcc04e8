"""``stallfree simulate``: run a workload through the real scheduler on a virtual clock."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cli.options import add_cost_args, add_json_arg, add_kv_args, add_scheduler_args, cost_model, emit, scheduler_config
from core.analysis.simulator import SCENARIOS


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
    add_json_arg(s)
    return s


def run(args: argparse.Namespace) -> None:
    from core.analysis.profiler import Profile
    from core.analysis.simulator import format_report, load_trace, report, scenario, simulate
    from core.sched.config import CacheConfig

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
