"""The soak benchmark's short version: steady load plus disconnect and cancel
storms against a server process leave KV, file descriptors and errors clean."""

from __future__ import annotations

import asyncio
import signal

import pytest

from bench.gateway.soak import Server, soak

pytestmark = pytest.mark.slow  # a 25 s soak


def test_short_soak_returns_to_baseline():
    server = Server()
    try:
        result = asyncio.run(soak(server, minutes=0.4, rate=15.0, storm_s=6.0, sample_s=8.0))
    finally:
        assert server.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after its clean shutdown
    first, last = result["samples"][0], result["samples"][-1]
    assert result["served"] > 100
    assert result["errors"] == {}, result["errors"]
    assert result["load"]["disconnect_storm_sockets"] >= 20 and result["load"]["cancel_storm_generations"] >= 40
    assert last["kv_used_blocks"] == 0
    assert last["fds"] <= first["fds"] + 2  # every socket of the storms was released
