"""A decoding user over the WebSocket API, shared by the gateway benchmarks."""

from __future__ import annotations

import asyncio
import collections
import time

import orjson
from websockets.asyncio.client import connect


async def stream_user(
    url: str,
    stop_at: float,
    gaps: list[float],
    *,
    prompt: str = "Tell me a story.",
    ends: collections.Counter[str] | None = None,
    headers: dict[str, str] | None = None,
    cut_at_stop: bool = False,
) -> None:
    """64-token generations one after another until ``stop_at``: every gap
    between two tokens of one generation (ms) goes to ``gaps``, each end
    (``done`` or the error's code) to ``ends``. ``cut_at_stop``: a generation
    still running at ``stop_at`` (behind a burst) ends the run; otherwise a
    frame may take 120 s."""
    async with connect(url, max_size=None, additional_headers=headers or {}) as ws:
        n = 0
        while time.perf_counter() < stop_at:
            n += 1
            frame = {"type": "generate", "id": f"u{n}", "prompt": prompt, "max_tokens": 64, "ignore_eos": True}
            await ws.send(orjson.dumps(frame).decode())
            last = None
            while True:
                wait = max(0.1, stop_at - time.perf_counter()) if cut_at_stop else 120
                try:
                    f = orjson.loads(await asyncio.wait_for(ws.recv(), wait))
                except TimeoutError:
                    if cut_at_stop:
                        return
                    raise
                if f["type"] == "token":
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append((now - last) * 1e3)
                    last = now
                elif f["type"] in ("done", "error"):
                    if ends is not None:
                        ends[f["type"] if f["type"] == "done" else f["code"]] += 1
                    break
