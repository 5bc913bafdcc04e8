"""Accuracy of each compute mode against float32: perplexity on a fixed English
text and greedy agreement, on the embedded model with the native kernels.

    .venv/bin/python -m bench.accuracy.compute_modes [--tokens 32]

Modes: float32; float32 with a bf16 KV cache (``--kv-dtype bf16``: attention
in bf16); bf16 (its head and residual-stream GEMMs in float32); int8
(``--compute int8``: prefill chunks' GEMMs in int8), alone and with a bf16 KV
cache, where the CPU has an int8 brgemm. The text, bench/accuracy/english.txt, is the first 15,079 characters
of the GNU GPL version 3 as Debian ships it (/usr/share/common-licenses/GPL-3;
verbatim copies are permitted): English prose, fixed, in the repository.
Perplexity: non-overlapping 1,024-token windows, each prefilled as two
512-token chunks (the second over the first's cached KV), every next token
scored. Greedy: 8 short prompts and 4 excerpts of 300 text tokens (long
enough that int8 runs), ``--tokens`` greedy tokens each at budget 512.
Writes a new bench/results/compute_modes-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from bench.accuracy.greedy_agreement import PROMPTS, agreement, greedy
from bench.record import dated, describe, machine, table
from stallfree.core.model.loader import LoadedModel, load_model
from stallfree.core.model.model_runner import ModelRunner
from stallfree.kernels import build_attention_meta, linear_int8_available, native_cpu

TEXT = Path(__file__).with_name("english.txt")
WINDOW, CHUNK, BLOCK = 1024, 512, 16
CPU = torch.device("cpu")


# mode -> (dtype, --compute, KV cache dtype)
MODES = {
    "float32": (torch.float32, "float", torch.float32),
    "float32, bf16 KV": (torch.float32, "float", torch.bfloat16),
    "bf16": (torch.bfloat16, "float", torch.bfloat16),
    "int8": (torch.float32, "int8", torch.float32),
    "int8, bf16 KV": (torch.float32, "int8", torch.bfloat16),
}


def runner_for(loaded: LoadedModel, mode: str) -> ModelRunner:
    dtype, compute, kv_dtype = MODES[mode]
    return ModelRunner(loaded, 128, BLOCK, dtype, CPU, compute, kv_dtype)


def perplexity(runner: ModelRunner, ids: list[int]) -> tuple[float, int]:
    """exp(mean NLL of every next token), over whole windows; and the tokens scored."""
    nll, scored = 0.0, 0
    table_ = list(range(WINDOW // BLOCK))
    for w0 in range(0, len(ids) - WINDOW + 1, WINDOW):
        window = ids[w0 : w0 + WINDOW]
        for c0 in range(0, WINDOW, CHUNK):
            chunk = window[c0 : c0 + CHUNK]
            meta = build_attention_meta([table_[: (c0 + CHUNK) // BLOCK]], [c0 + CHUNK], [CHUNK], 0, BLOCK, CPU)
            logits = runner.model.forward(
                torch.tensor(chunk), meta.positions, meta, runner.k_cache, runner.v_cache, torch.arange(CHUNK)
            )
            targets = torch.tensor(window[c0 + 1 : c0 + CHUNK + 1])
            logp = torch.log_softmax(logits[: len(targets)].double(), -1)
            nll -= logp.gather(1, targets[:, None]).sum().item()
            scored += len(targets)
    return math.exp(nll / scored), scored


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if native_cpu() is None:
        sys.exit("the native kernels are not available here")
    loaded = load_model(None)
    ids = loaded.tokenizer.encode(TEXT.read_text())
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS] + [ids[i * 300 : (i + 1) * 300] for i in range(4)]
    modes = [m for m in MODES if MODES[m][1] == "float" or linear_int8_available()]
    results = {}
    for mode in modes:
        runner = runner_for(loaded, mode)
        ppl, scored = perplexity(runner, ids)
        outs = [greedy(runner, p, args.tokens, token_budget=512) for p in prompts]
        results[mode] = {"perplexity": ppl, "tokens_scored": scored, "outputs": outs}
        print(f"{mode}: perplexity {ppl:.4f} over {scored} tokens", file=sys.stderr, flush=True)
    truth = results["float32"]["outputs"]
    for r in results.values():
        r.update(agreement(r["outputs"], truth))
    m = machine()
    command = f"python -m bench.accuracy.compute_modes {' '.join(sys.argv[1:])}".strip()
    base = dated("compute_modes")
    base.with_suffix(".json").write_text(json.dumps({"command": command, "machine": m, "results": results}, indent=2))
    n = len(prompts)
    lines = [
        "# Accuracy per compute mode against float32 (embedded SmolLM2-135M, native kernels)",
        "",
        f"`{command}` on {describe(m)}, {args.threads} thread(s). Perplexity on bench/accuracy/english.txt "
        f"({results['float32']['tokens_scored']} tokens scored, 1,024-token windows in 512-token chunks); greedy "
        f"agreement on {n} prompts ({n - 4} short, 4 of 300 text tokens), {args.tokens} tokens each, budget 512.",
        "",
    ]
    base_ppl = results["float32"]["perplexity"]
    cells = [
        [
            mode,
            f"{r['perplexity']:.4f}",
            f"{(r['perplexity'] / base_ppl - 1) * 100:+.2f}%",
            f"{r['identical_sequences']}/{n}",
            f"{r['equal_positions']}/{n * args.tokens}",
        ]
        for mode, r in results.items()
    ]
    lines += table(
        ["mode", "perplexity", "vs float32", "greedy sequences identical to float32", "token positions equal"],
        cells,
        "lrrrr",
    )
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
