"""Short prompts behind a long prompt's prefill, on the real model: do they
wait for its whole prefill, and what does the fix cost the long prompt and
the streams already decoding?

    .venv/bin/python -m bench.serving.short_behind_long [--repeats 3]

Starts `stallfree serve` (embedded model, one torch thread, budget 256);
4 streams decode, a ~3,000-token prompt arrives, and 0.3 s later 4 short
prompts. Alternates, through /api/config, short-first (the default
``long_prefill_tokens``) with it off (oldest partial prefill first, as
before). Writes a new bench/results/short_behind_long-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys

import httpx

from bench.record import dated, describe, machine, table
from bench.servers import NO_TARGETS, StallfreeServer
from stallfree.core.model.embedded import load_tokenizer
from stallfree.loadtest.clients import StallfreeTarget
from stallfree.loadtest.runner import run_jobs
from stallfree.loadtest.stats import summarize
from stallfree.loadtest.workloads import Arrival, PromptMaker

MODES = {"short first": 0, "off (oldest partial first)": 1 << 20}  # long_prefill_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long-tokens", type=int, default=3000)
    ap.add_argument("--shorts", type=int, default=4)
    ap.add_argument("--short-tokens", type=int, default=40)
    args = ap.parse_args()
    tokenizer = load_tokenizer()
    server = StallfreeServer("--threads", "1", "--token-budget", "256", "--max-model-len", "4096", *NO_TARGETS)
    port = server.port
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        target = StallfreeTarget(f"ws://127.0.0.1:{port}/v1/stream")
        for rep in range(args.repeats):
            for mode, threshold in MODES.items():
                httpx.put(url + "/api/config", json={"long_prefill_tokens": threshold}, timeout=60)
                make = PromptMaker(tokenizer, 1000 + rep)
                jobs = [Arrival(0.0, make(32), 400, "decoder") for _ in range(4)]
                jobs.append(Arrival(1.0, make(args.long_tokens), 4, "long"))
                jobs += [Arrival(1.3, make(args.short_tokens), 4, "short") for _ in range(args.shorts)]
                results = asyncio.run(run_jobs(target, jobs))
                long = next(r for r in results if r.job.group == "long")
                shorts = [r.ttft_s * 1e3 for r in results if r.job.group == "short" and r.ttft_s]
                dec = summarize(results, "decoder")
                long_ttft = long.ttft_s * 1e3
                rows.append(
                    {
                        "mode": mode,
                        "repeat": rep,
                        "long_ttft_ms": long_ttft,
                        "short_ttft_p50_ms": statistics.median(shorts),
                        "short_ttft_max_ms": max(shorts),
                        "short_over_long": statistics.median(shorts) / long_ttft,
                        "decoder_itl_p50_ms": dec["itl_p50_ms"],
                        "decoder_max_gap_ms": dec["max_gap_ms"],
                        "errors": sum(1 for r in results if r.error),
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        server.stop()
    m = machine()
    command = ("python -m bench.serving.short_behind_long " + " ".join(sys.argv[1:])).strip()
    base = dated("short_behind_long")
    record = {"command": command, "machine": m, "args": vars(args), "rows": rows}
    base.with_suffix(".json").write_text(json.dumps(record, indent=2))
    lines = [
        f"# {args.shorts} short prompts ({args.short_tokens} tokens) 0.3 s behind a {args.long_tokens:,}-token "
        "prompt, 4 streams decoding (embedded SmolLM2, 1 thread, budget 256)",
        "",
        f"`{command}` on {describe(m)} — medians of {args.repeats} alternating runs [min–max].",
        "",
    ]

    def cell(rs: list[dict], key: str, fmt: str) -> str:
        vals = [r[key] for r in rs]
        return f"{statistics.median(vals):{fmt}} [{min(vals):{fmt}}–{max(vals):{fmt}}]"

    formats = {
        "short_ttft_p50_ms": ".0f",
        "short_ttft_max_ms": ".0f",
        "short_over_long": ".2f",
        "long_ttft_ms": ".0f",
        "decoder_itl_p50_ms": ".0f",
        "decoder_max_gap_ms": ".0f",
    }
    cells = []
    for mode in MODES:
        rs = [r for r in rows if r["mode"] == mode]
        cells.append([mode, *(cell(rs, key, fmt) for key, fmt in formats.items())])
    header = ["scheduling", "shorts' TTFT p50 ms", "shorts' TTFT max ms", "shorts / long TTFT", "long TTFT ms"]
    lines += table([*header, "decoders' ITL p50 ms", "decoders' max gap ms"], cells, "lrrrrrr")
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
