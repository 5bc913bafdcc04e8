"""The sampler's cost per iteration at batch 64 with every sampling option on
vs off, on the real vocabulary size (49,152).

    .venv/bin/python -m bench.sampler_cost [--repeats 5] [--batch 64] [--threads 1]

Configurations, interleaved within each repeat: greedy; temperature + top-p;
everything on (presence, frequency and repetition penalties, an 8-entry
logit_bias, min-p, top-k, top-p, temperature) with each request holding a
512-token prompt and 256 generated tokens. "Everything on" is measured in
steady state (each request's token-count row already built, advanced by one
token per iteration, as in serving); building a row (once per request) is
reported apart. Medians over repeats of the median of 30 iterations.
Writes a new bench/results/sampler_cost-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from bench.record import dated, describe, machine
from core.model.sampler import Sampler
from core.sched.request import Request, SamplingParams

VOCAB = 49152
ITERATIONS = 30

CONFIGS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(),
    "temperature + top_p": SamplingParams(temperature=0.8, top_p=0.95),
    "everything on": SamplingParams(
        temperature=0.8,
        top_p=0.95,
        top_k=50,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        logit_bias=tuple((t, 2.0) for t in range(100, 108)),
    ),
}


def requests(batch: int, params: SamplingParams, tag: str) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(batch):
        ids = torch.randint(0, VOCAB, (768,), generator=g).tolist()
        r = Request(f"{tag}-{i}", ids[:512], params, 0)
        r.output_token_ids = ids[512:]
        reqs.append(r)
    return reqs


def per_iteration_ms(sampler: Sampler, reqs: list[Request], logits: torch.Tensor) -> float:
    times = []
    for _ in range(ITERATIONS):
        x = logits.clone()
        start = time.perf_counter()
        tokens = sampler(x, reqs)
        times.append((time.perf_counter() - start) * 1e3)
        for r, t in zip(reqs, tokens, strict=True):
            r.output_token_ids.append(t)
    return statistics.median(times)


def timed_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="sampler_cost")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logits = torch.randn(args.batch, VOCAB) * 4
    raw: dict[str, list[float]] = {name: [] for name in CONFIGS}
    builds: list[float] = []
    for rep in range(args.repeats):
        for name, params in CONFIGS.items():
            sampler = Sampler(VOCAB, torch.device("cpu"))
            reqs = requests(args.batch, params, f"{rep}-{name}")
            if params.uses_history:  # build every row once, as the first iteration of each request does
                builds.append(timed_ms(lambda s=sampler, r=reqs: s.counts.rows(r)) / args.batch)
            raw[name].append(per_iteration_ms(sampler, reqs, logits))
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
    m = machine()
    summary = {
        name: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v), "runs_ms": v}
        for name, v in raw.items()
    }
    base_ms = summary["greedy"]["median_ms"]
    command = "python -m bench.sampler_cost " + " ".join(sys.argv[1:])
    doc = {
        "command": command.strip(),
        "machine": m,
        "batch": args.batch,
        "vocab": VOCAB,
        "threads": args.threads,
        "results": summary,
        "row_build_ms_per_request": statistics.median(builds),
    }
    path = dated(args.out)
    path.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    lines = [
        f"# Sampler cost per iteration, batch {args.batch}, vocab {VOCAB}",
        "",
        f"`{doc['command']}` on {describe(m)}; {args.threads} torch thread(s). Medians of {args.repeats} "
        f"interleaved repeats (each the median of {ITERATIONS} iterations), [min–max].",
        "",
        "| sampling | ms per iteration | vs greedy |",
        "|---|---:|---:|",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['median_ms']:.2f} [{s['min_ms']:.2f}–{s['max_ms']:.2f}] | {s['median_ms'] / base_ms:.1f}× |"
        )
    lines += [
        "",
        f"Building one request's token-count row (512 prompt + 256 generated tokens), once per request: "
        f"{doc['row_build_ms_per_request']:.3f} ms.",
        "",
        "Everything on = presence, frequency and repetition penalties, an 8-entry logit_bias, min-p 0.05, "
        "top-k 50, top-p 0.95, temperature 0.8, in steady state (rows built, one scatter per iteration).",
    ]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
