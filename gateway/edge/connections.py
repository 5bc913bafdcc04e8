"""Limits on what a client controls before its request reaches the app.

uvicorn's HTTP protocol (httptools) reads a request head of any size, waits
for it forever and accepts any number of connections: one 128 MB header cost
37 s of CPU on the event loop every stream shares, and idle sockets held the
process at its file limit. Here, before the parser sees a byte:

- the request line and headers together are capped (431), and so is their
  count (431);
- they must arrive within ``header_timeout_s`` of the connection (or of the
  request's first byte on a kept-alive one); an idle or slowloris connection
  gets 408 and is closed;
- open connections (HTTP and WebSocket) are capped in all and per client
  address: over either, a 503 and the connection closes at once, so the
  process keeps the file descriptors it needs to serve everyone else;
- pipelined requests are answered in order, at most ``MAX_PIPELINED`` parsed
  and waiting behind the running one: what was read beyond them is held
  unparsed and reading stays paused until an answer makes room (each waiting
  request was an object, and 29,000 of them per write grew the process by
  1.6 GB); only requests hidden behind a chunked body can overflow the cap,
  and then what is queued is answered and the connection closes;
- what a request sends after its head that is not body (chunk-size lines,
  chunk extensions, trailers) is capped like a head: a run of it over
  ``max_header_bytes`` with no body byte between is refused (431) and closed;
- a response sent before its request's body was read whole (a 408 for a body
  that trickled, a ``/healthz`` that ignored its ``Content-Length``) ends the
  connection: what follows on the wire is the rest of that body, and each
  trickled byte used to cancel the keep-alive timer for good;
- a connection whose client takes nothing of what it is sent for
  ``stalled_connection_s`` (the transport's buffer stays over its high-water mark)
  is aborted, HTTP and WebSocket alike (``WriteStall``): a pipelining client
  that never read its answers held its connection, a blocked response and
  its unread input forever.
"""

from __future__ import annotations

import asyncio
import fcntl
import resource
import struct
import termios
from typing import Any

import httptools
import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from stallfree.gateway.settings import GatewaySettings

LINGER_S = 2.0  # a refused connection's unread input is drained this long before the close
MAX_PIPELINED = 16  # requests parsed and waiting behind the one running, per connection
REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


class GatewayConfig(uvicorn.Config):
    """uvicorn's configuration with the gateway's settings, for the protocols to read."""

    def __init__(self, app: Any, settings: GatewaySettings, **kwargs: Any) -> None:
        super().__init__(app, http=LimitedHttpProtocol, **kwargs)
        self.settings = settings


class _Refused(httptools.HttpParserError):
    """Raised in a parser callback to stop parsing; the response is the protocol's refusal."""


class _PipelineFull(httptools.HttpParserError):
    """Raised in a parser callback to stop parsing at a request the pipeline has no room for."""


class WriteStall:
    """Aborts a transport whose writing stays paused (the client reads nothing) for ``limit_s``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit_s: float) -> None:
        self.loop, self.limit_s = loop, limit_s
        self._timer: asyncio.TimerHandle | None = None

    def paused(self, transport: asyncio.BaseTransport) -> None:
        if self._timer is None:
            self._timer = self.loop.call_later(self.limit_s, _abort, transport)

    def resumed(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _abort(transport: asyncio.BaseTransport) -> None:
    if not transport.is_closing():
        transport.abort()  # type: ignore[attr-defined]


class LimitedHttpProtocol(HttpToolsProtocol):
    config: GatewayConfig

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        s = self.config.settings
        self._head_bytes = 0
        self._num_headers = 0
        self._in_head = True
        self._tail = b""  # the last bytes read, for a head's end split across two reads
        self._framing = 0  # bytes read after a head with no body byte among them (chunk lines, trailers)
        self._refusal: tuple[int, str] | None = None
        self._pipeline_full = False  # the parser stopped: answer what is queued, then close
        self._held, self._held_at = b"", 0  # read and not yet fed to the parser (the pipeline was full)
        self._body_left: int | None = None  # of a Content-Length body being read
        self._waiting_for_room = False  # reading paused until the pipeline has room
        self._lingering = False  # our end is shut: what still arrives is dropped until the close
        self._write_stall = WriteStall(self.loop, s.stalled_connection_s)
        self._head_timer: asyncio.TimerHandle | None = self.loop.call_later(s.header_timeout_s, self._head_timed_out)
        host = self.client[0] if self.client else None
        if len(self.connections) > s.max_connections:
            self._refuse(503, f"too many open connections (the server's limit is {s.max_connections})")
        elif host is not None and _count(self.connections, host) > s.max_connections_per_client:
            self._refuse(503, f"too many open connections from {host} (limit {s.max_connections_per_client})")

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        self._write_stall.resumed()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._write_stall.paused(self.transport)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._write_stall.resumed()

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None or self._pipeline_full or self._lingering:
            return
        self._held = self._held[self._held_at :] + data if self._held_at < len(self._held) else data
        self._held_at = 0
        self._take_held()

    def _take_held(self) -> None:
        """Feed what was read, one request head (or known-length body) at a time,
        stopping while the pipeline is full: the parser itself cannot pause."""
        held = self._held
        while self._held_at < len(held) and self._refusal is None and not self._pipeline_full:
            if self._in_head and self._running() and len(self.pipeline) >= MAX_PIPELINED:
                self._waiting_for_room = True  # an answer makes room and feeds the rest (on_response_complete)
                self.flow.pause_reading()
                return
            at = self._held_at
            if self._in_head:  # up to the head's end, which may have begun in the last piece
                split = (self._tail + held[at : at + 4]).find(b"\r\n\r\n")
                found = held.find(b"\r\n\r\n", at)
                if split >= 0:
                    n = split + 4 - len(self._tail)
                elif found >= 0:
                    n = found + 4 - at
                else:
                    n = len(held) - at
            elif self._body_left:
                n = min(self._body_left, len(held) - at)
            else:
                n = len(held) - at
            self._held_at = at + n
            self._take(memoryview(held)[at : at + n])
        self._held, self._held_at = b"", 0
        if self._waiting_for_room:
            self._waiting_for_room = False
            self.flow.resume_reading()

    def _take(self, data: memoryview) -> None:
        if self._in_head and self._head_timer is None:  # bytes between requests: the next head's clock starts
            self._head_timer = self.loop.call_later(self.config.settings.header_timeout_s, self._head_timed_out)
        if self._in_head:
            # a head that does not end in this piece counts whole; one that does is
            # let through, so a head is cut within the cap plus one read (64 KiB)
            if (self._tail + bytes(data)).find(b"\r\n\r\n") < 0:
                self._head_bytes += len(data)
                if self._head_bytes > self.config.settings.max_header_bytes:
                    self._refuse(431, f"request line and headers over {self.config.settings.max_header_bytes} bytes")
                    return
            self._tail = bytes(data[-3:])
        else:
            self._framing += len(data)  # on_body sets it back; what is left counts
        self._feed(data)
        if not self._in_head and self._framing > self.config.settings.max_header_bytes and self._refusal is None:
            limit = self.config.settings.max_header_bytes
            self._refuse(431, f"chunk lines, extensions and trailers over {limit} bytes with no body between")

    def _running(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _feed(self, data: memoryview) -> None:
        """uvicorn's data_received, less its warning for a parser we stopped on purpose."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError:
            if not self._pipeline_full and self._refusal is None:
                self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")

    # parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._num_headers = 0
        self._head_bytes = 0
        if self._head_timer is None:  # the next request on a kept-alive connection
            self._head_timer = self.loop.call_later(self.config.settings.header_timeout_s, self._head_timed_out)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > self.config.settings.max_headers:
            self._refusal = (431, f"more than {self.config.settings.max_headers} header fields")
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._framing = 0
        self._tail = b""
        self._body_left = _content_length(self.headers)
        self._stop_head_timer()
        if self._running() and len(self.pipeline) >= MAX_PIPELINED:
            self._pipeline_full = True
            raise _PipelineFull
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._framing = 0
        if self._body_left is not None:
            self._body_left -= len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True  # what comes next on this connection is another request's head
        self._framing = 0
        self._body_left = None

    def on_response_complete(self) -> None:
        """Reading resumes only once nothing waits (uvicorn resumed it after
        every answer, so a client that pipelines forever was read forever);
        a request whose body was not read whole ends the connection."""
        unread_body = not self.pipeline and self.cycle is not None and self.cycle.more_body
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if unread_body:
            self._stop_head_timer()
            self._unset_keepalive_if_required()
            self._linger_close()
        elif self._pipeline_full:
            self.flow.pause_reading()
            if not self.pipeline and self.cycle.response_complete:
                self.transport.close()  # the last queued answer is out; the rest was never read
        elif self._waiting_for_room or self.pipeline:
            self.flow.pause_reading()  # uvicorn resumed it; what was read and held comes first
            if self._waiting_for_room:
                self.loop.call_soon(self._take_held)

    def send_400_response(self, msg: str) -> None:
        if self._pipeline_full:  # not an error: what is queued is answered, then the connection closes
            self.flow.pause_reading()
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()
            return
        if self._refusal is not None:  # a limit stopped the parser: say which
            status, message = self._refusal
            self._refusal = None
            self._refuse(status, message)
        else:
            super().send_400_response(msg)

    # refusals
    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            limit = self.config.settings.header_timeout_s
            self._refuse(408, f"request line and headers not received within {limit:g} s")

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse(self, status: int, message: str) -> None:
        """An error response in the API's shape, then close. A head cut at the cap
        is mid-send: our end is shut and what the client still sends is read and
        dropped for LINGER_S before the close (closing on unread data resets the
        connection, and the reset can destroy the 431 before the client reads it)."""
        if self._lingering or self.transport.is_closing():
            return
        self._refusal = (status, message)
        self._stop_head_timer()
        if self._running() and self.cycle.response_started:  # an answer is on its way: close after it
            self.cycle.keep_alive = False
            return
        code = {408: "timeout", 431: "invalid_request", 503: "unavailable"}[status]
        body = orjson.dumps({"error": {"message": message, "type": code, "code": code}})
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        self.transport.write(head % (status, REASONS[status], len(body)) + body)
        if self._running():  # the app waiting on this request's body sees a disconnect and writes nothing
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        if status == 431:  # a client cut mid-send; others close at once
            self._linger_close()
        else:
            self.transport.close()

    def _linger_close(self) -> None:
        """Shut our end, drop what the client still sends, close after LINGER_S."""
        self._lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """A body's declared length (the parser has checked it), None when chunked."""
    if any(name == b"transfer-encoding" for name, _ in headers):
        return None
    for name, value in headers:
        if name == b"content-length":
            return int(value)
    return 0


def _count(connections: set[Any], host: str) -> int:
    return sum(1 for c in connections if c.client and c.client[0] == host)


def raise_file_limit() -> tuple[int, int]:
    """The soft limit on open files raised to the hard one (each connection is a
    file); returns (before, after) for the start-up log."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


UNACKED_BYTES = "stallfree.unacked_bytes"  # scope extension: () -> bytes sent the client has not taken
OPEN_GENERATIONS = "stallfree.open_generations"  # scope extension: the socket's running generations, by id
SEND_FRAMES = "stallfree.send_frames"  # scope extension: async (list of text frames) -> one write to the socket
AUTHENTICATED = "stallfree.authenticated"  # scope extension: () -> None, the socket's key is known: full-size frames


def unacked_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes written to the socket that the client's kernel has not acknowledged
    (Linux SIOCOUTQ; 0 where unknown). It grows once the client stops reading
    and its receive window fills, and shrinks only when it reads again."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0])
    except OSError:
        return 0
