"""Load generation: workloads, two client protocols, and per-token arrival times.

A ``Arrival`` is one request to send at ``at_s``; a target (this server over
WebSocket, or any OpenAI-compatible server over HTTP/SSE, so vLLM and SGLang
are measured the same way) runs it and records the arrival time of every
token event at the client, and what the server reports of it: its prompt
length, prefix-cache hit and (this server's WebSocket) its queue wait.
Servers that report queue waits only in Prometheus histograms (vLLM) are
read before and after a run (``QueueWaitProbe``). A request the server
refuses at once (HTTP 429, a WebSocket ``overloaded`` frame: shed load, a
rate limit) is a refusal, not an error: how long the refusal took and the
wait it asked for are kept, and goodput counts it as not good.

Trace prompts have exactly the traced token lengths: they are made of words
that are one token each (``WordPrompts``), and runs the trace marks as
shared (Mooncake's equal hash ids) are equal words, so a prefix cache sees
the trace's sharing.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import random
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from stallfree.core.analysis.traces import TraceRequest, prompt_ids
from stallfree.core.model.tokenizer import Tokenizer
from stallfree.core.sched.timings import Goodness, percentile

WORDS = (
    "the",
    "report",
    "river",
    "market",
    "engine",
    "signal",
    "window",
    "garden",
    "history",
    "science",
    "music",
    "table",
    "number",
    "system",
    "question",
    "answer",
    "city",
    "morning",
    "winter",
    "light",
    "paper",
    "story",
    "machine",
    "network",
    "ocean",
    "mountain",
    "value",
    "model",
    "energy",
    "memory",
    "forest",
    "budget",
    "token",
    "planet",
    "school",
    "office",
    "kitchen",
    "letter",
    "bridge",
    "station",
    "theory",
)


@dataclass(slots=True)
class Arrival:
    at_s: float
    prompt: str
    max_tokens: int
    group: str = "request"  # e.g. decoder / long, for the interference scenario
    prompt_tokens: int | None = None  # its exact length, where the workload fixes it (traces)


@dataclass(slots=True)
class Result:
    job: Arrival
    sent_s: float
    token_s: list[float] = field(default_factory=list)  # arrival of each token event, seconds since start
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache served, where it says
    server_timings: dict[str, float] | None = None  # this server's done-frame split
    error: str | None = None
    refused_s: float | None = None  # refused (429): seconds from sending it to the refusal
    retry_after_s: float | None = None  # the wait the refusal asked for (Retry-After), where it said
    predicted_ttft_ms: float | None = None  # admission's forecast of its TTFT, under a TTFT target
    best_effort: bool = False  # admitted though that forecast missed the target

    @property
    def ttft_s(self) -> float | None:
        return self.token_s[0] - self.sent_s if self.token_s else None

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_s)]

    @property
    def refused(self) -> bool:
        return self.refused_s is not None

    def judge(self, ttft_slo_ms: float | None, tbt_slo_ms: float | None) -> Goodness:
        """The engine's rule (``core.sched.timings.judge``) on the client's clock:
        completed (neither refused nor failed), TTFT from sending to the first
        token within ``ttft_slo_ms``, the 99th percentile of its own gaps within
        ``tbt_slo_ms``; no target (None or 0) is met by anything that completed."""
        completed = self.error is None and not self.refused and bool(self.token_s)
        ttft_met = completed and (not ttft_slo_ms or (self.token_s[0] - self.sent_s) * 1e3 <= ttft_slo_ms)
        gaps_ms = [g * 1e3 for g in self.gaps_s]
        tbt_met = completed and (not tbt_slo_ms or percentile(gaps_ms, 99) <= tbt_slo_ms)
        return Goodness(ttft_met, tbt_met, completed)


class PromptMaker:
    """Prompts of a given token length for this tokenizer, each with a unique start
    (so no prefix cache serves them, not even from an earlier run with the same
    seed: the seed fixes lengths and words, a per-instance nonce the start)."""

    def __init__(self, tokenizer: Tokenizer, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.nonce = os.urandom(4).hex()
        self.n = 0

    def __call__(self, tokens: int) -> str:
        self.n += 1
        words = [f"Request {self.nonce}-{self.n}:"]
        words += self.rng.choices(WORDS, k=tokens + 8)
        ids = self.tokenizer.encode(" ".join(words))[: max(1, tokens)]
        return self.tokenizer.decode(ids)


def prompt_lengths(spec: str, n: int, rng: random.Random) -> list[int]:
    """fixed:N | uniform:A-B | longtail (most short, a few long, like chat traffic)."""
    kind, _, arg = spec.partition(":")
    if kind == "fixed":
        return [int(arg)] * n
    if kind == "uniform":
        low, high = (int(x) for x in arg.split("-"))
        return [rng.randint(low, high) for _ in range(n)]
    if kind == "longtail":
        return [
            rng.choice([rng.randint(32, 256)] * 16 + [rng.randint(512, 1024)] * 3 + [rng.randint(2000, 3000)])
            for _ in range(n)
        ]
    raise ValueError(f"prompt length spec {spec!r}: fixed:N, uniform:A-B or longtail")


def arrivals(kind: str, n: int, rate: float, rng: random.Random) -> list[float]:
    """poisson (rate per second) or burst (all at once)."""
    if kind == "burst":
        return [0.0] * n
    if kind == "poisson":
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.expovariate(rate)
        return out
    raise ValueError(f"arrival pattern {kind!r}: poisson or burst")


class WordPrompts:
    """Trace prompts of exact token lengths for a byte-level BPE tokenizer.

    Its words that are one token with their leading space (`` river``) stay
    one token beside each other (the pre-tokenizer splits before spaces), so
    a prompt of n such words is n tokens. A trace request's shared runs are
    drawn from their keys: equal keys, equal words, equal tokens. The seed
    and a per-instance nonce fix the words: a second run shares nothing with
    an earlier one (its prefix cache starts cold), as with ``PromptMaker``.
    """

    def __init__(self, tokenizer: Tokenizer, seed: int = 0) -> None:
        word = re.compile(rb" [a-z]{3,10}")
        self.words = [
            b.decode()
            for i, b in enumerate(tokenizer.token_bytes)
            if word.fullmatch(b) and tokenizer.encode(b.decode()) == [i]
        ]
        if len(self.words) < 1000:
            raise ValueError("this tokenizer has too few one-token words for exact-length prompts")
        self.seed = f"{seed}/{os.urandom(4).hex()}"
        self._runs: dict[str, list[int]] = {}

    def __call__(self, r: TraceRequest) -> str:
        ids = prompt_ids(r, self.seed, len(self.words), low=0, blocks=self._runs)
        return "".join(self.words[i] for i in ids)


def trace_jobs(requests: list[TraceRequest], prompts: WordPrompts) -> list[Arrival]:
    """A replayed trace window (``core.analysis.traces.replay``) as jobs of exact lengths."""
    return [Arrival(r.at_s, prompts(r), r.output_tokens, prompt_tokens=r.prompt_tokens) for r in requests]


def interference_jobs(
    make: PromptMaker, streams: int, long_prompts: int, long_tokens: int, delay_s: float, decode_tokens: int
) -> list[Arrival]:
    """N streams decoding, then long prompts arriving while they run."""
    jobs = [Arrival(0.0, make(32), decode_tokens, "decoder") for _ in range(streams)]
    jobs += [Arrival(delay_s, make(long_tokens), 8, "long") for _ in range(long_prompts)]
    return jobs


class Target(Protocol):
    async def run(self, job: Arrival, t0: float) -> Result: ...


class StallfreeTarget:
    """This server's WebSocket protocol; one connection per request."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url, self.api_key = url, api_key

    async def run(self, job: Arrival, t0: float) -> Result:
        res = Result(job, time.perf_counter() - t0)
        frame = {
            "type": "generate",
            "id": "b",
            "prompt": job.prompt,
            "max_tokens": job.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        }
        try:
            async with connect(self.url, max_size=None) as ws:
                if self.api_key:
                    await ws.send(orjson.dumps({"type": "auth", "api_key": self.api_key}).decode())
                await ws.send(orjson.dumps(frame).decode())
                async for raw in ws:
                    now = time.perf_counter() - t0
                    f = orjson.loads(raw)
                    if f["type"] == "token" and f["token_ids"]:
                        res.token_s.append(now)
                    elif f["type"] == "accepted":
                        res.prompt_tokens = f["prompt_tokens"]
                        res.predicted_ttft_ms = f.get("predicted_ttft_ms")
                        res.best_effort = f.get("best_effort", False)
                    elif f["type"] == "done":
                        res.completion_tokens = f["usage"]["completion_tokens"]
                        res.cached_tokens = f["usage"].get("cached_tokens")
                        res.server_timings = f["timings"]
                        break
                    elif f["type"] == "error" and f["code"] == "overloaded":
                        res.refused_s = now - res.sent_s
                        res.retry_after_s = f.get("retry_after_s")
                        break
                    elif f["type"] == "error":
                        res.error = f["code"]
                        break
        except OSError as exc:
            res.error = f"connection: {exc}"
        return res


class OpenAITarget:
    """Any OpenAI-compatible server: streaming /v1/completions over SSE."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None) -> None:
        self.base_url, self.model = base_url, model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._clients: dict[int, httpx.AsyncClient] = {}

    @property
    def client(self) -> httpx.AsyncClient:
        """One connection pool per event loop (each asyncio.run has its own)."""
        loop = id(asyncio.get_running_loop())
        if loop not in self._clients:
            self._clients = {
                loop: httpx.AsyncClient(
                    base_url=self.base_url,
                    headers=self.headers,
                    timeout=httpx.Timeout(600, connect=30),
                    limits=httpx.Limits(max_connections=1000),
                )
            }
        return self._clients[loop]

    async def run(self, job: Arrival, t0: float) -> Result:
        res = Result(job, time.perf_counter() - t0)
        body = {
            "model": self.model,
            "prompt": job.prompt,
            "max_tokens": job.max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        try:
            async with self.client.stream("POST", "/completions", json=body) as r:
                if r.status_code == 429:
                    res.refused_s = time.perf_counter() - t0 - res.sent_s
                    res.retry_after_s = number(r.headers.get("retry-after"))
                    return res
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return res
                res.predicted_ttft_ms = number(r.headers.get("x-stallfree-predicted-ttft-ms"))
                res.best_effort = r.headers.get("x-stallfree-best-effort") == "1"
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter() - t0
                    chunk = orjson.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        res.token_s.append(now)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                        res.prompt_tokens = usage["prompt_tokens"]
                        res.completion_tokens = usage["completion_tokens"]
                        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        except httpx.HTTPError as exc:
            res.error = f"{type(exc).__name__}: {exc}"
        return res


def number(header: str | None) -> float | None:
    """A numeric header's value (Retry-After's seconds, a forecast's ms); None if absent or not a number."""
    try:
        return float(header) if header is not None else None
    except ValueError:
        return None


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


class QueueWaitProbe:
    """A server's Prometheus histogram of queue waits (arrival to first
    scheduled), read before and after a run: the run's median from the
    difference, interpolated within its bucket. For servers that report queue
    waits nowhere else (vLLM's ``vllm:request_queue_time_seconds``)."""

    NAMES = ("vllm:request_queue_time_seconds", "stallfree_queue_wait_seconds")

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


def summarize(
    results: list[Result],
    group: str | None = None,
    tbt_slo_ms: float | None = None,
    queue_wait_ms: float | None = None,
    ttft_slo_ms: float | None = None,
) -> dict[str, Any]:
    """TTFT, scheduling delay and every inter-token gap, percentiles and max;
    throughput over the run; prefix-cache hits where the server says;
    refusals (how many, how fast); with a target (TBT, TTFT or both),
    goodput (``goodput``). ``queue_wait_ms``: the run's median queue wait
    read elsewhere (a probe), for servers whose responses do not carry it."""
    rs = [r for r in results if group is None or r.job.group == group]
    ok = [r for r in rs if r.error is None and r.token_s]
    refused = [r for r in rs if r.refused]
    ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    gaps = [g * 1e3 for r in ok for g in r.gaps_s]
    start = min((r.sent_s for r in rs), default=0.0)
    end = max((r.token_s[-1] for r in ok), default=start)
    tokens = sum(len(r.token_s) for r in ok)
    failed = [r for r in rs if not r.refused and (r.error is not None or not r.token_s)]
    out: dict[str, Any] = {
        "requests": len(rs),
        "errors": len(failed),
        "error_kinds": dict(Counter(r.error or "no tokens" for r in failed)),
        "refused": len(refused),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p90_ms": percentile(ttft, 90),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(gaps, 50),
        "itl_p90_ms": percentile(gaps, 90),
        "itl_p99_ms": percentile(gaps, 99),
        "max_gap_ms": max(gaps, default=0.0),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": tokens,
        "throughput_tokens_per_s": tokens / (end - start) if end > start else 0.0,
    }
    if refused:
        refusal_ms = [(r.refused_s or 0.0) * 1e3 for r in refused]
        out["refusal_p50_ms"] = percentile(refusal_ms, 50)
        out["refusal_p99_ms"] = percentile(refusal_ms, 99)
        out["refusal_max_ms"] = max(refusal_ms)
        waits = [r.retry_after_s for r in refused if r.retry_after_s is not None]
        if waits:
            out["retry_after_p50_s"] = percentile(waits, 50)
    split = [r.server_timings for r in ok if r.server_timings]
    if split:
        for k in ("queue_wait_ms", "prefill_ms", "decode_ms"):
            out[f"server_{k}_p50"] = percentile([t[k] for t in split], 50)
        out["queue_wait_p50_ms"] = out["server_queue_wait_ms_p50"]
    elif queue_wait_ms is not None:
        out["queue_wait_p50_ms"] = queue_wait_ms
    reported = [r for r in ok if r.cached_tokens is not None]
    if reported:
        prompt = sum(r.prompt_tokens for r in reported)
        out["prefix_hit_rate"] = sum(r.cached_tokens or 0 for r in reported) / prompt if prompt else 0.0
    exact = [r for r in ok if r.job.prompt_tokens is not None]
    if exact:
        out["prompt_length_mismatches"] = sum(r.prompt_tokens != r.job.prompt_tokens for r in exact)
    if tbt_slo_ms is not None or ttft_slo_ms is not None:
        out |= goodput(rs, ttft_slo_ms, tbt_slo_ms, end - start)
    first_error = next((r.error for r in failed if r.error), None)
    if first_error:
        out["first_error"] = first_error
    return out


def goodput(rs: list[Result], ttft_slo_ms: float | None, tbt_slo_ms: float | None, span_s: float) -> dict[str, Any]:
    """Goodput, each request judged by ``Result.judge``: how many were good, their
    share of every request (refused and failed ones count as not good: what
    the goodput capacity reads) and of those admitted (what shedding keeps),
    each target's attainment over every request, and the good ones per second
    over ``span_s``; best-effort admissions (the server forecast a late first
    token): how many, how many were good after all; the median of measured
    over predicted TTFT, where the server predicted it."""
    judged = [(r, r.judge(ttft_slo_ms, tbt_slo_ms)) for r in rs]
    good = sum(g.good for _, g in judged)
    admitted = sum(not r.refused for r in rs)
    out: dict[str, Any] = {
        "tbt_slo_ms": tbt_slo_ms,
        "ttft_slo_ms": ttft_slo_ms,
        "good_requests": good,
        "good_share": good / len(rs) if rs else 0.0,
        "admitted_good_share": good / admitted if admitted else 0.0,
        "goodput_req_per_s": good / span_s if span_s > 0 else 0.0,
    }
    if ttft_slo_ms and rs:
        out["ttft_attainment"] = sum(g.ttft_met for _, g in judged) / len(rs)
    if tbt_slo_ms and rs:
        out["tbt_attainment"] = sum(g.tbt_met for _, g in judged) / len(rs)
    best_effort = [g for r, g in judged if r.best_effort]
    if best_effort:
        out["best_effort_requests"] = len(best_effort)
        out["best_effort_good"] = sum(g.good for g in best_effort)
    ratios = [(r.ttft_s or 0.0) * 1e3 / r.predicted_ttft_ms for r, g in judged if g.completed and r.predicted_ttft_ms]
    if ratios:
        out["ttft_over_predicted_p50"] = percentile(ratios, 50)
    return out
