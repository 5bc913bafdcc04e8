"""The two client protocols a load run speaks, each recording the arrival time of
every token event at the client and what the server reports of the request: this
server's WebSocket (``StallfreeTarget``: its prompt length, prefix-cache hit and
queue wait) and any OpenAI-compatible server over HTTP/SSE (``OpenAITarget``),
so vLLM and SGLang are measured the same way. A request the server refuses at
once (HTTP 429, a WebSocket ``overloaded`` frame: shed load, a rate limit) is
a refusal, not an error: how long the refusal took and the wait it asked for
are kept, and goodput counts it as not good.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Protocol

import httpx
import orjson
from websockets.asyncio.client import connect

from stallfree.core.sched.timings import Goodness, percentile
from stallfree.loadtest.workloads import Arrival


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
