"""``stallfree plan``: the article's roofline arithmetic for a model, GPU and token budget."""

from __future__ import annotations

import argparse
from typing import Any

from stallfree.cli.options import (
    add_cost_args,
    add_disaggregate_args,
    add_json_arg,
    cost_model,
    emit,
    int_list,
    kv_link,
)


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
    d = add_disaggregate_args(p, "P prefill and D decode workers against chunked prefill on P+D, --prompts x --rates")
    d.add_argument(
        "--prompts", type=int_list, default=(1024, 8192, 32768), help="prompt lengths (default 1024,8192,32768)"
    )
    d.add_argument("--rates", type=_rates, default=(0.5, 2.0, 8.0), help="prompts/s arriving (default 0.5,2,8)")
    add_json_arg(p)
    return p


def _rates(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError("rates must be > 0")
    return values


def run(args: argparse.Namespace) -> None:
    if args.disaggregate:
        from stallfree.core.analysis.disagg_plan import compare, format_compare

        p_workers, d_workers = args.disaggregate
        doc = compare(
            cost_model(args),
            p_workers,
            d_workers,
            kv_link(args),
            args.prompts,
            args.rates,
            args.decoders,
            args.budget[0],
            args.decode_context,
        )
        return emit(args, doc, format_compare(doc))
    from stallfree.core.analysis.planner import format_plan, plan

    p = plan(cost_model(args), args.decoders, args.prompt, args.budget, args.burst, args.decode_context)
    emit(args, p, format_plan(p))
