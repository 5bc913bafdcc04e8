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
  process keeps the file descriptors it needs to serve everyone else.
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

from gateway.settings import GatewaySettings

LINGER_S = 2.0  # a refused connection's unread input is drained this long before the close
REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


class GatewayConfig(uvicorn.Config):
    """uvicorn's configuration with the gateway's settings, for the protocols to read."""

    def __init__(self, app: Any, settings: GatewaySettings, **kwargs: Any) -> None:
        super().__init__(app, http=LimitedHttpProtocol, **kwargs)
        self.settings = settings


class _Refused(httptools.HttpParserError):
    """Raised in a parser callback to stop parsing; the response is the protocol's refusal."""


class LimitedHttpProtocol(HttpToolsProtocol):
    config: GatewayConfig

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        s = self.config.settings
        self._head_bytes = 0
        self._num_headers = 0
        self._in_head = True
        self._tail = b""  # the last bytes read, for a head's end split across two reads
        self._refusal: tuple[int, str] | None = None
        self._head_timer: asyncio.TimerHandle | None = self.loop.call_later(s.header_timeout_s, self._head_timed_out)
        host = self.client[0] if self.client else None
        if len(self.connections) > s.max_connections:
            self._refuse(503, f"too many open connections (the server's limit is {s.max_connections})")
        elif host is not None and _count(self.connections, host) > s.max_connections_per_client:
            self._refuse(503, f"too many open connections from {host} (limit {s.max_connections_per_client})")

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return
        if self._in_head:
            # a head that does not end in this read counts whole; one that does is
            # let through, so a head is cut within the cap plus one read (64 KiB)
            if (self._tail + data).find(b"\r\n\r\n") < 0:
                self._head_bytes += len(data)
                if self._head_bytes > self.config.settings.max_header_bytes:
                    self._refuse(431, f"request line and headers over {self.config.settings.max_header_bytes} bytes")
                    return
            self._tail = data[-3:]
        super().data_received(data)

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
        self._stop_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True  # what comes next on this connection is another request's head

    def send_400_response(self, msg: str) -> None:
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
        self._refusal = (status, message)
        self._stop_head_timer()
        code = {408: "timeout", 431: "invalid_request", 503: "unavailable"}[status]
        body = orjson.dumps({"error": {"message": message, "type": code, "code": code}})
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        self.transport.write(head % (status, REASONS[status], len(body)) + body)
        if status == 431 and self.transport.can_write_eof():  # a client cut mid-send; others close at once
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()


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
