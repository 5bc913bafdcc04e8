"""Where a benchmark writes its result: a new dated file, never over an old one,
with the facts about the machine that made it (CPU, instruction set, AMX), and
its markdown tables, all written one way (``table``)."""

from __future__ import annotations

import datetime as dt
import os
import platform
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from bench.servers import OUT
from stallfree.kernels import backend, cpu_build


def machine() -> dict[str, object]:
    model = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines() if line.startswith("model name")),
        platform.processor() or "unknown",
    )
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "kind": cpu_build.kind(),
        # a kind this machine is not, approximated: stallfree's ISA forced, oneDNN's capped
        "emulated": {v: os.environ[v] for v in ("STALLFREE_CPU_ISA", "ONEDNN_MAX_CPU_ISA") if os.environ.get(v)},
        "isa": cpu_build.detect_isa(),
        "amx": cpu_build.has_amx(),
        "avx512_bf16": "avx512_bf16" in cpu_build.cpu_flags(),
        "cpu_kernels": backend(torch.device("cpu")),
    }


def describe(m: dict[str, object]) -> str:
    bf16 = "AMX" if m["amx"] else ("AVX-512 BF16" if m["avx512_bf16"] else "no bf16 instructions")
    kind = m.get("kind", m["isa"])
    isa = f"kind {kind}" + (f", build {m['isa']}" if kind != m["isa"] else "")
    emulated = m.get("emulated")
    if isinstance(emulated, dict) and emulated:
        isa += " (a capped emulation: " + ", ".join(f"{k}={v}" for k, v in emulated.items()) + ")"
    return f"{m['cpu']}, {m['cores']} cores, {isa} ({bf16}); stallfree CPU kernels: {m['cpu_kernels']}"


def dated(stem: str) -> Path:
    """bench/results/<stem>-<YYYY-MM-DD>[-N], the first name no file of today
    has taken; add the suffix (.json, .md, .png) to it."""
    OUT.mkdir(parents=True, exist_ok=True)
    day = dt.date.today().isoformat()
    n = 1
    while any(OUT.glob(f"{stem}-{day}{f'-{n}' if n > 1 else ''}.*")):
        n += 1
    return OUT / f"{stem}-{day}{f'-{n}' if n > 1 else ''}"


ALIGN = {"l": "---", "r": "---:", "c": ":---:"}


def table(header: list[str], rows: Iterable[Sequence[object]], align: str) -> list[str]:
    """A markdown table's lines: ``align`` has a letter per column, l(eft),
    r(ight, for numbers) or c(entre); cells are written as given (format them first)."""
    if len(align) != len(header) or set(align) - set(ALIGN):
        raise ValueError(f"align {align!r}: one of l, r, c per column ({len(header)})")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(ALIGN[a] for a in align) + "|"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells for {len(header)} columns: {row!r}")
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return lines


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
