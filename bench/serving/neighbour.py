"""A busy neighbour for a benchmark's trials: another process on the machine
that copies memory a share of the time, as a tenant or a sidecar would.

Issue 50 asks how much capacity a modest neighbour costs: on 2 cores the
engine's compute thread, the gateway and the load client already share the
machine, and a neighbour takes both some of a core and some of the memory
bandwidth the decode steps live on. ``duty`` is the share of wall time it
works: each 100 ms it copies a 64 MiB buffer over and over for ``duty`` of
them, then sleeps the rest.

    with neighbour(0.25):
        ...  # a trial

    .venv/bin/python -m bench.serving.neighbour 0.25   # the neighbour itself, until killed
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from bench.servers import ROOT

PERIOD_S = 0.1
BUFFER = 64 << 20  # twice the largest L3 of the machines so far (32 MiB): every copy goes to memory


@contextmanager
def neighbour(duty: float) -> Iterator[subprocess.Popen[bytes] | None]:
    """A neighbour working ``duty`` of the time while the block runs (none at 0)."""
    if not 0 <= duty <= 1:
        raise ValueError(f"the neighbour's duty is a share of the time, 0 to 1 (got {duty})")
    if duty == 0:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-m", "bench.serving.neighbour", str(duty)], cwd=ROOT)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def work(duty: float) -> None:
    """Copy memory ``duty`` of every period and sleep the rest, until killed."""
    src, dst = bytes(BUFFER), bytearray(BUFFER)
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < duty * PERIOD_S:
            dst[:] = src
        time.sleep(max(0.0, PERIOD_S - (time.perf_counter() - start)))


if __name__ == "__main__":
    work(float(sys.argv[1]))
