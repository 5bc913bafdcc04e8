"""The article's burst example on the real model: several long prompts arrive at
once while users decode. How long does the last one wait for its first token,
and what does chunking do to the decoders meanwhile?

    .venv/bin/python -m bench.serving.burst [--repeats 2] [--prompts 4] [--tokens 1500]

Starts `stallfree serve` as it comes (embedded model, every core, its
default dtype: its defaults, the TBT and TTFT targets it derives included) and
alternates three settings through /api/config (A B C A B C): those defaults;
the token budget (512) alone, no targets (the default before targets were
derived); and chunking none. Writes a new bench/results/burst-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys

import httpx
import torch

from bench.record import dated, describe, machine, table
from bench.servers import StallfreeServer
from stallfree.core.model.embedded import load_tokenizer
from stallfree.core.model.model_runner import resolve_dtype
from stallfree.loadtest.clients import StallfreeTarget
from stallfree.loadtest.runner import run_jobs
from stallfree.loadtest.stats import summarize
from stallfree.loadtest.workloads import Arrival, PromptMaker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--decoders", type=int, default=8)
    args = ap.parse_args()
    tokenizer = load_tokenizer()
    dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")  # what serve picks here
    server = StallfreeServer("--max-model-len", "4096")
    port = server.port
    rows = []
    try:
        config = httpx.get(f"http://127.0.0.1:{port}/api/config", timeout=30).json()["scheduler"]
        derived = {name: config[name] for name in ("tbt_slo_ms", "ttft_slo_ms")}
        untargeted = {"tbt_slo_ms": 0, "ttft_slo_ms": 0}
        settings = {
            "serve's default": {"chunking": "stall_free", **derived},
            f"budget {config['token_budget']}, no targets": {"chunking": "stall_free", **untargeted},
            "chunking none": {"chunking": "none", **untargeted},
        }
        target = StallfreeTarget(f"ws://127.0.0.1:{port}/v1/stream")
        seed = 100
        for rep in range(args.repeats):
            for mode, setting in settings.items():
                httpx.put(f"http://127.0.0.1:{port}/api/config", json=setting, timeout=30).raise_for_status()
                seed += 1
                make = PromptMaker(tokenizer, seed)
                decode_tokens = 40 + args.prompts * args.tokens // 40
                jobs = [Arrival(0.0, make(32), decode_tokens, "decoder") for _ in range(args.decoders)]
                jobs += [Arrival(2.0, make(args.tokens), 8, "long") for _ in range(args.prompts)]
                results = asyncio.run(run_jobs(target, jobs))
                long_ttft = sorted(r.ttft_s * 1e3 for r in results if r.job.group == "long" and r.ttft_s)
                dec = summarize(results, "decoder")
                rows.append(
                    {
                        "mode": mode,
                        "repeat": rep,
                        "last_ttft_ms": long_ttft[-1],
                        "first_ttft_ms": long_ttft[0],
                        "decoder_itl_p50_ms": dec["itl_p50_ms"],
                        "decoder_itl_p99_ms": dec["itl_p99_ms"],
                        "decoder_max_gap_ms": dec["max_gap_ms"],
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        server.stop()
    command = ("python -m bench.serving.burst " + " ".join(sys.argv[1:])).strip()
    base = dated("burst")
    record = {"command": command, "machine": machine(), "args": vars(args), "derived": derived, "rows": rows}
    base.with_suffix(".json").write_text(json.dumps(record, indent=2))
    lines = [
        f"# Burst: {args.prompts} prompts of {args.tokens} tokens at once, {args.decoders} users decoding "
        f"(embedded SmolLM2, {dtype}, serve's default threads: all {os.cpu_count()} cores)",
        "",
        f"`{command}` on {describe(record['machine'])} — medians of {args.repeats} alternating runs. "
        f"serve's default derived a TBT target of {derived['tbt_slo_ms']:g} ms and a TTFT target of "
        f"{derived['ttft_slo_ms']:g} ms at start-up.",
        "",
    ]
    keys = ("first_ttft_ms", "last_ttft_ms", "decoder_itl_p50_ms", "decoder_itl_p99_ms", "decoder_max_gap_ms")
    cells = []
    for mode in settings:
        rs = [r for r in rows if r["mode"] == mode]
        cells.append([mode, *(f"{statistics.median(r[k] for r in rs):.0f}" for k in keys)])
    header = ["setting", "first TTFT ms", "last TTFT ms", "decoders' ITL p50 ms", "p99 ms", "max gap ms"]
    lines += table(header, cells, "lrrrrr")
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
