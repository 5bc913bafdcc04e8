"""``stallfree generate``: stream one answer from the model (greedy by default)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from stallfree.cli.options import add_model_args, model_settings


def add_parser(sub: Any) -> argparse.ArgumentParser:
    g: argparse.ArgumentParser = sub.add_parser("generate", help=__doc__.split(": ", 1)[1].rstrip("."))
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_model_args(g)
    return g


def run(args: argparse.Namespace) -> None:
    """Stream one answer to stdout; timings to stderr."""
    from stallfree.core.analysis.profiler import compute_label
    from stallfree.core.build import build_engine
    from stallfree.core.model.detokenizer import Detokenizer
    from stallfree.core.sched.config import SchedulerConfig
    from stallfree.core.sched.request import Request, SamplingParams
    from stallfree.core.sched.timings import request_timings

    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    sampling.validate()
    engine, runner = build_engine(model_settings(args), SchedulerConfig())
    tok = runner.tokenizer
    text = args.prompt if args.raw else tok.render_chat([{"role": "user", "content": args.prompt}])
    req = Request("generate", tok.encode(text), sampling, time.perf_counter_ns())
    engine.add_request(req)
    detok = Detokenizer(tok.token_bytes, sampling.stop)
    while engine.has_work and not detok.stopped:
        out = engine.step()
        for o in out.outputs if out else []:
            sys.stdout.write(detok.push(o.new_token_ids))
            sys.stdout.flush()
    if detok.stopped:
        engine.abort_request(req.request_id)
    sys.stdout.write(detok.flush() + "\n")
    t = request_timings(req.timeline)
    n = req.num_output_tokens
    print(
        f"[{req.num_prompt_tokens} prompt tokens, {n} generated, TTFT {t.ttft_ms:.0f} ms, "
        f"{(n - 1) / (t.decode_ms / 1e3) if n > 1 and t.decode_ms else 0:.1f} tokens/s decoding, "
        f"{compute_label(runner)}, {runner.threads} threads]",
        file=sys.stderr,
    )
