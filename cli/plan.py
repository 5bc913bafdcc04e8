"""``stallfree plan``: the article's roofline arithmetic for a model, GPU and token budget."""

from __future__ import annotations

import argparse
from typing import Any

from cli.options import add_cost_args, add_json_arg, cost_model, emit, int_list


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser("plan", help=__doc__.split(": ", 1)[1].rstrip("."))
    add_cost_args(p)
    p.add_argument("--decoders", type=int, default=64, help="running decode requests (default %(default)s)")
    p.add_argument("--prompt", type=int, default=8192, help="long prompt tokens (default %(default)s)")
    p.add_argument(
        "--budget",
        type=int_list,
        default=(576,),
        help="token budget(s), comma-separated; the first is the headline (default 576)",
    )
    p.add_argument("--burst", type=int, default=10, help="prompts in the burst example (default %(default)s)")
    p.add_argument("--decode-context", type=int, default=0, help="cached tokens per decoder (for --kv-reads)")
    add_json_arg(p)
    return p


def run(args: argparse.Namespace) -> None:
    from core.analysis.planner import format_plan, plan

    p = plan(cost_model(args), args.decoders, args.prompt, args.budget, args.burst, args.decode_context)
    emit(args, p, format_plan(p))
