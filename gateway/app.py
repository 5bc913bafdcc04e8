"""The ASGI application: routes, API-key check, and the lifespan that starts
and stops the engine client (and its backend: the engine process, or the step
thread with ``--engine thread``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import anyio
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from stallfree.core.sched.config import LIVE_SETTINGS
from stallfree.core.sched.step_loop import EngineStopped
from stallfree.gateway.edge.auth import cross_origin_refusal, key_matches, request_key
from stallfree.gateway.engine.backend import EngineBusy
from stallfree.gateway.engine.client import EngineClient
from stallfree.gateway.inputs.protocol import HTTP_STATUS, ProtocolError, error_body
from stallfree.gateway.observe.dashboard import WEB_DIR, TelemetryHub, telemetry_endpoint
from stallfree.gateway.openai.api import error_response, models, read_json
from stallfree.gateway.openai.chat import chat_completions
from stallfree.gateway.openai.completions import completions
from stallfree.gateway.openai.tokens import detokenize, tokenize
from stallfree.gateway.websocket import stream_endpoint


async def metrics(request: Request) -> Response:
    client: EngineClient = request.app.state.client
    return Response(client.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def healthz(request: Request) -> Response:
    """Liveness: 503 once the engine has stopped for good (the process is exiting).
    A stalled engine may answer again: 200, and the body says so."""
    client: EngineClient = request.app.state.client
    if client.fatal is not None:
        return JSONResponse({"status": "failed", "reason": client.fatal}, status_code=503)
    if client.stalled_s:
        return JSONResponse({"status": "ok", "engine": "stalled", "silent_s": round(client.stalled_s, 1)})
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    client: EngineClient = request.app.state.client
    ready = client.ready and client.accepting
    body: dict[str, Any] = {"ready": ready, "in_flight": client.num_in_flight}
    if client.replicas is not None:
        body["replicas_ready"], body["replicas"] = client.replicas
    if client.fatal is not None:
        body["reason"] = client.fatal
    elif client.stalled_s:
        body["reason"] = f"the engine has not answered for {client.stalled_s:.1f} s"
    return JSONResponse(body, status_code=200 if ready else 503)


def config_view(client: EngineClient) -> dict[str, Any]:
    """Settings and KV usage, as the step thread last published them."""
    s = client.snapshot
    return {
        "scheduler": dataclasses.asdict(s.config),
        "kv_cache": {
            "blocks": s.kv_blocks,
            "block_size": s.kv_block_size,
            "used_blocks": s.counts.kv_used_blocks,
            "free_blocks": s.counts.kv_free_blocks,
            "cached_blocks": s.counts.kv_cached_blocks,
        },
        "shed_load": client.settings.shed_load,
        "live_settings": [*LIVE_SETTINGS, "shed_load"],
        "model": client.settings.model_name,
        "auth_required": bool(client.settings.api_keys),
        "operator_key_required": bool(client.settings.api_keys or client.settings.admin_keys),
    }


async def api_config(request: Request) -> Response:
    """GET (and HEAD): settings and KV usage. PUT: change live settings."""
    client: EngineClient = request.app.state.client
    try:
        if client.fatal is not None:
            raise EngineStopped(client.fatal)
        if request.method in ("GET", "HEAD"):
            return JSONResponse(config_view(client))
        changes = await read_json(request, client.settings.max_body_bytes, client.settings.body_timeout_s)
        shed_load = changes.pop("shed_load", None)  # the gateway's own live setting
        if shed_load is not None and not isinstance(shed_load, bool):
            raise ProtocolError("invalid_request", "shed_load must be true or false", param="shed_load")
        warnings = await _reconfigure(client, changes) if changes else []
        if shed_load is not None:
            client.settings.shed_load = shed_load
        return JSONResponse({**config_view(client), "warnings": warnings})
    except EngineStopped as exc:
        return error_response("unavailable", f"the engine stopped: {exc}")
    except ProtocolError as exc:
        client.report_error(exc.code)
        return error_response(exc.code, exc.message)
    except (ValueError, TypeError) as exc:
        client.report_error("invalid_request")
        return error_response("invalid_request", str(exc))


async def _reconfigure(client: EngineClient, changes: dict[str, Any]) -> list[str]:
    """The engine's answer to a settings change, or 503 when it is not answering."""
    if client.stalled_s:
        raise ProtocolError("unavailable", f"the engine has not answered for {client.stalled_s:.1f} s; retry shortly")
    try:
        future = client.backend.reconfigure(changes)
    except EngineBusy as exc:
        raise ProtocolError("unavailable", f"{exc}; retry shortly") from None
    with anyio.move_on_after(RECONFIGURE_WAIT_S):
        return await asyncio.wrap_future(future)
    why = f"the engine has not answered within {RECONFIGURE_WAIT_S:g} s; the change applies when it does"
    raise ProtocolError("unavailable", why)


RECONFIGURE_WAIT_S = 10.0
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
TOKEN_PATHS = ("/tokenize", "/detokenize")


class GuardMiddleware:
    """Before any route: a state-changing request from a browser page on
    another origin is refused (403 ``forbidden``); with API keys set, /v1/*
    and the token endpoints need a key (WebSockets check theirs themselves,
    since browsers cannot set headers there); with any key set, changing
    /api/config needs an operator's key (``--admin-key``): 401 without a key,
    403 with one that generates only."""

    def __init__(self, app: ASGIApp, client: EngineClient) -> None:
        self.app = app
        self.keys = client.settings.api_keys
        self.admin_keys = client.settings.admin_keys
        self.client = client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if scope["method"] not in SAFE_METHODS:
            s = self.client.settings
            why = cross_origin_refusal(headers, s.allowed_origins, s.host_names)
            if why:
                self.client.report_error("forbidden")
                await JSONResponse(error_body("forbidden", why), status_code=403)(scope, receive, send)
                return
        refusal = self._refusal(scope, request_key(headers))
        if refusal is not None:
            code, why = refusal
            self.client.report_error(code)
            await JSONResponse(error_body(code, why), status_code=HTTP_STATUS[code])(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope, key: str | None) -> tuple[str, str] | None:
        """(code, why) when the request's key does not open its path."""
        path = scope["path"]
        if path == "/api/config" and scope["method"] not in SAFE_METHODS:
            if not (self.keys or self.admin_keys):
                return None
            if key_matches(key, (), self.admin_keys):
                return None
            if not key_matches(key, self.keys):
                return "unauthorized", "changing settings needs an operator key (Authorization: Bearer <key>)"
            if not self.admin_keys:
                return "forbidden", "this server has no operator key (--admin-key): its settings are fixed"
            return "forbidden", "changing settings needs an operator key (--admin-key), not an API key"
        guarded = path.startswith("/v1/") or path in TOKEN_PATHS
        if self.keys and guarded and not key_matches(key, self.keys, self.admin_keys):
            return "unauthorized", "missing or wrong API key (Authorization: Bearer <key>)"
        return None


def _static_or_not_found(static: ASGIApp, not_found: ASGIApp) -> ASGIApp:
    async def fallback(scope: Scope, receive: Receive, send: Send) -> None:
        await (static if scope["type"] == "http" else not_found)(scope, receive, send)

    return fallback


def create_app(client: EngineClient) -> Starlette:
    hub = TelemetryHub(client)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await client.start()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(hub.run)
                tg.start_soon(client.watchdog)
                yield
                tg.cancel_scope.cancel()
        finally:
            client.stop()

    routes: list[BaseRoute] = [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics),
        Route("/api/config", api_config, methods=["GET", "PUT"]),
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        WebSocketRoute("/v1/stream", stream_endpoint),
        WebSocketRoute("/ws/telemetry", telemetry_endpoint),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    if WEB_DIR.is_dir():
        # the dashboard answers only paths no route knows, so a known path
        # with the wrong method still gets 405 and its Allow header
        app.router.default = _static_or_not_found(StaticFiles(directory=WEB_DIR, html=True), app.router.not_found)
    app.state.client = client
    app.state.telemetry_hub = hub
    app.add_middleware(GuardMiddleware, client=client)
    return app
