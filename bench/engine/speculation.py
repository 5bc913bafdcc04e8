"""Speculative decoding by prompt lookup on the real model, on against off, side by side.

    .venv/bin/python -m bench.engine.speculation [--repeats 3] [--streams 1,8,32]

Three workloads over the embedded model's chat template: ``edit`` (rename a
variable in a given Python function, reply with the whole function),
``quote`` (summarise a paragraph quoting its sentences) and ``chat``
(questions whose answers echo nothing). Each runs at every stream count
with ``speculate`` off and ``ngram``, alternating (off, on, off, on, ...),
on one engine with one torch thread, its cost model as ``stallfree serve
--speculate ngram`` finds it (the profile saved for this model, dtype and
thread count, else one measured now) corrected online, greedy, up to ``--max-tokens`` tokens each, ending where
the model ends. A run keeps that many streams busy for ``--seconds`` of
engine time; tokens/s counts every token they got over it (prefills of the
replacing requests included: a request that ends sooner lets the next one
in sooner); tokens per step is what a decode yielded per iteration. Also
reported: how many prompts got the same tokens both ways. Writes a new bench/results/speculation-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.record import dated, describe, machine, table
from stallfree.core.build import ModelSettings, engine_over, load_runner, startup_profile
from stallfree.core.sched.config import SchedulerConfig
from stallfree.core.sched.engine import Engine
from stallfree.core.sched.request import Request, SamplingParams

FUNCTIONS = [
    '''def moving_average(values, window):
    """Return the moving averages of values over a sliding window."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = 0.0
    averages = []
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            averages.append(total / window)
    return averages
''',
    '''def word_counts(text, stop_words=()):
    """Count how often each word occurs in text, ignoring case and stop words."""
    total = {}
    for raw in text.split():
        word = raw.strip(".,;:!?\\"'()").lower()
        if not word or word in stop_words:
            continue
        total[word] = total.get(word, 0) + 1
    return dict(sorted(total.items(), key=lambda item: -item[1]))
''',
    '''def merge_intervals(intervals):
    """Merge overlapping (start, end) intervals and return them sorted."""
    total = []
    for start, end in sorted(intervals):
        if total and start <= total[-1][1]:
            total[-1] = (total[-1][0], max(total[-1][1], end))
        else:
            total.append((start, end))
    return total
''',
    '''def parse_config(lines):
    """Parse key = value lines into a dict, skipping blanks and # comments."""
    total = {}
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise ValueError(f"line {number}: expected key = value")
        key, value = line.split("=", 1)
        total[key.strip()] = value.strip()
    return total
''',
]

PARAGRAPHS = [
    "The lighthouse stood on a rock a mile from the shore. Every night its keeper climbed the ninety steps "
    "to light the lamp. Ships passing in the fog relied on its beam to find the harbour. In the winter of "
    "1887 a storm cut the island off for six weeks, and the keeper kept the light burning with the last of his oil.",
    "Bees communicate the location of flowers through a waggle dance. The angle of the dance shows the "
    "direction of the food relative to the sun. The length of the waggle shows the distance. Other bees "
    "follow the dancer, learn the route, and fly straight to the flowers.",
    "The city built its first tram line in 1895. The trams ran on electricity from a small power station by "
    "the river. Within ten years the network had grown to twelve lines. After the war the trams were "
    "replaced by buses, and the last line closed in 1957.",
    "Bread dough rises because yeast eats sugar and releases carbon dioxide. The gas is trapped by a network "
    "of gluten formed when flour is kneaded with water. Warmth speeds the yeast up, and salt slows it down. "
    "Baking kills the yeast and sets the structure.",
]

QUESTIONS = [
    "What are three good habits for learning a new language?",
    "Why is the sky blue? Explain briefly.",
    "Give me some ideas for a rainy weekend afternoon.",
    "What should I pack for a three-day hiking trip?",
    "How do I make a cup of tea properly?",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery and explain it.",
    "How can I sleep better at night?",
]


def messages(workload: str, i: int) -> list[dict[str, str]]:
    if workload == "edit":
        code = FUNCTIONS[i % len(FUNCTIONS)]
        text = (
            "Rename the variable `total` to `result` in this Python function. Reply with the whole function "
            f"only.\n\n```python\n{code}```"
        )
    elif workload == "quote":
        text = f"Summarise this text, quoting its sentences exactly:\n\n{PARAGRAPHS[i % len(PARAGRAPHS)]}"
    else:
        text = QUESTIONS[i % len(QUESTIONS)]
    return [{"role": "user", "content": f"(request {i}) {text}"}]


def run(engine: Engine, pool: list[list[int]], streams: int, seconds: float, max_tokens: int) -> dict:
    """``streams`` requests kept in flight for ``seconds`` (a finished one is replaced
    by the pool's next prompt): the tokens they got over the engine's time, and
    each pool prompt's first complete output."""
    tag = time.perf_counter_ns()
    served = 0
    live: dict[str, tuple[int, Request]] = {}  # request id -> (pool index, request)

    def submit() -> None:
        nonlocal served
        i = served % len(pool)
        req = Request(f"r{tag}-{served}", pool[i], SamplingParams(max_tokens=max_tokens), time.perf_counter_ns())
        engine.add_request(req)
        live[req.request_id] = (i, req)
        served += 1

    for _ in range(streams):
        submit()
    tokens = steps = drafts = accepted = declined = 0
    elapsed = 0.0
    outputs: dict[int, list[int]] = {}
    while elapsed < seconds:
        out = engine.step()
        if out is None:
            continue
        it = out.iteration
        if it is not None:
            elapsed += it.duration_ns / 1e9
            steps += it.decode_tokens - it.draft_tokens
            drafts += it.draft_tokens
            accepted += it.accepted_tokens
            declined += it.drafts_declined
        for o in out.outputs:
            tokens += len(o.new_token_ids)
            if o.request is not None:
                i, req = live.pop(o.request_id)
                outputs.setdefault(i, req.output_token_ids)
                submit()
    for rid in list(live):
        engine.abort_request(rid)
    while engine.has_work:
        engine.step()
    return {
        "tokens_per_s": tokens / elapsed,
        "tokens_per_step": (steps + accepted) / steps if steps else 0.0,
        "acceptance": accepted / drafts if drafts else 0.0,
        "draft_tokens": drafts,
        "drafts_declined": declined,
        "requests_finished": len(outputs),
        "outputs": outputs,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--workloads", default="edit,quote,chat")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=15.0, help="engine time per run")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--profile", type=Path, help="the cost model (default: as serve finds or measures it)")
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    workloads = args.workloads.split(",")
    runner = load_runner(ModelSettings(dtype=args.dtype, threads=1))
    # as `stallfree serve --speculate ngram` does: the saved profile, else one measured now
    profile, profile_source = startup_profile(runner, args.profile, measure=True)
    engine = engine_over(runner, SchedulerConfig(token_budget=2048, max_num_seqs=64), profile)
    torch.set_num_threads(1)
    tok = runner.tokenizer
    pools = {w: [tok.encode(tok.render_chat(messages(w, i))) for i in range(64)] for w in workloads}
    raw: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        for w in workloads:
            for n in streams:
                for mode in ("off", "ngram"):
                    engine.reconfigure({"speculate": mode})
                    got = run(engine, pools[w], n, args.seconds, args.max_tokens)
                    raw.setdefault(f"{w}/{n}/{mode}", []).append(got)
                print(f"repeat {rep + 1}/{args.repeats}: {w} done", file=sys.stderr)
    rows, results = [], {}
    for w in workloads:
        for n in streams:
            off, on = raw[f"{w}/{n}/off"], raw[f"{w}/{n}/ngram"]
            ratios = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(off, on, strict=True)]
            both = [
                (x, y)
                for a, b in zip(off, on, strict=True)
                for i, x in a["outputs"].items()
                if (y := b["outputs"].get(i)) is not None
            ]
            same = sum(x == y for x, y in both)
            # the calibration: off against off in the next repeat (other requests beside it)
            again = [
                (x, y)
                for a, b in itertools.pairwise(off)
                for i, x in a["outputs"].items()
                if (y := b["outputs"].get(i)) is not None
            ]
            same_off = sum(x == y for x, y in again)
            r = {
                "off_tokens_per_s": statistics.median(x["tokens_per_s"] for x in off),
                "on_tokens_per_s": statistics.median(x["tokens_per_s"] for x in on),
                "ratio": statistics.median(ratios),
                "ratio_range": [min(ratios), max(ratios)],
                "acceptance": statistics.median(x["acceptance"] for x in on),
                "tokens_per_step": statistics.median(x["tokens_per_step"] for x in on),
                "draft_tokens": statistics.median(x["draft_tokens"] for x in on),
                "drafts_declined": statistics.median(x["drafts_declined"] for x in on),
                "same_outputs": f"{same}/{len(both)}",
                "same_outputs_off_off": f"{same_off}/{len(again)}",
            }
            results[f"{w}/{n}"] = r
            rows.append(
                [
                    w,
                    n,
                    f"{r['off_tokens_per_s']:.1f}",
                    f"{r['on_tokens_per_s']:.1f}",
                    f"**{r['ratio']:.2f}×** [{r['ratio_range'][0]:.2f}–{r['ratio_range'][1]:.2f}]",
                    f"{r['acceptance']:.0%}",
                    f"{r['tokens_per_step']:.2f}",
                    f"{r['draft_tokens']:.0f} / {r['drafts_declined']:.0f}",
                    r["same_outputs"],
                    r["same_outputs_off_off"],
                ]
            )
    for runs in raw.values():
        for x in runs:
            x["outputs"] = len(x["outputs"])
    m = machine()
    command = "python -m bench.engine.speculation " + " ".join(sys.argv[1:])
    doc = {
        "command": command.strip(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": m,
        "model": runner.config.name,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "threads": 1,
        "cost_model": profile_source,
        "max_tokens": args.max_tokens,
        "results": results,
        "runs": raw,
    }
    base = dated("speculation")
    base.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    header = [
        "workload",
        "streams",
        "off tokens/s",
        "ngram tokens/s",
        "on / off [min–max]",
        "drafts kept",
        "tokens/step",
        "drafts verified / decodes declined",
        "same tokens off/on",
        "off/off",
    ]
    lines = [
        f"# Speculative decoding by prompt lookup ({runner.config.name}, {doc['dtype']}, 1 thread)",
        "",
        f"`{doc['command']}` on {describe(m)}, {doc['date']}; cost model: `{profile_source}`, corrected online. "
        "Each run keeps that many streams busy for "
        f"{args.seconds:.0f} s of engine time (a finished request is replaced by the next prompt of the "
        f"workload); tokens/s: the tokens they got over that time, prefill iterations included. Medians of "
        f"{args.repeats} runs, off and on alternating; greedy, up to {args.max_tokens} tokens, ending where "
        "the model ends. Drafts verified and decodes declined (by the cost rule) per run, medians. Same "
        "tokens: prompts whose first complete output was identical off and on; off/off: the same between "
        "the off runs of consecutive repeats, where only the requests batched beside it differ (bf16 "
        "kernels round a row differently with the batch's shape; a verification runs as a chunk).",
        "",
        *table(header, rows, "lrrrrrrrrr"),
    ]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
