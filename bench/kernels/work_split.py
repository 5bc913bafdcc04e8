"""How the CPU kernels split a step's work over many threads, on paper: the
machines here have 2 cores, the machines stallfree runs on 8 to 64.

    .venv/bin/python -m bench.kernels.work_split [--threads 8,16,64]

For the embedded model's shapes and each thread count: every op of a decode
step (8, 32 and 64 streams) and of a 512- and a 248-token chunk (budget
256's beside 8 decodes), its work items (the
units the kernel's parallel loop hands out, by the rule its kernel uses), how
many each thread runs, how many threads run none, and the largest imbalance:
the busiest thread's work over the mean (1.0: even; equal-cost items, except
attention, whose items are weighed by the keys they read). Since 2026-12-07
the loop (``kernels/csrc/parallel.h``) gives each thread a share to start on
and lets a thread whose share is done take the next items of the others'
(each thread's in turn from its own): simulated here item by item, every
thread present. The rules, from ``kernels/csrc``:

- ``gemm_dot`` (bf16 linear layers, AVX512-BF16): panels of rows (as many as
  keep a panel's activations within 256 kB, their rows equal) x blocks of 32
  output columns; equal shares, thread s's from item s * items / threads.
- the head, for rows that want only their argmax (4 or more without AMX, 16
  with): the bf16 screen's blocks of 64 columns x blocks of 32 rows, equal
  shares, then the rechecks a row each (a few dozen entries a row; not listed).
- attention: a decode is one item (every KV head), or one per KV head when
  there are fewer decodes than twice the threads; a chunk is row tiles (at
  most 256 rows with AMX's brgemm; on several threads cut smaller, down to 32
  rows, until tiles x KV heads is a multiple of the threads or at least four
  a thread) x KV heads; items are dealt to the threads' shares by cost
  (LPT), cost = query vectors x keys seen. Contexts here are uneven: 64 to
  4,096 tokens, spread geometrically.
- element-wise ops: items of 16 rows, equal shares.

Writes bench/results/work_split-<date>.{json,md}; nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import math

from bench.record import dated, describe, machine, table
from stallfree.core.model.embedded import embedded_model_path
from stallfree.core.model.gguf import GGUFFile
from stallfree.core.model.loader import gguf_config

NB = 32  # output columns per block (gemm_dot)
DOT_ROWS, PANEL_BYTES = 14, 256 << 10
SCREEN_COLS, SCREEN_ROWS = 64, 32  # the screened head's blocks (screen.cpp)
TILE_ROWS = 768  # query vectors per prefill tile (AMX brgemm, bf16), divided by the group below
MIN_TILE_ROWS = 32  # a chunk's tiles are cut no smaller to deal evenly


def chunk_tile_rows(chunk: int, most: int, kv_heads: int, threads: int) -> int:
    """attention.cpp's chunk_tile_rows: rows per tile of a chunk."""
    tiles = -(-chunk // most)
    cap = max(tiles, chunk // MIN_TILE_ROWS)
    while tiles < cap and (tiles * kv_heads) % threads and tiles * kv_heads < 4 * threads:
        tiles += 1
    return -(-chunk // tiles)


def taken(shares: list[list[float]], threads: int) -> tuple[list[float], list[float]]:
    """parallel.h's loop, item by item: each thread runs its own share in order,
    then the next items of the others' (thread t's from share t + 1 on); the
    thread free first takes next. Each thread's work, and its items."""
    left = [list(reversed(s)) for s in shares]  # popped from the end: each share's front
    clock, loads, counts = [0.0] * threads, [0.0] * threads, [0.0] * threads
    while any(left):
        t = clock.index(min(clock))
        for k in range(len(shares)):
            share = left[(t + k) % len(shares)]
            if share:
                cost = share.pop()
                clock[t] += cost
                loads[t] += cost
                counts[t] += 1
                break
    return loads, counts


def equal_shares(costs: list[float], threads: int) -> list[list[float]]:
    """Thread s's share: items s * n / shares up to (s + 1) * n / shares."""
    n = len(costs)
    shares = max(1, min(threads, n))
    return [costs[s * n // shares : (s + 1) * n // shares] for s in range(shares)]


def lpt(costs: list[float], threads: int) -> list[list[float]]:
    """Longest first, to the least loaded (the attention kernel's ``deal``): each thread's share."""
    shares: list[list[float]] = [[] for _ in range(min(threads, len(costs)))]
    loads = [0.0] * len(shares)
    for c in sorted(costs, reverse=True):
        i = loads.index(min(loads))
        loads[i] += c
        shares[i].append(c)
    return shares


def gemm_items(rows: int, k: int, n: int) -> int:
    most = max(DOT_ROWS, PANEL_BYTES // (2 * k) // DOT_ROWS * DOT_ROWS)
    return math.ceil(rows / most) * (n // NB)


def row(op: str, loads: list[float], counts: list[float], items: int) -> dict[str, object]:
    """``loads``: each thread's work; ``counts``: its items."""
    mean = sum(loads) / len(loads)
    busy = sum(1 for x in loads if x)
    return {
        "op": op,
        "items": items,
        "per_thread": f"{min(counts):g}-{max(counts):g}" if items else "0",
        "idle_threads": len(loads) - busy,
        "imbalance": round(max(loads) / mean, 2) if mean else None,
    }


def contexts(n: int) -> list[int]:
    return [round(64 * (4096 / 64) ** (i / max(1, n - 1))) for i in range(n)]


def step(cfg, threads: int, streams: int, chunk: int) -> list[dict[str, object]]:
    """The ops of one iteration: ``streams`` decodes, or (streams 0) one ``chunk``-token chunk after 1,536."""
    h, f, kvh, g = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    qkv = (cfg.num_heads + 2 * kvh) * cfg.head_dim
    rows = streams or chunk
    out = []
    for name, k, n in (("qkv", h, qkv), ("o", cfg.num_heads * cfg.head_dim, h), ("gate_up", h, 2 * f), ("down", f, h)):
        items = gemm_items(rows, k, n)
        out.append(row(f"linear {name} ({k}x{n})", *even(items, threads), items))
    if streams:
        head_items = cfg.vocab_size // SCREEN_COLS * math.ceil(streams / SCREEN_ROWS)
        out.append(row(f"head, bf16 screen ({h}x{cfg.vocab_size})", *even(head_items, threads), head_items))
        split = streams < 2 * threads
        costs = [c * (1 if split else kvh) * g for c in contexts(streams) for _ in range(kvh if split else 1)]
        loads, counts = taken(lpt(costs, threads), threads)
        out.append(row("attention, decodes" + (" (by KV head)" if split else ""), loads, counts, len(costs)))
    else:
        tile = chunk_tile_rows(chunk, max(1, TILE_ROWS // g), kvh, threads)
        costs = [
            min(tile, chunk - r) * g * (1536 + r + min(tile, chunk - r) / 2)
            for r in range(0, chunk, tile)
            for _ in range(kvh)
        ]
        loads, counts = taken(lpt(costs, threads), threads)
        out.append(row(f"attention, {chunk}-token chunk after 1,536", loads, counts, len(costs)))
    sixteens = [float(min(16, rows - r)) for r in range(0, rows, 16)]
    loads, counts = taken(equal_shares(sixteens, threads), threads)
    out.append(row("element-wise (items of 16 rows)", loads, counts, len(sixteens)))
    return out


def even(items: int, threads: int) -> tuple[list[float], list[float]]:
    """Equal-cost items in equal shares, taken: each thread's work and its items."""
    return taken(equal_shares([1.0] * items, threads), threads)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="8,16,64")
    args = ap.parse_args()
    cfg = gguf_config(GGUFFile(embedded_model_path()))
    shapes = [(8, 0), (32, 0), (64, 0), (0, 512), (0, 248)]
    results = {
        t: {(f"decode, {s} streams" if s else f"a {c}-token chunk"): step(cfg, t, s, c) for s, c in shapes}
        for t in (int(x) for x in args.threads.split(","))
    }
    m = machine()
    out = dated("work_split")
    command = "python -m bench.kernels.work_split --threads " + args.threads
    out.with_suffix(".json").write_text(
        json.dumps({"command": command, "model": cfg.name, "results": results}, indent=1)
    )
    lines = [
        f"# How a step's work splits over many threads ({cfg.name})",
        "",
        f"`{command}`, on paper (nothing timed; written on {describe(m)}). Per thread: items each thread",
        "gets; imbalance: the busiest thread's work over the mean.",
    ]
    for t, by_shape in results.items():
        for shape, ops in by_shape.items():
            lines += ["", f"## {t} threads, {shape}", ""]
            body = [(o["op"], o["items"], o["per_thread"], o["idle_threads"], o["imbalance"]) for o in ops]
            lines += table(["op", "items", "per thread", "idle threads", "imbalance"], body, "lrrrr")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
