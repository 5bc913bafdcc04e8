"""Running a load: each job sent at its time against a target, and, for servers
that report queue waits only in Prometheus histograms (vLLM), the probe that
reads them before and after a run (``SchedulingDelayProbe``).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from stallfree.loadtest.clients import Result, Target
from stallfree.loadtest.workloads import Arrival


async def run_jobs(
    target: Target,
    jobs: list[Arrival],
    progress: Callable[[int, int], None] | None = None,
    deadline_s: float | None = None,
) -> list[Result]:
    """Send each job at its time; returns results in job order. Jobs still
    running ``deadline_s`` after the start are cancelled (their connections
    closed, so the server aborts them) and count as errors."""
    t0 = time.perf_counter()
    done = 0

    async def one(job: Arrival) -> Result:
        nonlocal done
        await asyncio.sleep(max(0.0, job.at_s - (time.perf_counter() - t0)))
        res = await target.run(job, t0)
        done += 1
        if progress:
            progress(done, len(jobs))
        return res

    # A collection pause in this process would stamp tokens late: gaps the server never
    # made. The cyclic collector waits until the run is over (a long-lived client, such
    # as a capacity search, holds a large heap).
    collecting = gc.isenabled()
    gc.disable()
    try:
        tasks = [asyncio.create_task(one(j)) for j in jobs]
        _, late = await asyncio.wait(tasks, timeout=deadline_s)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
    finally:
        if collecting:
            gc.enable()
    return [
        Result(job, job.at_s, error=f"not done {deadline_s:g} s after the start") if task in late else task.result()
        for job, task in zip(jobs, tasks, strict=True)
    ]


class SchedulingDelayProbe:
    """A server's Prometheus histogram of scheduling delays, read before and
    after a run: the run's median from the difference, interpolated within its
    bucket. vLLM's is its queue time (arrival to first scheduled: a started
    prompt runs on until done), stallfree's its scheduling delay (the same,
    less nothing a paused prompt waited: ``core.sched.timings``). For servers
    that report them nowhere else."""

    NAMES = ("vllm:request_queue_time_seconds", "stallfree_scheduling_delay_seconds")

    def __init__(self, metrics_url: str) -> None:
        self.url = metrics_url
        self._before = self._buckets()

    def _buckets(self) -> dict[float, float]:
        try:
            text = httpx.get(self.url, timeout=10).text
        except httpx.HTTPError:
            return {}
        counts: dict[float, float] = {}
        for family in text_string_to_metric_families(text):
            if family.name not in self.NAMES:
                continue
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    counts[le] = counts.get(le, 0.0) + sample.value
        return counts

    def median_ms(self) -> float | None:
        """The median queue wait of the requests since the probe was made, or None if unreported."""
        after = self._buckets()
        diff = sorted((le, after[le] - self._before.get(le, 0.0)) for le in after)
        total = diff[-1][1] if diff else 0.0
        if total <= 0:
            return None
        low, below = 0.0, 0.0
        for le, count in diff:
            if count >= total / 2:
                if le == float("inf"):
                    return low * 1e3  # beyond the last finite bucket: its bound, a lower limit
                share = (total / 2 - below) / (count - below) if count > below else 1.0
                return (low + (le - low) * share) * 1e3
            low, below = le, count
        return None
