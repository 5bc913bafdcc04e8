"""``GET /v1/stream``: JSON text frames, several generations per connection.

Client -> server: ``generate``, ``cancel``, ``ping``, ``auth`` (see ``ws_auth``).
Server -> client: ``accepted``, ``token``, ``done``, ``error``, ``pong``, and
``stalled`` / ``resumed`` when the engine stops answering and answers again.
A disconnect aborts every generation of the connection at once.

One writer task per connection empties all of its generations' streams when
any of them has output (one wake-up per connection per iteration, not one
per generation), detokenizes synchronously and writes all the frames in one
write to the socket where the server offers it (``SEND_FRAMES``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import orjson
import structlog
from starlette.websockets import WebSocket, WebSocketDisconnect

from stallfree.core.sched.timings import request_timings
from stallfree.gateway.edge.auth import tenant_of
from stallfree.gateway.edge.connections import OPEN_GENERATIONS, SEND_FRAMES, UNACKED_BYTES
from stallfree.gateway.edge.ws_auth import accept
from stallfree.gateway.engine.client import EngineClient
from stallfree.gateway.engine.pieces import Piece, PieceMaker, ready_pieces
from stallfree.gateway.engine.streams import Notice, RequestStream
from stallfree.gateway.inputs.protocol import (
    GenerateRequest,
    ProtocolError,
    boolean,
    parse_generate,
    parse_json_object,
    parse_off_loop,
)

log = structlog.get_logger(__name__)

TIMINGS = (
    "queue_wait_ms",
    "scheduling_delay_ms",
    "prefill_ms",
    "decode_ms",
    "ttft_ms",
    "e2e_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "max_gap_ms",
)
PROBE_S = 1.0  # how often a socket's unread bytes are looked at
WS_DEFAULTS = {"max_tokens": 128, "temperature": 0.0}


@dataclass(slots=True)
class _Generation:
    request_id: str | None = None  # set once accepted
    cancelled: bool = False
    stream: RequestStream | None = None
    maker: PieceMaker | None = None
    prompt_tokens: int = 0
    sent_tokens: int = 0
    timestamps: bool = False  # add the engine's emit time to token frames


class Connection:
    def __init__(self, ws: WebSocket, client: EngineClient, tenant: str) -> None:
        self.ws = ws
        self.client = client
        self.settings = client.settings
        # the running generations by id; the protocol's own dict, so that if it must close
        # the socket it can end each of them with an error frame first
        extensions = ws.scope.get("extensions", {})
        self.gens: dict[str, _Generation] = extensions.get(OPEN_GENERATIONS, {})
        self.tenant = tenant  # the API key's id ("" without keys)
        self.closed = False
        self._ready: dict[str, None] = {}  # generations with output to send, in order
        self._wake = anyio.Event()
        # the client's reading: bytes it has not taken, and when that last shrank
        self._unacked: Callable[[], int] | None = extensions.get(UNACKED_BYTES)
        self._send_frames: Callable[[list[bytes]], Awaitable[None]] | None = extensions.get(SEND_FRAMES)
        self._last_unacked = 0
        self._taken_at = self._probe_at = time.monotonic()

    async def send(self, frame: dict[str, Any]) -> None:
        out: list[bytes] = []
        _encode(frame, out)
        await self._write(out)

    async def _write(self, frames: list[bytes]) -> None:
        if self.closed or not frames:
            return
        try:
            if self._send_frames is not None:
                await self._send_frames(frames)
            else:
                for frame in frames:
                    await self.ws.send_text(frame.decode())
        except (WebSocketDisconnect, RuntimeError, OSError):
            self.closed = True  # the reader sees the disconnect and cleans up

    async def error(self, code: str, message: str, gen_id: str | None = None, retry_after_s: int = 0) -> None:
        await self.send(self._error(code, message, gen_id, retry_after_s))

    def _error(self, code: str, message: str, gen_id: str | None = None, retry_after_s: int = 0) -> dict[str, Any]:
        self.client.report_error(code)
        frame: dict[str, Any] = {"type": "error", "id": gen_id, "code": code, "message": message}
        if retry_after_s:
            frame["retry_after_s"] = retry_after_s
        return frame

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._writer)
                try:
                    while (message := await self.ws.receive())["type"] != "websocket.disconnect":
                        if (frame := await self._parse(message)) is not None:
                            await self._dispatch(frame.get("type"), frame, tg)
                finally:
                    self.closed = True
                    for generation in self.gens.values():
                        generation.cancelled = True
                        if generation.request_id is not None:
                            self.client.cancel(generation.request_id)
                    tg.cancel_scope.cancel()
        finally:  # every task has ended, so no stream can still turn up
            for generation in self.gens.values():
                if generation.stream is not None:
                    generation.stream.close()

    async def _parse(self, message: Mapping[str, Any]) -> dict[str, Any] | None:
        text = message.get("text")
        if text is None:
            await self.error("invalid_request", "binary frames are not supported; send JSON text frames")
            return None
        if len(text.encode()) > self.settings.max_frame_bytes:  # bytes, as the limit says, not characters
            await self.error("invalid_request", f"frame larger than {self.settings.max_frame_bytes} bytes")
            return None
        try:
            return parse_json_object(text, "frame")
        except ProtocolError as exc:
            await self.error(exc.code, exc.message)
            return None

    async def _dispatch(self, kind: Any, frame: dict[str, Any], tg: anyio.abc.TaskGroup) -> None:
        if kind == "ping":
            await self.send({"type": "pong"})
        elif kind == "auth":  # again, on a socket already open
            if not self.settings.api_keys:
                await self.error("invalid_request", "this server takes no API key")
            elif tenant_of(frame.get("api_key"), self.settings.api_keys, self.settings.admin_keys) != self.tenant:
                self.client.report_error("unauthorized")
                await self.error("unauthorized", "wrong API key (this socket keeps the key it opened with)")
            else:
                await self.send({"type": "authenticated"})
        elif kind == "cancel":
            gen_id = _echo(frame.get("id"))
            generation = self.gens.get(gen_id) if gen_id is not None else None
            if generation is None:
                await self.error("invalid_request", "cancel needs the id of a running generation", gen_id)
                return
            generation.cancelled = True
            if generation.request_id is not None:
                self.client.cancel(generation.request_id)
        elif kind == "generate":
            gen_id = frame.get("id")
            if not isinstance(gen_id, str) or not 0 < len(gen_id) <= 128:
                await self.error("invalid_request", "generate needs an id: a string of 1 to 128 characters")
            elif gen_id in self.gens:
                await self.error("invalid_request", f"id {gen_id!r} is already running", gen_id)
            elif len(self.gens) >= self.settings.max_generations_per_connection:
                limit = self.settings.max_generations_per_connection
                await self.error("overloaded", f"at most {limit} generations per connection", gen_id)
            else:
                self.gens[gen_id] = _Generation()
                tg.start_soon(self._start, gen_id, frame)
        else:
            named = f" {kind!r}" if isinstance(kind, str) and len(kind) <= 32 else ""
            await self.error(
                "invalid_request", f"unknown frame type{named}: generate, cancel, ping or auth", _echo(frame.get("id"))
            )

    async def _start(self, gen_id: str, frame: dict[str, Any]) -> None:
        """Validate, tokenize (off the loop) and submit; the writer streams the rest."""
        generation = self.gens[gen_id]
        try:
            gen = await parse_off_loop(_parse, frame, self.client)
            gen.tenant = self.tenant
            timestamps = boolean(frame, "timestamps")
            if gen.traceparent is None:
                gen.traceparent = self.ws.headers.get("traceparent")
            request_id = self.client.new_id("ws")
            stream, generation.prompt_tokens = await self.client.submit(gen, request_id)
        except ProtocolError as exc:
            self.gens.pop(gen_id, None)
            await self.error(exc.code, exc.message, gen_id, exc.retry_after_s)
            return
        generation.request_id, generation.stream = request_id, stream
        generation.timestamps = timestamps
        generation.maker = PieceMaker(
            self.client.tokenizer.token_bytes, gen.sampling.stop, lambda: self.client.cancel(request_id)
        )
        if generation.cancelled:  # cancelled (or disconnected) while tokenizing
            self.client.cancel(request_id)
        accepted: dict[str, Any] = {"type": "accepted", "id": gen_id, "prompt_tokens": generation.prompt_tokens}
        if stream.verdict is not None:  # admission's prediction under a TTFT target
            accepted["predicted_ttft_ms"] = round(stream.verdict.predicted_s * 1e3)
            accepted["best_effort"] = not stream.verdict.on_time
        await self.send(accepted)
        stream.on_put = lambda: self._notify(gen_id)
        self._notify(gen_id)  # anything that arrived before the accepted frame went out

    def _notify(self, gen_id: str) -> None:
        self._ready[gen_id] = None
        self._wake.set()

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            if self._reader_stalled():
                self._cut_off()
            ready, self._ready = self._ready, {}
            out: list[bytes] = []
            for gen_id in ready:
                self._encode_output(gen_id, out)
            await self._write(out)

    def _reader_stalled(self) -> bool:
        """Has the client taken nothing for ``slow_consumer_s`` while frames wait
        for it? Output that fits the sockets' buffers never blocks a send, so the
        queue-based cut-off alone let a reader that never reads hold its KV."""
        now = time.monotonic()
        if self._unacked is None or now < self._probe_at:
            return False
        self._probe_at = now + PROBE_S  # a syscall: not every iteration
        unacked = self._unacked()
        if unacked == 0 or unacked < self._last_unacked:
            self._taken_at = now
        self._last_unacked = unacked
        return now - self._taken_at > self.settings.slow_consumer_s

    def _cut_off(self) -> None:
        for generation in self.gens.values():
            if generation.request_id is not None:
                self.client.cut_off(generation.request_id, unacked_bytes=self._last_unacked)

    def _encode_output(self, gen_id: str, out: list[bytes]) -> None:
        """Encode what the generation has produced onto ``out`` (nothing here awaits,
        so frames from one wake-up go out together and in order)."""
        generation = self.gens.get(gen_id)
        if generation is None or generation.stream is None or generation.maker is None:
            return
        for piece in ready_pieces(generation.stream, generation.maker):
            if isinstance(piece, Notice):
                _encode({"type": piece.kind, "id": gen_id, "silent_ms": piece.silent_ms}, out)
                continue
            if isinstance(piece, ProtocolError):
                self.gens.pop(gen_id, None)
                _encode(self._error(piece.code, piece.message, gen_id), out)
                return
            if piece.token_ids or piece.text:
                generation.sent_tokens += len(piece.token_ids)
                frame = {"type": "token", "id": gen_id, "index": piece.index, "text": piece.text}
                frame["token_ids"] = piece.token_ids
                if piece.logprobs is not None:
                    frame["logprobs"] = [
                        {"token_id": t, "logprob": lp.logprob, "top": [list(pair) for pair in lp.top]}
                        for t, lp in zip(piece.token_ids, piece.logprobs, strict=True)
                    ]
                if generation.timestamps:  # when the engine produced these tokens, and when this frame goes out
                    frame["emit_ns"] = piece.emit_ns
                    frame["sent_ns"] = time.perf_counter_ns()
                _encode(frame, out)
            if piece.finish_reason is not None:
                self.gens.pop(gen_id, None)
                _encode(_done(gen_id, piece, generation.prompt_tokens, generation.sent_tokens), out)
                return


def _parse(frame: dict[str, Any], client: EngineClient) -> GenerateRequest:
    return parse_generate(frame, WS_DEFAULTS, client.snapshot.config.max_model_len)


def _encode(frame: dict[str, Any], out: list[bytes]) -> None:
    """Append the frame as JSON; one that cannot be encoded is a bug, not the
    client's: it is logged and lost, and the socket's other frames are not."""
    try:
        out.append(orjson.dumps(frame))
    except orjson.JSONEncodeError:
        log.exception("frame_not_encodable", type=frame.get("type"), id=_echo(frame.get("id")))


def _echo(gen_id: object) -> str | None:
    """An id fit to send back: a string of at most 128 characters (else None,
    so a client's 500 kB or deeply nested "id" never comes back to it)."""
    return gen_id if isinstance(gen_id, str) and len(gen_id) <= 128 else None


def _done(gen_id: str, piece: Piece, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    end = piece.end
    timings = request_timings(end.timeline).as_dict() if end is not None else {}
    return {
        "type": "done",
        "id": gen_id,
        "finish_reason": piece.finish_reason,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": end.num_cached_tokens if end is not None else 0,
            "draft_tokens": end.num_draft_tokens if end is not None else 0,
            "accepted_draft_tokens": end.num_accepted_tokens if end is not None else 0,
        },
        "timings": {k: timings.get(k, 0.0) for k in TIMINGS},
    }


async def stream_endpoint(ws: WebSocket) -> None:
    client: EngineClient = ws.app.state.client
    tenant = await accept(ws, client)
    if tenant is not None:
        await Connection(ws, client, tenant).run()
