"""Greedy agreement of the kernel paths: native vs reference, in bf16 and fp32,
each against the fp32 reference, on the embedded model.

    .venv/bin/python -m bench.accuracy.greedy_agreement [--tokens 32]

bf16 rounds differently on each path (the reference rounds softmax
probabilities to bf16 before P.V; the native kernels keep them in fp32), so
bf16 outputs diverge after a while; the question is which stays closer to
fp32. Writes a new bench/results/greedy_agreement-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.record import dated, describe, machine, table
from stallfree import kernels
from stallfree.core.model.loader import load_model
from stallfree.core.model.model_runner import ModelRunner
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.engine import Engine
from stallfree.core.sched.request import Request, SamplingParams
from stallfree.kernels import reference

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time,",
    "Water boils at",
    "The three primary colors are",
    "List the planets of the solar system:",
    "Translate to French: good morning",
    "2 + 2 =",
]


def greedy(runner: ModelRunner, prompt: list[int], steps: int, token_budget: int = 64) -> list[int]:
    """``steps`` greedy tokens after ``prompt``, chunked at ``token_budget``."""
    engine = Engine(SchedulerConfig(token_budget=token_budget, max_model_len=1024), CacheConfig(128, 16), runner)
    req = Request("g", prompt, SamplingParams(max_tokens=steps, ignore_eos=True), 0)
    engine.add_request(req)
    while engine.has_work:
        engine.step()
    return list(req.output_token_ids)


def agreement(outputs: list[list[int]], truth: list[list[int]]) -> dict[str, int]:
    """How many greedy sequences equal the truth's, and how many token positions."""
    pairs = list(zip(outputs, truth, strict=True))
    return {
        "identical_sequences": sum(a == b for a, b in pairs),
        "equal_positions": sum(x == y for a, b in pairs for x, y in zip(a, b, strict=True)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    loaded = load_model(None)
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    native = kernels.native_cpu()
    if native is None:
        sys.exit(f"the native kernels are not available here: {kernels.backend(torch.device('cpu'))}")
    outputs: dict[str, list[list[int]]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        runner = ModelRunner(loaded, 128, 16, dtype, torch.device("cpu"))
        for name, module in (("native", native), ("reference", reference)):
            with kernels.cpu_path(module):
                outputs[f"{str(dtype).removeprefix('torch.')} {name}"] = [
                    greedy(runner, p, args.tokens) for p in prompts
                ]
    truth = outputs["float32 reference"]
    rows = [{"path": name, **agreement(outs, truth)} for name, outs in outputs.items()]
    m = machine()
    command = f"python -m bench.accuracy.greedy_agreement {' '.join(sys.argv[1:])}".strip()
    base = dated("greedy_agreement")
    base.with_suffix(".json").write_text(json.dumps({"command": command, "machine": m, "rows": rows}, indent=2))
    n = len(prompts)
    lines = [
        "# Greedy agreement with the fp32 reference path (embedded SmolLM2-135M)",
        "",
        f"`{command}` on {describe(m)}: {n} prompts, {args.tokens} greedy tokens each, chunked at budget 64.",
        "",
    ]
    cells = [[r["path"], f"{r['identical_sequences']}/{n}", f"{r['equal_positions']}/{n * args.tokens}"] for r in rows]
    lines += table(["path", "sequences identical to fp32 reference", "token positions equal"], cells, "lrr")
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
