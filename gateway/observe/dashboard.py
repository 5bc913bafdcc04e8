"""The dashboard: static files from ``web/`` and the ``/ws/telemetry`` feed.

The files are package data of ``stallfree`` (``stallfree/web``: in a checkout
a link to the top-level ``web/``, in the wheel the files), found through the
package, so an installed wheel serves the dashboard as a checkout does.

One broadcaster task builds a telemetry frame at most ten times a second
while anybody watches and hands it to every dashboard socket; a dashboard
that cannot keep up simply misses frames.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import orjson
from anyio.streams.memory import MemoryObjectSendStream
from starlette.websockets import WebSocket, WebSocketDisconnect

import stallfree
from stallfree.gateway.edge.ws_auth import accept
from stallfree.gateway.engine.client import EngineClient
from stallfree.gateway.observe.telemetry import FRAMES_PER_S

WEB_DIR = Path(stallfree.__file__).parent / "web"


class TelemetryHub:
    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.subscribers: set[MemoryObjectSendStream[str]] = set()

    async def run(self) -> None:
        while True:
            await anyio.sleep(1 / FRAMES_PER_S)
            if not self.subscribers:
                continue
            cfg = self.client.snapshot.config
            config = {
                "chunking": cfg.chunking,
                "token_budget": cfg.token_budget,
                "policy": cfg.policy,
                "tbt_slo_ms": cfg.tbt_slo_ms,
                "ttft_slo_ms": cfg.ttft_slo_ms,
                "speculate": cfg.speculate,
            }
            text = orjson.dumps(self.client.telemetry.frame(config)).decode()
            for sub in list(self.subscribers):
                try:
                    sub.send_nowait(text)
                except anyio.WouldBlock:
                    pass  # a slow dashboard misses this frame
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    self.subscribers.discard(sub)


async def telemetry_endpoint(ws: WebSocket) -> None:
    client: EngineClient = ws.app.state.client
    hub: TelemetryHub = ws.app.state.telemetry_hub
    if await accept(ws, client) is None:
        return
    send, receive = anyio.create_memory_object_stream[str](2)
    hub.subscribers.add(send)
    try:
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while (await ws.receive())["type"] != "websocket.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(watch_disconnect)
            async for text in receive:
                await ws.send_text(text)
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass
    finally:
        hub.subscribers.discard(send)
        send.close()
        receive.close()
