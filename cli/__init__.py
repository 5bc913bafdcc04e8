"""``stallfree`` command line: one module per command.

Each command module has ``add_parser(sub)`` and ``run(args)``; only ``run``
imports what the command needs, so ``stallfree plan`` and ``simulate`` never
load torch. Every ``--json`` output is exactly one JSON document on stdout;
logs and errors go to stderr.
"""

from __future__ import annotations

import argparse
import sys

from stallfree.cli import bench, export, generate, plan, profile, serve, simulate

COMMANDS = (plan, simulate, generate, profile, serve, export, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stallfree", description="Stall-free LLM serving gateway and tools.")
    parser.add_argument("--log-level", help="log level on stderr (default: info for serve, else warning)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub).set_defaults(func=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from stallfree.gateway.observe.logs import configure_logging

    configure_logging(args.log_level or ("info" if args.command == "serve" else "warning"))
    try:
        args.func(args)
    except (ValueError, OSError) as exc:  # bad input or an unreachable file/server: a message, not a traceback
        print(f"stallfree {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0
