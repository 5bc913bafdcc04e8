"""The embedded model's head at decode sizes: the float32 head whole (its
compact copy up to 64 rows, oneDNN beyond) against the screened head
(kernels.screened_head: a bf16 screen on AMX, float32 rechecks), which rows
that want only their argmax take.

    .venv/bin/python -m bench.kernels.head [--repeats 9] [--threads 1,2]

Rows are real final hidden states (the model's own, for prompts of the
embedded tokenizer's words), so the number of entries rechecked is the one a
decode meets. Both paths alternate call by call; thread counts alternate
within each repeat; medians [min–max] and speed-up = whole / screened per
call pair. Writes a new bench/results/head-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench.record import dated, describe, machine, table
from stallfree import kernels
from stallfree.core.model.llama import LlamaModel
from stallfree.core.model.loader import load_model
from stallfree.kernels.attention_meta import build_attention_meta

ROWS = (1, 4, 8, 16, 32, 64)


def hidden_states(model: LlamaModel, rows: int, vocab: int) -> torch.Tensor:
    """The final normed hidden state after each of ``rows`` prompts of 48 random tokens."""
    gen = torch.Generator().manual_seed(rows)
    cfg = model.config
    out = []
    captured: list[torch.Tensor] = []

    def head(x: torch.Tensor, argmax_only: torch.Tensor | None) -> torch.Tensor:
        captured.append(x.clone())
        return x

    model._head = head  # type: ignore[method-assign]
    blocks = 4
    shape = (cfg.num_layers, blocks, 16, cfg.num_kv_heads, cfg.head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    for _ in range(rows):
        ids = torch.randint(100, vocab, (48,), generator=gen)
        meta = build_attention_meta([list(range(blocks))], [48], [48], 0, 16, torch.device("cpu"))
        model.forward(ids, meta.positions, meta, k_cache, v_cache, torch.tensor([47]))
        out.append(captured.pop())
    del model._head
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    loaded = load_model()
    model = LlamaModel(loaded.config, loaded.weights, torch.bfloat16, torch.device("cpu"), loaded.quantized)
    if model.screen is None:
        sys.exit("the screened head does not run here (it needs oneDNN's bf16 brgemm: AMX)")
    states = hidden_states(model, max(ROWS), loaded.config.vocab_size)
    head, screen = model.lm_head, model.screen
    paths = {"whole": lambda x: kernels.linear(head, x), "screened": screen}
    results = []
    for rows in ROWS:
        x = states[:rows].contiguous()
        times: dict[tuple[int, str], list[float]] = {}
        for rep in range(args.repeats + 1):  # the first of each warms up
            for t in threads:
                torch.set_num_threads(t)
                for name, call in paths.items():
                    start = time.perf_counter()
                    call(x)
                    if rep:
                        times.setdefault((t, name), []).append(time.perf_counter() - start)
        whole = kernels.linear(head, x)
        got, rechecked = screen.logits(x)
        same = bool(torch.equal(got.argmax(1), whole.argmax(1)))
        for t in threads:
            a, b = times[(t, "whole")], times[(t, "screened")]
            ratios = [p / q for p, q in zip(a, b, strict=True)]
            results.append(
                {
                    "rows": rows,
                    "threads": t,
                    "whole_ms": [statistics.median(a) * 1e3, min(a) * 1e3, max(a) * 1e3],
                    "screened_ms": [statistics.median(b) * 1e3, min(b) * 1e3, max(b) * 1e3],
                    "speedup": [statistics.median(ratios), min(ratios), max(ratios)],
                    "entries_rechecked_per_row": rechecked / rows,
                    "same_argmax": same,
                }
            )
            r = results[-1]
            print(f"{rows} rows, {t} threads: {r['speedup'][0]:.2f}x", file=sys.stderr, flush=True)
    m = machine()
    command = f"python -m bench.kernels.head {' '.join(sys.argv[1:])}".strip()
    base = dated("head")
    base.with_suffix(".json").write_text(json.dumps({"command": command, "machine": m, "rows": results}, indent=2))

    def ms(v: list[float]) -> str:
        return f"{v[0]:.2f} [{v[1]:.2f}–{v[2]:.2f}]"

    cells = [
        [
            r["rows"],
            r["threads"],
            ms(r["whole_ms"]),
            ms(r["screened_ms"]),
            f"{r['speedup'][0]:.2f}× [{r['speedup'][1]:.2f}–{r['speedup'][2]:.2f}]",
            f"{r['entries_rechecked_per_row']:.1f}",
            "yes" if r["same_argmax"] else "**no**",
        ]
        for r in results
    ]
    lines = [
        "# The head at decode sizes: float32 whole vs the bf16 screen with float32 rechecks",
        "",
        f"`{command}` on {describe(m)}; embedded model ({loaded.config.vocab_size:,} entries); rows are the "
        f"model's own final hidden states; medians of {args.repeats} alternating calls [min–max]; "
        "speed-up = whole / screened per call pair.",
        "",
        *table(
            ["rows", "threads", "whole ms", "screened ms", "speed-up", "entries rechecked a row", "same argmax"],
            cells,
            "rrrrrrc",
        ),
    ]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
