"""What a client controls on the wire after its request head: pipelining,
chunk framing, trickled bodies, WebSocket frames before authentication,
fragments and pings (issue 36's findings 1 and 3-7), against the real
gateway on the simulated engine."""

from __future__ import annotations

import contextlib
import socket
import time

import httpx
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.frames import Frame, Opcode

from stallfree.gateway.edge.connections import MAX_PIPELINED
from stallfree.gateway.settings import GatewaySettings
from tests.server import sim_server
from tests.wsclient import recv, send

KEY = "k-one"


@pytest.fixture(scope="module")
def server():
    s = sim_server(settings=GatewaySettings(header_timeout_s=1.0, body_timeout_s=1.5, stalled_connection_s=1.5))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed():
    s = sim_server(settings=GatewaySettings(api_keys=(KEY,), auth_timeout_s=5.0))
    yield s
    s.stop()


def _connections(server) -> list:
    return list(server.server.server_state.connections)


def _read_all(sock: socket.socket, until: bytes | None = None, timeout: float = 20.0) -> bytes:
    sock.settimeout(timeout)
    reply = b""
    with contextlib.suppress(ConnectionResetError):
        while (until is None or until not in reply) and (chunk := sock.recv(1 << 16)):
            reply += chunk
    return reply


def test_pipelined_requests_wait_unparsed_beyond_the_cap_and_all_are_answered(server):
    """A long streaming answer first, then 2,000 pipelined requests in one write:
    at most MAX_PIPELINED of them are parsed into waiting objects at any time
    (uvicorn parsed all of them at once, and read on after every answer)."""
    body = orjson.dumps({"prompt": "hi", "max_tokens": 300, "ignore_eos": True, "stream": True})
    first = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    first += b"Content-Length: %d\r\n\r\n" % len(body) + body
    burst = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 2000
    last = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(first + burst + last)
        deepest = 0
        sock.settimeout(20)
        reply = b""
        while chunk := sock.recv(1 << 16):  # watched while the first answer streams
            reply += chunk
            deepest = max([deepest, *(len(c.pipeline) for c in _connections(server))])
    assert deepest <= MAX_PIPELINED
    assert reply.count(b"HTTP/1.1 200") == 2002 and reply.endswith(b'{"status":"ok"}')


def test_a_client_that_never_reads_its_answers_loses_its_connection(server):
    """29,000 pipelined requests a write, answers never read: once the server's
    writes stay blocked for stalled_connection_s the connection is aborted (it was
    held forever, a blocked answer and unread input with it)."""
    before = len(_connections(server))
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(1)
        burst = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 29_000  # large answers fill the buffers fast
        deadline = time.monotonic() + 30
        aborted = False
        while not aborted and time.monotonic() < deadline:
            try:
                sock.sendall(burst)
            except TimeoutError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                aborted = True
            if len(_connections(server)) <= before:
                aborted = True
    assert aborted


def test_a_chunked_body_cannot_smuggle_an_endless_trailer(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + b"2\r\n{}\r\n0\r\nX-T: ")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(200):  # 1.6 MB of one trailer value, 8 KiB at a time
                sock.sendall(b"a" * 8192)
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 431") and b"trailers over" in reply


def test_an_endless_chunk_extension_is_cut_at_the_head_cap(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + b"5;ext=")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(200):
                sock.sendall(b"v" * 8192)
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 431")
    assert reply.endswith(b"}")  # and then closed: the read ended


def test_a_trickle_after_an_answered_request_does_not_hold_the_connection(server):
    """/healthz answers without reading its declared body; a byte now and then
    used to cancel the keep-alive timer for good. Now the connection closes
    (after a short linger) whatever the client sends."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        assert _read_all(sock, until=b'"ok"}').startswith(b"HTTP/1.1 200")
        sock.settimeout(0.5)
        closed = False
        for _ in range(40):  # a byte every half second, for at most 20 s
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(b"x")
            try:
                closed = sock.recv(1) == b""
            except TimeoutError:
                continue
            except ConnectionResetError:
                closed = True
            if closed:
                break
    assert closed


def test_crlf_between_requests_is_on_the_head_clock(server):
    """Bytes between two requests (llhttp skips CRLFs there) start the next
    head's timer, so a client cannot idle forever on empty lines."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_all(sock, until=b'"ok"}').startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        sock.settimeout(0.5)
        reply = b""
        while time.monotonic() - start < 15 and b"408" not in reply:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(b"\r\n")
            with contextlib.suppress(TimeoutError):
                reply += sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408")


def test_a_response_before_the_body_ends_closes_the_connection(server):
    """A body that trickles past body_timeout_s gets its 408 and the connection
    closes (it stayed open after a 408, reading the rest forever)."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + b'{"prompt":')
        sock.settimeout(0.5)
        reply, closed = b"", False
        for _ in range(40):  # a byte every half second, for at most 20 s
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(b" ")
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                continue
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                closed = True
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408") and b"not received within" in reply
    assert closed


def _raw_ws(port: int, path: str = "/v1/stream") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    assert _read_all(sock, until=b"\r\n\r\n").startswith(b"HTTP/1.1 101")
    return sock


def _frame(opcode: Opcode, data: bytes, fin: bool = True) -> bytes:
    return Frame(opcode, data, fin=fin).serialize(mask=True)


def _close_code(sock: socket.socket) -> int | None:
    """Read frames until the server's close frame; its code."""
    data = _read_all(sock)
    at = data.find(b"\x88")
    while at >= 0:
        size = data[at + 1] & 0x7F
        if 2 <= size <= 125 and at + 2 + size <= len(data):
            return int.from_bytes(data[at + 2 : at + 4], "big")
        at = data.find(b"\x88", at + 1)
    return None


def test_an_unauthenticated_socket_cannot_announce_a_large_frame(keyed):
    """Before the key arrives only an auth frame's worth is read: a 4 MB frame
    header is refused (1009) before its payload is buffered."""
    sock = _raw_ws(keyed.port)
    with sock:
        header = _frame(Opcode.TEXT, b"x" * 4_000_000)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(header[: 1 << 16])
        assert _close_code(sock) == 1009
    for conn in _connections(keyed):  # nothing of it is held
        assert sum(len(b) for b in getattr(conn, "frames", [])) < 1 << 16


async def test_a_keyed_socket_takes_full_frames_once_authenticated(keyed):
    async with connect(keyed.ws_url, max_size=None) as ws:
        await send(ws, type="auth", api_key=KEY)
        assert (await recv(ws))["type"] == "authenticated"
        await send(ws, type="generate", id="g", prompt="hi " * 2000, max_tokens=1)  # 6 kB: over the pre-auth cap
        assert (await recv(ws))["type"] == "accepted"


def test_fragments_are_capped_per_message(server):
    sock = _raw_ws(server.port)
    with sock:
        frames = _frame(Opcode.TEXT, b"", fin=False) + _frame(Opcode.CONT, b"", fin=False) * 100_000
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(frames)
        assert _close_code(sock) == 1009
    assert httpx.get(server.url + "/healthz").status_code == 200


async def test_a_message_in_a_few_fragments_still_works(server):
    async with connect(server.ws_url) as ws:
        await ws.send(['{"type":', '"ping"', "}"])  # three fragments
        assert (await recv(ws))["type"] == "pong"


def test_a_ping_flood_from_a_client_that_never_reads_is_not_buffered(server):
    """Pongs wait in the transport only up to its high-water mark; past it the
    server stops reading the client (and drops pongs it could not send)."""
    sock = _raw_ws(server.port)
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        ping = _frame(Opcode.PING, b"p" * 125)
        sock.settimeout(2)
        sent = 0
        with contextlib.suppress(TimeoutError, BrokenPipeError, ConnectionResetError):
            for _ in range(200):  # up to 200 x 1,000 pings (26 MB); the server stops reading long before
                sock.sendall(ping * 1000)
                sent += 1000
        buffered = max((c.transport.get_write_buffer_size() for c in _connections(server) if c.transport), default=0)
    assert sent < 200_000  # the sender was held back
    assert buffered < 1 << 20


def test_a_warning_a_client_can_cause_is_logged_a_few_times_per_window(server):
    """2,000 h2c upgrade requests wrote 2,000 warning lines; now at most
    REPEATS_PER_WINDOW per minute, and the next one says how many were dropped."""
    import logging

    from stallfree.gateway.observe.logs import REPEATS_PER_WINDOW

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Collect()
    logging.getLogger("uvicorn.error").addHandler(handler)
    try:
        h2c = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        h2c += b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\nConnection: close\r\n\r\n"
        for _ in range(50):
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(h2c)
                _read_all(sock, timeout=5)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    upgrades = [line for line in lines if "Unsupported upgrade" in line]
    assert 1 <= len(upgrades) <= REPEATS_PER_WINDOW


def test_the_repeat_limit_reports_what_it_dropped():
    from stallfree.gateway.observe.logs import RepeatLimit

    now = [0.0]
    limit = RepeatLimit(burst=3, window_s=10.0, clock=lambda: now[0])
    assert [limit.admit("a") for _ in range(5)] == [0, 0, 0, None, None]
    assert limit.admit("b") == 0  # each cause its own
    now[0] = 10.0
    assert limit.admit("a") == 2  # a new window: the two dropped are reported
    assert limit.admit("a") == 0


def test_bytes_after_an_early_answer_are_dropped_without_an_error(keyed):
    """A keyed server answers 401 at the head; the chunked body and an endless
    trailer that follow are dropped during the linger, with no write after the
    shut end (it raised inside the transport and the app)."""
    import logging

    errors: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR:
                errors.append(record.getMessage())

    handler = Collect()
    for name in ("asyncio", "uvicorn.error"):
        logging.getLogger(name).addHandler(handler)
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-T: "
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", keyed.port)) as sock:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    sock.sendall(head)
                    for _ in range(100):
                        sock.sendall(b"a" * 8192)
                reply = _read_all(sock)
            assert reply.startswith(b"HTTP/1.1 401")
    finally:
        for name in ("asyncio", "uvicorn.error"):
            logging.getLogger(name).removeHandler(handler)
    assert errors == []
