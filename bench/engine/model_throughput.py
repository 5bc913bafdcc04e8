"""Real-model throughput on this machine: decode tokens/s at 1/8/32/64 streams,
prefill tokens/s, the mixed iteration (decodes plus a 512-token chunk after a
1,536-token prefix) and the per-iteration Python overhead.

    .venv/bin/python -m bench.engine.model_throughput [--repeats 3] [--threads 1,2]

Thread counts are interleaved within each repeat (A B A B ...), so slow
phases of this shared machine hit every configuration alike; medians over the
repeats are reported, and with several thread counts each one's speed-up over
the first. Writes a new bench/results/model_throughput-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench.record import dated, describe, machine, table
from stallfree.core.build import ModelSettings, build_engine
from stallfree.core.sched.config import SchedulerConfig
from stallfree.core.sched.request import Request, SamplingParams
from tests.simkit import tokens


class Timer:
    """Accumulates time spent inside the wrapped callable."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - start


def decode_run(engine, runner, streams: int, prompt: int, steps: int) -> dict:
    """Steady-state decode: all streams decoding, median iteration time."""
    ids = [f"s{streams}-{i}-{time.perf_counter_ns()}" for i in range(streams)]
    reqs = [
        Request(rid, tokens(rid, prompt), SamplingParams(max_tokens=steps + 4, ignore_eos=True), time.perf_counter_ns())
        for rid in ids
    ]
    for r in reqs:
        engine.add_request(r)
    while any(r.num_output_tokens == 0 for r in reqs):
        engine.step()
    forward = Timer(runner.model.forward)
    runner.model.forward = forward
    times, overheads = [], []
    try:
        for _ in range(steps):
            forward.total = 0.0
            start = time.perf_counter()
            out = engine.step()
            took = time.perf_counter() - start
            if out and out.iteration and out.iteration.decode_tokens == streams:
                times.append(took)
                overheads.append((took - forward.total) / took)
    finally:
        runner.model.forward = forward.fn
        for r in reqs:
            engine.abort_request(r.request_id)
        engine.step()
    med = statistics.median(times)
    return {"iteration_ms": med * 1e3, "tokens_per_s": streams / med, "overhead_frac": statistics.median(overheads)}


def prefill_run(engine, prompt: int) -> dict:
    rid = f"p{prompt}-{time.perf_counter_ns()}"  # a fresh prompt: no prefix-cache hits
    req = Request(rid, tokens(rid, prompt), SamplingParams(max_tokens=1, ignore_eos=True), time.perf_counter_ns())
    engine.add_request(req)
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    took = time.perf_counter() - start
    return {"ms": took * 1e3, "tokens_per_s": prompt / took}


def mixed_run(engine, decodes: int, prefix: int = 1536, chunk: int = 512) -> dict:
    """One iteration of ``decodes`` decodes and a ``chunk``-token chunk after a
    ``prefix``-token prefix of the same prompt: the budget holds exactly the
    decodes and one chunk, so the prompt runs chunk by chunk; the one after
    ``prefix`` is timed on three more prompts after a first (which pays for
    oneDNN's code generation for the new shapes): their median."""
    budget = engine.config.token_budget
    engine.reconfigure({"token_budget": decodes + chunk})
    ids = [f"m{decodes}-{i}-{time.perf_counter_ns()}" for i in range(decodes + 1)]
    reqs = [
        Request(rid, tokens(rid, 16), SamplingParams(max_tokens=10_000, ignore_eos=True), time.perf_counter_ns())
        for rid in ids[:decodes]
    ]
    for r in reqs:
        engine.add_request(r)
    while any(r.num_output_tokens == 0 for r in reqs):
        engine.step()
    took: list[float] = []
    try:
        for attempt in range(4):
            rid = f"{ids[-1]}-{attempt}"  # a fresh prompt each time: no prefix-cache hits
            long = Request(rid, tokens(rid, prefix + chunk), SamplingParams(max_tokens=1), time.perf_counter_ns())
            engine.add_request(long)
            while long.num_output_tokens == 0:
                before = long.num_computed_tokens
                out = engine.step()
                it = out.iteration if out is not None else None
                timed = it is not None and before == prefix and attempt > 0
                if timed and it.decode_tokens == decodes and it.prefill_tokens == chunk:
                    took.append((it.end_ns - it.start_ns) / 1e9)
    finally:
        for r in reqs:
            engine.abort_request(r.request_id)
        engine.step()
        engine.reconfigure({"token_budget": budget})
    assert len(took) == 3, "the chunk after the prefix did not run as one iteration with the decodes"
    return {"iteration_ms": statistics.median(took) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--streams", default="1,8,32,64")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per decode stream")
    ap.add_argument("--steps", type=int, default=24, help="decode iterations measured per run")
    ap.add_argument("--dtypes", default="auto", help="comma-separated, e.g. bfloat16,float32")
    ap.add_argument("--out", default="model_throughput", help="result file stem under bench/results/ (dated)")
    ap.add_argument(
        "--mixed", default="8,32", help="decodes beside a 512-token chunk after a 1,536-token prefix ('' for none)"
    )
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    args.mixed = [int(n) for n in args.mixed.split(",") if n]
    streams = [int(s) for s in args.streams.split(",")]
    sched = SchedulerConfig(token_budget=2048, max_num_seqs=128)
    engines = {d: build_engine(ModelSettings(dtype=d), sched) for d in args.dtypes.split(",")}
    raw: dict[str, list] = {}
    for rep in range(args.repeats):
        for engine, runner in engines.values():
            for t in threads:
                torch.set_num_threads(t)
                key = f"{runner.dtype}/{t}t".removeprefix("torch.")
                for n in streams:
                    run = decode_run(engine, runner, n, args.prompt, args.steps)
                    raw.setdefault(f"decode/{key}/{n}", []).append(run)
                for p in (512, 2048):
                    raw.setdefault(f"prefill/{key}/{p}", []).append(prefill_run(engine, p))
                for n in args.mixed:
                    raw.setdefault(f"mixed/{key}/{n}", []).append(mixed_run(engine, n))
                print(f"repeat {rep + 1}/{args.repeats}: {key} done", file=sys.stderr)
    configs = [f"{r.dtype}/{t}t".removeprefix("torch.") for _, r in engines.values() for t in threads]
    summary = {
        key: {m: statistics.median(r[m] for r in runs) for m in runs[0]} | {"runs": runs} for key, runs in raw.items()
    }
    command = "python -m bench.engine.model_throughput " + " ".join(sys.argv[1:])
    doc = {
        "command": command.strip(),
        "machine": machine(),
        "model": runner.config.name,
        "prompt_tokens_per_stream": args.prompt,
        "repeats": args.repeats,
        "results": summary,
    }
    base = dated(args.out)
    base.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    lines = [
        f"# Real-model throughput ({runner.config.name})",
        "",
        f"`{doc['command']}` on {describe(doc['machine'])} — medians of {args.repeats} interleaved repeats; "
        "decode streams start from "
        f"{args.prompt}-token prompts.",
        "",
    ]
    decode = [
        [c, n, f"{r['iteration_ms']:.1f}", f"{r['tokens_per_s']:.0f}", f"{r['overhead_frac'] * 100:.0f}%"]
        for c in configs
        for n in streams
        for r in [summary[f"decode/{c}/{n}"]]
    ]
    header = ["dtype/threads", "streams", "iteration ms", "decode tokens/s", "Python overhead"]
    lines += table(header, decode, "lrrrr")
    prefill = [
        [c, p, f"{r['ms']:.0f}", f"{r['tokens_per_s']:.0f}"]
        for c in configs
        for p in (512, 2048)
        for r in [summary[f"prefill/{c}/{p}"]]
    ]
    lines += ["", *table(["dtype/threads", "prompt tokens", "prefill ms", "prefill tokens/s"], prefill, "lrrr")]
    mixed = [[c, n, f"{summary[f'mixed/{c}/{n}']['iteration_ms']:.1f}"] for c in configs for n in args.mixed]
    if mixed:
        header = ["dtype/threads", "decodes", "iteration ms (decodes + 512-token chunk after 1,536)"]
        lines += ["", *table(header, mixed, "lrr")]
    if len(threads) > 1:
        lines += ["", *speedups(summary, configs, streams, args.mixed)]
    lines += [
        "",
        "Python overhead = share of the iteration outside the model's forward pass "
        "(scheduling, input preparation, sampling, bookkeeping).",
    ]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def speedups(summary: dict, configs: list[str], streams: list[int], mixed: list[int]) -> list[str]:
    """Each configuration's speed over the first of its dtype (medians; time ratios inverted)."""
    rows = []
    for c in configs:
        base = next(b for b in configs if b.split("/")[0] == c.split("/")[0])
        if c == base:
            continue
        for n in streams:
            ratio = summary[f"decode/{c}/{n}"]["tokens_per_s"] / summary[f"decode/{base}/{n}"]["tokens_per_s"]
            rows.append([f"{c} over {base}", f"decode, {n} streams", f"{ratio:.2f}x"])
        for p in (512, 2048):
            ratio = summary[f"prefill/{c}/{p}"]["tokens_per_s"] / summary[f"prefill/{base}/{p}"]["tokens_per_s"]
            rows.append([f"{c} over {base}", f"prefill, {p} tokens", f"{ratio:.2f}x"])
        for n in mixed:
            ratio = summary[f"mixed/{base}/{n}"]["iteration_ms"] / summary[f"mixed/{c}/{n}"]["iteration_ms"]
            rows.append([f"{c} over {base}", f"mixed, {n} decodes", f"{ratio:.2f}x"])
    return table(["configurations", "shape", "speed-up"], rows, "llr")


if __name__ == "__main__":
    main()
