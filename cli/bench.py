"""``stallfree bench``: load a server (this one or any OpenAI-compatible) and report latencies."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from stallfree.cli.options import add_replay_args, emit, replay_of


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser("bench", help=__doc__.split(": ", 1)[1].rstrip("."))
    p.add_argument(
        "--target",
        default="ws://127.0.0.1:8000/v1/stream",
        help="ws://.../v1/stream (this server) or http://.../v1 (any OpenAI-compatible server)",
    )
    p.add_argument("--model", default="smollm2", help="model name sent to OpenAI-compatible servers")
    p.add_argument("--api-key")
    p.add_argument(
        "--workload",
        choices=["interference", "poisson", "burst", "trace"],
        help="default: trace with --trace, else interference",
    )
    p.add_argument("--requests", type=int, default=32, help="poisson/burst: number of requests")
    p.add_argument("--prompt", default="fixed:256", help="fixed:N | uniform:A-B | longtail")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument(
        "--trace", type=Path, help="replay a trace: Azure LLM 2023 .csv, Mooncake .jsonl, or stallfree's .jsonl"
    )
    add_replay_args(p)
    g = p.add_argument_group("interference: N streams decoding, then long prompts arriving")
    g.add_argument("--streams", type=int, default=8)
    g.add_argument("--long-prompts", type=int, default=1)
    g.add_argument("--long-tokens", type=int, default=2000)
    g.add_argument("--long-delay-s", type=float, default=2.0)
    g.add_argument("--decode-tokens", type=int, default=160, help="tokens each decoding stream generates")
    p.add_argument(
        "--sweep", help="reconfigure between runs (this server), e.g. token_budget=128,256,512 or tbt_slo_ms=100,200"
    )
    p.add_argument(
        "--tbt-slo-ms",
        type=float,
        default=100.0,
        help="goodput counts requests whose own P99 gap met it; sweeps mark the largest setting whose p99 did",
    )
    p.add_argument(
        "--ttft-slo-ms",
        type=float,
        help="goodput counts only requests whose first token came within it (from sending); default: not judged",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="directory for the report (JSON, markdown) and PNG plots")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    return p


def run(args: argparse.Namespace) -> None:
    import httpx
    import orjson

    from stallfree.loadtest.report import format_report, markdown_report, plot_report, run_bench

    args.replay = replay_of(args) if args.trace else None  # the trace's window, pace and scaling
    try:
        report = run_bench(args)
    except httpx.HTTPError as exc:  # the server is unreachable or refused: a message, not a traceback
        raise ConnectionError(str(exc) or type(exc).__name__) from exc
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
        (args.out / "report.md").write_text(markdown_report(report))
        for path in plot_report(report, args.out):
            print(f"wrote {path}", file=sys.stderr)
    emit(args, report, format_report(report))
