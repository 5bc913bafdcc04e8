"""A test client's side of the WebSocket protocol: send a frame, receive one,
collect generations until they end, check one generation's frames."""

from __future__ import annotations

import asyncio

import orjson
import pytest


async def send(ws, **frame):
    await ws.send(orjson.dumps(frame).decode())


async def recv(ws, timeout=20.0):
    return orjson.loads(await asyncio.wait_for(ws.recv(), timeout))


async def collect(ws, ids):
    """Frames per generation id until each is done (or errored)."""
    frames = {i: [] for i in ids}
    open_ids = set(ids)
    while open_ids:
        f = await recv(ws)
        if f.get("id") in frames:
            frames[f["id"]].append(f)
            if f["type"] in ("done", "error"):
                open_ids.discard(f["id"])
    return frames


def check_stream(frames, max_tokens):
    kinds = [f["type"] for f in frames]
    assert kinds[0] == "accepted" and kinds[-1] == "done"
    tokens = [t for f in frames if f["type"] == "token" for t in f["token_ids"]]
    indexes = [f["index"] for f in frames if f["type"] == "token" and f["token_ids"]]
    assert len(tokens) == max_tokens
    assert indexes == sorted(indexes) and indexes[0] == 0
    done = frames[-1]
    assert done["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == max_tokens
    assert done["usage"]["prompt_tokens"] == frames[0]["prompt_tokens"] > 0
    t = done["timings"]
    assert t["queue_wait_ms"] + t["prefill_ms"] + t["decode_ms"] == pytest.approx(t["e2e_ms"], abs=0.01)
    assert t["max_gap_ms"] >= t["itl_p99_ms"] >= t["itl_p50_ms"] > 0
