"""The dashboard: static files from ``web/`` and the ``/ws/telemetry`` feed.

One broadcaster task builds a telemetry frame at most ten times a second
while anybody watches and hands it to every dashboard socket; a dashboard
that cannot keep up simply misses frames.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import anyio
import orjson
from anyio.streams.memory import MemoryObjectSendStream
from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway.auth import key_matches, origin_allowed, request_key
from gateway.engine_client import EngineClient
from gateway.telemetry import FRAMES_PER_S

WEB_DIR = Path(__file__).resolve().parent.parent / "web"


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
            config = {"chunking": cfg.chunking, "token_budget": cfg.token_budget, "policy": cfg.policy}
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
    keys = client.settings.api_keys
    if not origin_allowed(ws.headers.get("origin"), client.settings.allowed_origins, client.settings.host_names):
        await ws.close(code=1008)
        return
    await ws.accept()
    if keys and not key_matches(request_key(ws.headers), keys):
        frame = {}
        with anyio.move_on_after(client.settings.auth_timeout_s):
            with contextlib.suppress(orjson.JSONDecodeError, WebSocketDisconnect, KeyError):
                frame = orjson.loads(await ws.receive_text())
        if not (isinstance(frame, dict) and frame.get("type") == "auth" and key_matches(frame.get("api_key"), keys)):
            client.metrics.errors.labels("unauthorized").inc()
            await ws.send_text(
                orjson.dumps(
                    {
                        "type": "error",
                        "id": None,
                        "code": "unauthorized",
                        "message": "send {'type': 'auth', 'api_key': ...} first",
                    }
                ).decode()
            )
            await ws.close(code=1008)
            return
        await ws.send_text('{"type":"authenticated"}')
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
