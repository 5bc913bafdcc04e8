"""Opening a WebSocket (``/v1/stream`` and ``/ws/telemetry`` alike): Origin
check, then the API key, from the headers or, since browsers cannot set
headers on a WebSocket, from a first ``auth`` frame within ``auth_timeout_s``
(a socket without a key does not stay open for free)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import anyio
import orjson
from starlette.websockets import WebSocket, WebSocketDisconnect

from stallfree.gateway.edge.auth import origin_allowed, request_key, tenant_of
from stallfree.gateway.edge.connections import AUTHENTICATED
from stallfree.gateway.engine.client import EngineClient


async def accept(ws: WebSocket, client: EngineClient) -> str | None:
    """The caller's tenant ("" without keys) once the socket is open and
    authenticated; None once it has been refused and closed."""
    s = client.settings
    if not origin_allowed(ws.headers.get("origin"), s.allowed_origins, s.host_names):
        await ws.close(code=1008)
        return None
    await ws.accept()
    if not s.api_keys:
        return ""
    if (tenant := tenant_of(request_key(ws.headers), s.api_keys, s.admin_keys)) is not None:
        _authenticated(ws)
        return tenant
    message: Mapping[str, Any] | None = None
    with anyio.move_on_after(s.auth_timeout_s):
        message = await ws.receive()
    if message is None:
        why = f"no API key within {s.auth_timeout_s:g} s"
    elif message["type"] == "websocket.disconnect":
        return None
    elif (tenant := tenant_of(_auth_key(message), s.api_keys, s.admin_keys)) is not None:
        _authenticated(ws)
        await _send(ws, '{"type":"authenticated"}')  # a client already gone shows up as a disconnect
        return tenant
    else:
        why = "send {'type': 'auth', 'api_key': ...} first"
    client.report_error("unauthorized")
    await _send(ws, orjson.dumps({"type": "error", "id": None, "code": "unauthorized", "message": why}).decode())
    with contextlib.suppress(RuntimeError, OSError):
        await ws.close(code=1008)
    return None


def _authenticated(ws: WebSocket) -> None:
    """Tell the protocol (where it listens) that full-size frames may come now."""
    if (lift := ws.scope.get("extensions", {}).get(AUTHENTICATED)) is not None:
        lift()


async def _send(ws: WebSocket, text: str) -> None:
    with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
        await ws.send_text(text)


def _auth_key(message: Mapping[str, Any]) -> object:
    """The ``api_key`` of an ``{"type": "auth", ...}`` text frame, else None."""
    try:
        frame = orjson.loads(message.get("text") or b"")
    except orjson.JSONDecodeError:
        return None
    return frame.get("api_key") if isinstance(frame, dict) and frame.get("type") == "auth" else None
