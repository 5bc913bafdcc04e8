"""``stallfree profile``: measure iteration time on the real model; choose token_budget from a TPOT SLO."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from stallfree.cli.options import add_json_arg, add_model_args, emit, model_settings


def add_parser(sub: Any) -> argparse.ArgumentParser:
    pr: argparse.ArgumentParser = sub.add_parser("profile", help=__doc__.split(": ", 1)[1].rstrip("."))
    pr.add_argument("--tpot-slo-ms", type=float, default=100.0, help="TPOT target (default %(default)s ms)")
    pr.add_argument(
        "--quick",
        action="store_true",
        help="fewer points and a shorter probe of the machine's limits (about half the time)",
    )
    pr.add_argument("--save", type=Path, help="where to write the profile (default: ~/.cache/stallfree/)")
    add_json_arg(pr)
    pr.add_argument("--refit", type=Path, help="fit a saved profile's measured points again (no measuring)")
    pr.add_argument(
        "--small-batch-rows",
        type=int,
        help="with --refit: batches up to this many tokens ran the compact decode GEMMs (default: as saved)",
    )
    add_model_args(pr)
    return pr


def run(args: argparse.Namespace) -> None:
    paths: dict[str, str] = {}  # the CPU's kind and each op's implementation, when measured here
    from stallfree.core.analysis.profiler import Profile, choose_budget, default_profile_path, fit, format_profile

    if args.refit:  # the measured points again, through the current cost model's fit
        prof = Profile.load(args.refit)
        rows = args.small_batch_rows
        cost = fit(prof.spec, prof.points, prof.hardware.small_batch_rows if rows is None else rows)
        prof.hardware = cost.hardware
        path = args.save or args.refit
    else:
        from stallfree.core.analysis.profiler import profile_runner
        from stallfree.core.build import build_engine
        from stallfree.core.sched.config import SchedulerConfig

        engine, runner = build_engine(model_settings(args), SchedulerConfig())
        prof = profile_runner(runner, engine.kv.num_blocks, runner.threads, quick=args.quick)
        path = args.save or default_profile_path(runner.config.name, prof.dtype, runner.threads)
        paths = runner.kernel_paths
        if paths:
            print("kernels: " + "; ".join(f"{op}: {how}" for op, how in paths.items()), file=sys.stderr)
    prof.save(path)
    print(f"profile saved to {path}", file=sys.stderr)
    budget, how = choose_budget(prof.points, args.tpot_slo_ms)
    doc = {
        **prof.to_json(),
        **({"kernel_paths": paths} if paths else {}),
        "tpot_slo_ms": args.tpot_slo_ms,
        "token_budget": budget,
        "token_budget_basis": how,
    }
    emit(args, doc, format_profile(prof, args.tpot_slo_ms))
