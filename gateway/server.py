"""uvicorn as ``stallfree serve`` runs it: the app, stallfree's WebSocket
protocol (frames written in one go, bounded unacknowledged bytes) and the
shutdown rules. ``cli/serve.py`` builds the engine's backend (an engine
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
from typing import Any

import orjson
import structlog
import uvicorn
from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import PayloadTooBig, WebSocketException
from websockets.frames import CloseCode, Frame, Opcode
from websockets.protocol import State
from websockets.server import ServerProtocol

from stallfree.gateway.app import create_app
from stallfree.gateway.edge.connections import (
    AUTHENTICATED,
    OPEN_GENERATIONS,
    SEND_FRAMES,
    UNACKED_BYTES,
    GatewayConfig,
    WriteStall,
    unacked_bytes,
)
from stallfree.gateway.engine.client import EngineClient
from stallfree.gateway.observe.logs import limit_stdlib_repeats

log = structlog.get_logger(__name__)

AUTH_FRAME_BYTES = 4096  # the largest message a keyed socket reads before its key: an auth frame's worth
MAX_FRAGMENTS = 1024  # frames in one fragmented message


class _TooManyFragments(PayloadTooBig):
    """A message in more frames than MAX_FRAGMENTS: closed as too big (1009)."""

    def __init__(self) -> None:
        WebSocketException.__init__(self)
        self.message = f"a message in more than {MAX_FRAGMENTS} fragments"
        self.size, self.max_size, self.current_size = None, 0, None


class _FrameLimits(ServerProtocol):
    """websockets' server protocol with a cap on a message's fragments: empty
    continuation frames never reach the size cap, and 5 million of them cost
    23 s of the event loop's CPU."""

    fragments = 0

    def recv_frame(self, frame: Frame) -> None:
        if frame.opcode is Opcode.CONT:
            self.fragments += 1
            if self.fragments > MAX_FRAGMENTS:
                raise _TooManyFragments
        elif frame.opcode in (Opcode.TEXT, Opcode.BINARY):
            self.fragments = 1
        super().recv_frame(frame)


class WebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O WebSocket protocol, plus:

    - a frame over the protocol's size cap (4x ``max_frame_bytes``; frames
      between the two get an error and the socket stays open) gets an
      ``invalid_request`` error frame before the 1009 close, so the client
      learns why, and so does each generation still running on the socket
      (``OPEN_GENERATIONS``);
    - on a server with API keys, a socket reads messages of at most
      ``AUTH_FRAME_BYTES`` until the app has its key (``AUTHENTICATED``), so a
      socket without one buffers nothing larger than an auth frame;
    - a message in more than ``MAX_FRAGMENTS`` frames is closed as too big;
    - a client that does not read what it is sent is not read either: while
      the transport's buffer is over its high-water mark the socket is not
      read, and pings met then get no pong (RFC 6455 lets a pong answer only
      the latest ping), so a ping flood cannot queue pongs without bound;
      after ``stalled_connection_s`` of that the socket is aborted (``WriteStall``);
    - the app can see how much the client has not yet taken
      (``UNACKED_BYTES``) and write many frames at once (``SEND_FRAMES``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        old = self.conn
        self.conn = _FrameLimits(
            extensions=old.available_extensions, max_size=self.config.ws_max_size, logger=old.logger
        )
        self.write_paused = False
        settings = getattr(self.config, "settings", None)
        self.write_stall = WriteStall(self.loop, settings.stalled_connection_s if settings is not None else 60.0)
        self.authenticated = not (settings is not None and settings.api_keys)
        if not self.authenticated:
            self.conn.max_message_size = AUTH_FRAME_BYTES

    def handle_connect(self, event: Any) -> None:
        """Gives the app a probe of what the client has not taken (its slow-consumer check)."""
        super().handle_connect(event)
        if getattr(self, "scope", None) is not None:
            extensions: dict[str, Any] = self.scope["extensions"]  # type: ignore[assignment]
            extensions[UNACKED_BYTES] = lambda: unacked_bytes(self.transport)
            self.open_generations: dict[str, Any] = {}  # filled by the app: id -> generation
            extensions[OPEN_GENERATIONS] = self.open_generations
            extensions[SEND_FRAMES] = self.send_frames
            extensions[AUTHENTICATED] = self.authenticate

    def authenticate(self) -> None:
        """The app has the socket's key: full-size messages from now on."""
        self.authenticated = True
        self.conn.max_message_size = self.config.ws_max_size

    def pause_writing(self) -> None:
        super().pause_writing()
        self.write_paused = True
        self.transport.pause_reading()
        self.write_stall.paused(self.transport)

    def resume_writing(self) -> None:
        super().resume_writing()
        self.write_paused = False
        self.write_stall.resumed()
        if not self.read_paused:
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.write_stall.resumed()
        super().connection_lost(exc)

    async def receive(self) -> Any:
        message = await super().receive()
        if self.write_paused:  # uvicorn resumes reading once the app has taken every message
            self.transport.pause_reading()
        return message

    def handle_ping(self) -> None:
        pongs = self.conn.data_to_send()
        if not self.write_paused:
            self.transport.write(b"".join(pongs))

    async def send_frames(self, frames: list[bytes]) -> None:
        """Text frames (UTF-8 JSON) in one write: a connection's tokens of one
        iteration cost one system call, not one per generation (at 1,000
        streams, one write per frame was the gateway's largest cost). Server
        frames are unmasked and unfragmented, so each is its RFC 6455 header
        and the payload (a quarter of the cost of the protocol object's send)."""
        await self.writable.wait()  # the transport's flow control, as for any ASGI send
        if self.disconnected or self.close_sent or self.conn.state is not State.OPEN:
            raise ClientDisconnected()
        out: list[bytes] = []
        for frame in frames:
            out += (text_frame_header(len(frame)), frame)
        self.transport.write(b"".join(out))

    def handle_parser_exception(self) -> None:
        closing = self.conn.close_sent
        if closing is not None and closing.code == CloseCode.MESSAGE_TOO_BIG:
            why = f"frame too large: {closing.reason}"
            if not self.authenticated:
                why = f"send {{'type': 'auth', 'api_key': ...}} first (until then, at most {AUTH_FRAME_BYTES} bytes)"
            # the socket closes: each generation on it ends with an error, then the frame's own
            for gen_id in [*getattr(self, "open_generations", {}), None]:
                error = {"type": "error", "id": gen_id, "code": "invalid_request", "message": why}
                self.transport.write(Frame(Opcode.TEXT, orjson.dumps(error)).serialize(mask=False))
        super().handle_parser_exception()


def text_frame_header(size: int) -> bytes:
    """FIN + text opcode, then the payload length in 7, 7+16 or 7+64 bits (RFC 6455 5.2)."""
    if size < 126:
        return bytes((0x81, size))
    if size < 1 << 16:
        return b"\x81\x7e" + size.to_bytes(2, "big")
    return b"\x81\x7f" + size.to_bytes(8, "big")


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
