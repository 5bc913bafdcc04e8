"""stallfree's WebSocket protocol under uvicorn: the edge of a socket, before any
handler. Frames are written in one go (``send_frames``), unacknowledged bytes are
bounded (a client that does not read is not read either, then aborted), a
socket without its key reads only auth-sized messages, and fragmented messages
are capped. The app reaches these through the scope's extensions
(``gateway.edge.connections``: ``UNACKED_BYTES``, ``SEND_FRAMES``,
``OPEN_GENERATIONS``, ``AUTHENTICATED``); ``gateway.server`` hands uvicorn the class.
"""

from __future__ import annotations

from typing import Any

import orjson
from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import PayloadTooBig, WebSocketException
from websockets.frames import CloseCode, Frame, Opcode
from websockets.protocol import State
from websockets.server import ServerProtocol

from stallfree.gateway.edge.connections import (
    AUTHENTICATED,
    OPEN_GENERATIONS,
    SEND_FRAMES,
    UNACKED_BYTES,
    WriteStall,
    unacked_bytes,
)

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
