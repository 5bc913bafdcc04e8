"""uvicorn as ``stallfree serve`` runs it: the app, stallfree's WebSocket
protocol (``gateway.edge.ws_protocol``) and the shutdown rules. ``cli/serve.py`` builds the engine's backend (an engine
process of its own by default, or a step thread in this process) and the
``EngineClient``; ``make_server`` puts uvicorn around them.

On SIGTERM/SIGINT the server stops admitting, lets in-flight requests finish
for ``drain_timeout_s``, cancels the rest (clients get their ``done``/error
frame), then stops uvicorn and the engine (the app's lifespan stops the
client, which stops its backend). A second signal exits at once.
If the engine stops for good (see ``EngineClient.fatal``), every stream has
had its error and the server shuts down with exit status 1, for a supervisor
to restart it.
"""

from __future__ import annotations

import asyncio
import socket
from types import FrameType

import structlog
import uvicorn

from stallfree.gateway.app import create_app
from stallfree.gateway.edge.connections import GatewayConfig
from stallfree.gateway.edge.ws_protocol import WebSocketProtocol
from stallfree.gateway.engine.client import EngineClient
from stallfree.gateway.observe.logs import limit_stdlib_repeats

log = structlog.get_logger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, client: EngineClient, send_buffer_bytes: int | None = None) -> None:
        super().__init__(config)
        self.client = client
        self.send_buffer_bytes = send_buffer_bytes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        client.on_engine_failed = self._engine_failed

    def _engine_failed(self, reason: str) -> None:
        """Exit soon, not at once: error frames flush and health probes see the 503."""
        assert self._loop is not None
        self._loop.call_later(self.client.settings.fatal_exit_delay_s, setattr, self, "should_exit", True)

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        if sockets is None and self.send_buffer_bytes:
            # accepted connections inherit the listening socket's send buffer size
            sock = self.config.bind_socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
            sockets = [sock]
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit(sig, frame)))

    async def _drain_then_exit(self, sig: int, frame: FrameType | None) -> None:
        log.info("draining", in_flight=self.client.num_in_flight, timeout_s=self.client.settings.drain_timeout_s)
        await self.client.drain(self.client.settings.drain_timeout_s)
        super().handle_exit(sig, frame)


def make_server(
    client: EngineClient, host: str, port: int, log_level: str = "warning", send_buffer_bytes: int | None = None
) -> DrainingServer:
    """send_buffer_bytes: the kernel send buffer per connection (default: the OS's,
    up to 4 MB here); smaller makes a stalled reader push back sooner."""
    config = GatewayConfig(
        create_app(client),
        client.settings,
        host=host,
        port=port,
        ws=WebSocketProtocol,
        ws_max_size=client.settings.max_frame_bytes * 4,  # larger frames get our own error, not a closed socket
        ws_per_message_deflate=False,  # compressing every tiny token frame costs more than it saves
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=5,
        # keepalive pings find dead peers; slow-but-alive readers are the
        # slow_consumer policy's business, so the pong may take a while
        ws_ping_interval=20.0,
        ws_ping_timeout=60.0,
    )
    limit_stdlib_repeats("uvicorn.error", "uvicorn.access")  # after uvicorn's own logging set-up
    return DrainingServer(config, client, send_buffer_bytes)


def log_startup(client: EngineClient, **facts: object) -> None:
    """The effective configuration, as the article advises reading it from the startup log."""
    s = client.snapshot
    cfg = s.config
    for warning in s.warnings:
        log.warning("config_clamped", detail=warning)
    log.info(
        "engine_started",
        token_budget=cfg.token_budget,
        tbt_slo_ms=cfg.tbt_slo_ms,
        tbt_stretch=cfg.tbt_stretch,
        ttft_slo_ms=cfg.ttft_slo_ms,
        prefill_floor=cfg.prefill_floor,
        chunking=cfg.chunking,
        policy=cfg.policy,
        max_num_seqs=cfg.max_num_seqs,
        max_partial_prefills=cfg.max_partial_prefills,
        long_prefill_tokens=cfg.long_prefill_tokens or ("fits the TBT target" if cfg.tbt_slo_ms else cfg.token_budget),
        max_defer_s=cfg.max_defer_s,
        dynamic_chunking=cfg.dynamic_chunking,
        speculate=cfg.speculate,
        draft_tokens=cfg.draft_tokens,
        ngram=f"{cfg.ngram_min}-{cfg.ngram_max}",
        max_model_len=cfg.max_model_len,
        kv_blocks=s.kv_blocks,
        kv_block_size=s.kv_block_size,
        kv_tokens=s.kv_blocks * s.kv_block_size,
        model=client.settings.model_name,
        **facts,
    )
