"""Load generation: workloads, two client protocols, and per-token arrival times.

A ``Job`` is one request to send at ``at_s``; a target (this server over
WebSocket, or any OpenAI-compatible server over HTTP/SSE, so vLLM and SGLang
are measured the same way) runs it and records the arrival time of every
token event at the client.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import orjson
from websockets.asyncio.client import connect

from core.analysis.simulator import load_trace
from core.model.tokenizer import Tokenizer
from core.sched.timings import percentile

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
class Job:
    at_s: float
    prompt: str
    max_tokens: int
    group: str = "request"  # e.g. decoder / long, for the interference scenario


@dataclass(slots=True)
class Result:
    job: Job
    sent_s: float
    token_s: list[float] = field(default_factory=list)  # arrival of each token event, seconds since start
    prompt_tokens: int = 0
    completion_tokens: int = 0
    server_timings: dict[str, float] | None = None  # this server's done-frame split
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.token_s[0] - self.sent_s if self.token_s else None

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_s)]


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


def trace_jobs(path: Path, make: PromptMaker) -> list[Job]:
    """A JSONL trace (the simulator's format): requests naming the same ``prefix``
    share their first ``prefix_tokens`` tokens of text, so prefix caching replays too."""
    load_trace(path)  # validates every line, errors name the line
    jobs: list[Job] = []
    prefixes: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = orjson.loads(line)
        prompt_tokens, shared = int(row["prompt_tokens"]), int(row.get("prefix_tokens", 0))
        head = ""
        if row.get("prefix") and shared:
            head = prefixes.setdefault(row["prefix"], make(min(shared, prompt_tokens)))
        rest = make(max(1, prompt_tokens - min(shared, prompt_tokens))) if prompt_tokens > shared else ""
        jobs.append(Job(float(row["t"]), head + rest, int(row["output_tokens"])))
    return jobs


def interference_jobs(
    make: PromptMaker, streams: int, long_prompts: int, long_tokens: int, delay_s: float, decode_tokens: int
) -> list[Job]:
    """N streams decoding, then long prompts arriving while they run."""
    jobs = [Job(0.0, make(32), decode_tokens, "decoder") for _ in range(streams)]
    jobs += [Job(delay_s, make(long_tokens), 8, "long") for _ in range(long_prompts)]
    return jobs


class Target(Protocol):
    async def run(self, job: Job, t0: float) -> Result: ...


class StallfreeTarget:
    """This server's WebSocket protocol; one connection per request."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url, self.api_key = url, api_key

    async def run(self, job: Job, t0: float) -> Result:
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
                    elif f["type"] == "done":
                        res.completion_tokens = f["usage"]["completion_tokens"]
                        res.server_timings = f["timings"]
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

    async def run(self, job: Job, t0: float) -> Result:
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
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter() - t0
                    chunk = orjson.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        res.token_s.append(now)
                    if chunk.get("usage"):
                        res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                        res.completion_tokens = chunk["usage"]["completion_tokens"]
        except httpx.HTTPError as exc:
            res.error = f"{type(exc).__name__}: {exc}"
        return res


async def run_jobs(target: Target, jobs: list[Job], progress: Callable[[int, int], None] | None = None) -> list[Result]:
    """Send each job at its time; returns results in job order."""
    t0 = time.perf_counter()
    done = 0

    async def one(job: Job) -> Result:
        nonlocal done
        await asyncio.sleep(max(0.0, job.at_s - (time.perf_counter() - t0)))
        res = await target.run(job, t0)
        done += 1
        if progress:
            progress(done, len(jobs))
        return res

    return await asyncio.gather(*(one(j) for j in jobs))


def summarize(results: list[Result], group: str | None = None) -> dict[str, Any]:
    """TTFT and every inter-token gap, percentiles and max; throughput over the run."""
    rs = [r for r in results if group is None or r.job.group == group]
    ok = [r for r in rs if r.error is None and r.token_s]
    ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    gaps = [g * 1e3 for r in ok for g in r.gaps_s]
    start = min((r.sent_s for r in rs), default=0.0)
    end = max((r.token_s[-1] for r in ok), default=start)
    tokens = sum(len(r.token_s) for r in ok)
    out: dict[str, Any] = {
        "requests": len(rs),
        "errors": len(rs) - len(ok),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p90_ms": percentile(ttft, 90),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(gaps, 50),
        "itl_p90_ms": percentile(gaps, 90),
        "itl_p99_ms": percentile(gaps, 99),
        "max_gap_ms": max(gaps, default=0.0),
        "output_tokens": tokens,
        "throughput_tokens_per_s": tokens / (end - start) if end > start else 0.0,
    }
    split = [r.server_timings for r in ok if r.server_timings]
    if split:
        for k in ("queue_wait_ms", "prefill_ms", "decode_ms"):
            out[f"server_{k}_p50"] = percentile([t[k] for t in split], 50)
    first_error = next((r.error for r in rs if r.error), None)
    if first_error:
        out["first_error"] = first_error
    return out
