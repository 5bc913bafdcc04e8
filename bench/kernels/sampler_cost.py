"""The sampler's cost per iteration at batch 64 with every sampling option on
vs off, on the real vocabulary size (49,152).

    .venv/bin/python -m bench.kernels.sampler_cost [--repeats 5] [--batch 64] [--threads 1]

Two kinds of logits: the embedded model's own (its next-token logits after
64 prefixes of an English paragraph) and a flat stress case (Gaussian, sd
4, where top-p 0.95 needs over a thousand tokens). Configurations,
interleaved within each repeat: greedy; temperature + top-p, with every
row's whole vocabulary sorted (the sampler before candidate lists) and as
the sampler does it now; json_object by grammar (each row's llguidance mask,
filled and applied per iteration, the document growing); everything
on (presence, frequency and repetition penalties, an 8-entry logit_bias,
min-p, top-k, top-p, temperature) with each request holding a 512-token
prompt and 256 generated tokens. "Everything on" is measured in
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
from llguidance import LLMatcher

from bench.record import dated, describe, machine, table
from stallfree.core.model import sampler as sampling
from stallfree.core.model.sampler import Sampler
from stallfree.core.model.tokenizer import Tokenizer
from stallfree.core.sched.request import Request, SamplingParams

VOCAB = 49152
CANDIDATES = sampling.CANDIDATES
ITERATIONS = 30

CONFIGS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(),
    "temperature + top_p, whole-vocabulary sort": SamplingParams(temperature=0.8, top_p=0.95),
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
    # response_format json_object: every row's next-token mask from its llguidance matcher
    "json_object grammar": SamplingParams(
        temperature=0.8, top_p=0.95, grammar=LLMatcher.grammar_from_json_schema({"type": "object"})
    ),
}


def requests(batch: int, params: SamplingParams, tag: str) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(batch):
        ids = torch.randint(0, VOCAB, (768,), generator=g).tolist()
        r = Request(f"{tag}-{i}", ids[:512], params, 0)
        r.output_token_ids = [] if params.grammar else ids[512:]  # a grammar's output starts empty
        reqs.append(r)
    return reqs


PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling after decades of salt and wind. "
    "Every evening the keeper climbed the narrow spiral stairs, lit the great lamp, and watched the ships pass "
    "far below. Some nights the fog rolled in so thick that the beam seemed to stop a few yards from the glass, "
    "and he would sound the horn until morning, listening for an answer from the sea."
)


def model_logits(batch: int) -> tuple[torch.Tensor, Tokenizer]:
    """The embedded model's next-token logits after `batch` prefixes of PARAGRAPH."""
    from stallfree.core.build import ModelSettings, build_engine
    from stallfree.core.sched.config import SchedulerConfig
    from stallfree.core.sched.request import Request

    engine, runner = build_engine(ModelSettings(threads=torch.get_num_threads()), SchedulerConfig())
    ids = runner.tokenizer.encode(PARAGRAPH)
    lengths = [max(2, len(ids) * (i + 1) // batch) for i in range(batch)]
    captured: list[torch.Tensor] = []
    forward = runner.model.forward

    def spy(*args: object) -> torch.Tensor:
        out = forward(*args)
        captured.append(out.float().clone())
        return out

    runner.model.forward = spy
    for i, n in enumerate(lengths):
        engine.add_request(Request(f"p{i}", ids[:n], SamplingParams(max_tokens=1), time.perf_counter_ns()))
        while engine.has_work:
            engine.step()
    return torch.cat(captured)[:batch], runner.tokenizer


def per_iteration_ms(sampler: Sampler, reqs: list[Request], logits: torch.Tensor) -> float:
    times = []
    for _ in range(ITERATIONS):
        x = logits.clone()
        start = time.perf_counter()
        tokens = sampler(x, reqs).tokens
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
    logits, tokenizer = model_logits(args.batch)
    shapes = {"model": logits, "flat": torch.randn(args.batch, VOCAB) * 4}
    raw: dict[str, list[float]] = {f"{shape}/{name}": [] for shape in shapes for name in CONFIGS}
    builds: list[float] = []
    for rep in range(args.repeats):
        for shape, logits in shapes.items():
            for name, params in CONFIGS.items():
                sampler = Sampler(VOCAB, torch.device("cpu"), tokenizer)
                # the path every random row took before candidates (and still takes when a cut lies beyond them)
                sampling.CANDIDATES = () if "whole-vocabulary" in name else CANDIDATES
                reqs = requests(args.batch, params, f"{rep}-{shape}-{name}")
                if params.uses_history:  # build every row once, as the first iteration of each request does
                    builds.append(timed_ms(lambda s=sampler, r=reqs: s.counts.rows(r)) / args.batch)
                raw[f"{shape}/{name}"].append(per_iteration_ms(sampler, reqs, logits))
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
    m = machine()
    summary = {
        name: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v), "runs_ms": v}
        for name, v in raw.items()
    }

    command = "python -m bench.kernels.sampler_cost " + " ".join(sys.argv[1:])
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
    ]
    cells = []
    for key, s in summary.items():
        shape, name = key.split("/", 1)
        base_ms = summary[f"{shape}/greedy"]["median_ms"]
        spread = f"{s['median_ms']:.2f} [{s['min_ms']:.2f}–{s['max_ms']:.2f}]"
        cells.append([shape, name, spread, f"{s['median_ms'] / base_ms:.1f}×"])
    lines += table(["logits", "sampling", "ms per iteration", "vs greedy"], cells, "llrr")
    lines += [
        "",
        f"Building one request's token-count row (512 prompt + 256 generated tokens), once per request: "
        f"{doc['row_build_ms_per_request']:.3f} ms.",
        "",
        "Everything on = presence, frequency and repetition penalties, an 8-entry logit_bias, min-p 0.05, "
        "top-k 50, top-p 0.95, temperature 0.8, in steady state (rows built, one scatter per iteration). "
        "Logits: model = the embedded SmolLM2's after 64 prefixes of an English paragraph; "
        "flat = Gaussian, sd 4 (top-p 0.95 then needs over a thousand tokens).",
    ]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
