"""Greedy tokens of disaggregated serving against one engine's, per dtype, in
one process (no Ray: only the numerics of the two paths differ).

    .venv/bin/python -m bench.accuracy.disagg_greedy [--dtypes float32,bfloat16 --tokens 24]

Colocated: one engine computes the prompt in chunks (token budget 256) and
samples from its last chunk. Disaggregated: a prefill engine computes it and
exports the KV of all but the last prompt token; a decode engine imports it
and computes that last token as a decode step. Same model, same kernels;
reports, per prompt length, whether the greedy tokens are equal and if not
from which token on they differ.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench.record import dated, describe, machine, table
from stallfree.core.build import ModelSettings, build_engine
from stallfree.core.model.embedded import load_tokenizer
from stallfree.core.model.tokenizer import Tokenizer
from stallfree.core.sched.config import SchedulerConfig
from stallfree.core.sched.engine import Engine
from stallfree.core.sched.handoff import KvHandoff
from stallfree.core.sched.request import Request, SamplingParams
from stallfree.loadtest.workloads import PromptMaker

PROMPTS = (40, 300, 1000, 1999, 2000, 2500)  # tokens: within a block, one chunk, several; block edges


def run(engine: Engine, req: Request) -> Request:
    engine.add_request(req)
    while engine.has_work:
        engine.step()
    return req


def compare(dtype: str, tokens: int, tokenizer: Tokenizer) -> list[dict]:
    config = SchedulerConfig(token_budget=256, max_model_len=4096)
    colocated, prefill, decode = (build_engine(ModelSettings(None, dtype, "cpu", 1, 0.5), config)[0] for _ in "abc")
    rows = []
    for seed, n in enumerate(PROMPTS):
        prompt = tokenizer.encode(PromptMaker(tokenizer, seed)(n))
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        ref = run(colocated, Request("c", prompt, params, 0)).output_token_ids
        head = Request("p", prompt, SamplingParams(max_tokens=1, ignore_eos=True), 0)
        head.handoff = KvHandoff(export=True)
        run(prefill, head)
        tail = Request("d", prompt, params, 0)
        tail.handoff = KvHandoff(imported_tokens=len(prompt) - 1, payload=head.handoff.payload)
        got = run(decode, tail).output_token_ids
        first = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), None)
        rows.append({"dtype": dtype, "prompt_tokens": len(prompt), "equal": ref == got, "first_difference": first})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    tokenizer = load_tokenizer()
    rows = [r for dtype in args.dtypes.split(",") for r in compare(dtype, args.tokens, tokenizer)]
    m = machine()
    command = ("python -m bench.accuracy.disagg_greedy " + " ".join(sys.argv[1:])).strip()
    base = dated("disagg_greedy")
    base.with_suffix(".json").write_text(json.dumps({"command": command, "machine": m, "rows": rows}, indent=2))
    lines = [
        f"# Greedy tokens ({args.tokens}), disaggregated (KV imported) vs one engine, embedded SmolLM2, 1 thread",
        "",
        f"`{command}` on {describe(m)}.",
        "",
        *table(
            ["dtype", "prompt tokens", "equal", "first differing token"],
            [
                [
                    r["dtype"],
                    f"{r['prompt_tokens']:,}",
                    "yes" if r["equal"] else "no",
                    "" if r["first_difference"] is None else r["first_difference"],
                ]
                for r in rows
            ],
            "lrlr",
        ),
        "",
    ]
    base.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
