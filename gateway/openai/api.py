"""What the OpenAI-compatible endpoints share: reading and checking a body,
errors, ``/v1/models``, and answering every choice of a prompt (OpenAI's
``n``) in one response or one SSE stream.

Streaming is SSE (``data: {...}`` chunks, then ``data: [DONE]``), with
``stream_options.include_usage``. A client that disconnects aborts its
request (and frees its KV) whether it streams or not. Which of OpenAI's
fields are honoured is ``gateway.openai.fields``; each endpoint
(``gateway.openai.completions``, ``gateway.openai.chat``) parses its own
fields and builds its own objects (a ``Reply``, ``gateway.openai.replies``).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from stallfree.core.sched.deadline import Verdict
from stallfree.gateway.edge.auth import request_key, tenant_of
from stallfree.gateway.engine.client import EngineClient
from stallfree.gateway.engine.pieces import Piece, PieceMaker, ready_pieces
from stallfree.gateway.engine.streams import Notice, RequestStream
from stallfree.gateway.inputs.protocol import (
    HTTP_STATUS,
    GenerateRequest,
    ProtocolError,
    boolean,
    error_body,
    integer,
    parse_generate,
    parse_json_object,
    parse_off_loop,
)
from stallfree.gateway.openai.fields import NoOp, check_fields
from stallfree.gateway.openai.replies import Reply, finish_of


def error_response(code: str, message: str, retry_after_s: int = 0, param: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s else None
    return JSONResponse(error_body(code, message, param), status_code=HTTP_STATUS.get(code, 400), headers=headers)


async def read_json(request: Request, limit: int, timeout_s: float) -> dict[str, Any]:
    """The body as a JSON object: at most ``limit`` bytes, all of it within
    ``timeout_s`` (a client trickling its body cannot hold a slot forever)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:  # refused now, not after waiting for what it promised
        raise ProtocolError("invalid_request", f"request body larger than {limit} bytes")
    body = b""
    with anyio.move_on_after(timeout_s) as scope:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ProtocolError("invalid_request", f"request body larger than {limit} bytes")
    if scope.cancelled_caught:
        raise ProtocolError("timeout", f"request body not received within {timeout_s:g} s")
    return parse_json_object(body, "request body")


async def models(request: Request) -> Response:
    client: EngineClient = request.app.state.client
    model = {"id": client.settings.model_name, "object": "model", "created": 0, "owned_by": "stallfree"}
    return JSONResponse({"object": "list", "data": [model]})


def parse_openai(
    body: dict[str, Any],
    client: EngineClient,
    defaults: dict[str, Any],
    fields: dict[str, str | NoOp],
    endpoint: str,
) -> GenerateRequest:
    """The fields both endpoints share, checked; then the request."""
    check_fields(body, fields, endpoint)
    boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and (
        not isinstance(options, dict)
        or set(options) - {"include_usage"}
        or not isinstance(options.get("include_usage", False), (bool, type(None)))
    ):
        raise ProtocolError(
            "invalid_request", "stream_options must be {include_usage: true or false}", param="stream_options"
        )
    for name in ("model", "user"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise ProtocolError("invalid_request", f"{name} must be a string", param=name)
    return parse_generate(body, defaults, client.snapshot.config.max_model_len)


class ReplyMaker(Protocol):
    """An endpoint's ``reply``: the ``Reply`` that builds choice ``index``'s objects."""

    def __call__(
        self,
        request_id: str,
        model: str,
        prompt_tokens: int,
        gen: GenerateRequest,
        token_bytes: list[bytes],
        index: int,
    ) -> Reply: ...


MAX_CHOICES = 16


async def handle(
    request: Request,
    prefix: str,
    parse: Callable[[dict[str, Any], EngineClient], GenerateRequest],
    reply: ReplyMaker,
) -> Response:
    """One endpoint's request: read, parse (the endpoint's ``parse``), admit its
    choices (OpenAI's ``n``), then answer with one ``reply`` per choice: as one
    interleaved SSE stream (``_stream``) or in one response (``_whole``)."""
    client: EngineClient = request.app.state.client
    try:
        body = await read_json(request, client.settings.max_body_bytes, client.settings.body_timeout_s)
        gen = await parse_off_loop(parse, body, client)
        if gen.traceparent is None:
            gen.traceparent = request.headers.get("traceparent")
        s = client.settings
        gen.tenant = tenant_of(request_key(request.headers), s.api_keys, s.admin_keys) or ""
        request_id = client.new_id(prefix)
        n = integer(body, "n", 1, 1, MAX_CHOICES) or 1
        if n > 1 and gen.tools is not None:
            raise ProtocolError("invalid_request", "n: more than one choice with tools is not supported", param="n")
        streams, prompt_tokens = await client.submit_choices(gen, request_id, n)
    except ProtocolError as exc:
        client.report_error(exc.code)
        return error_response(exc.code, exc.message, exc.retry_after_s, exc.param)
    model = client.settings.model_name  # the served model's id, never the client's string (echoed per chunk)
    token_bytes = client.tokenizer.token_bytes
    ids = [s.request_id for s in streams]
    makers = [PieceMaker(token_bytes, gen.sampling.stop, functools.partial(client.cancel, rid)) for rid in ids]
    replies = [reply(request_id, model, prompt_tokens, gen, token_bytes, i) for i in range(n)]
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return _stream(client, streams, makers, replies, include_usage)
    return await _whole(request, client, streams, makers, replies)


def _stream(
    client: EngineClient,
    streams: list[RequestStream],
    makers: list[PieceMaker],
    replies: list[Reply],
    include_usage: bool,
) -> StreamingResponse:
    """Every choice in one interleaved SSE stream: the openings, each piece's
    chunks as it comes (``data: {...}``), the usage when asked, then
    ``data: [DONE]``. The one place a token is written to the socket for
    OpenAI streaming: starlette sends each event ``_events`` yields as it comes.
    However the stream ends (a client gone mid-stream included), every choice
    is cancelled and its KV freed."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **admission_headers(streams[0].verdict)}
    events = _events(client, streams, makers, replies, include_usage)
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _events(
    client: EngineClient,
    streams: list[RequestStream],
    makers: list[PieceMaker],
    replies: list[Reply],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """``_stream``'s body, event by event."""
    try:
        for reply in replies:
            for chunk in reply.opening():
                yield _event(chunk)
        told: str | None = None  # the engine's latest word, said once for all the choices
        async for i, item in _choice_pieces(streams, makers):
            if isinstance(item, Notice):
                if item.kind != told:  # a comment: SSE clients skip it, a person reading the stream sees it
                    yield f": engine {item.kind} ({item.silent_ms} ms without an answer)\n\n".encode()
                told = item.kind
                continue
            if isinstance(item, ProtocolError):
                client.report_error(item.code)
                yield _event(error_body(item.code, item.message))
                continue
            replies[i].count(item)
            for chunk in replies[i].stream(item):
                yield _event(chunk)
        if include_usage:
            yield _event({**replies[0].chunk(None, None), "choices": [], "usage": _usage(replies)})
        yield b"data: [DONE]\n\n"
    finally:
        _cancel_all(client, streams)  # finished choices are no-ops; a client gone mid-stream frees them all


async def _whole(
    request: Request,
    client: EngineClient,
    streams: list[RequestStream],
    makers: list[PieceMaker],
    replies: list[Reply],
) -> Response:
    """Every choice in one JSON reply, once all have ended. A client that goes
    away first cancels every choice and frees its KV (499)."""
    parts: list[list[str]] = [[] for _ in streams]
    choices: list[dict[str, Any] | None] = [None] * len(streams)
    failure: ProtocolError | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_disconnect, request, tg.cancel_scope)
            async for i, item in _choice_pieces(streams, makers):
                if isinstance(item, Notice):  # nothing to tell a client waiting for one reply
                    continue
                if isinstance(item, ProtocolError):
                    failure = item
                    break
                parts[i].append(item.text)
                replies[i].count(item)
                replies[i].piece_logprobs(item)
                if item.finish_reason:
                    choices[i] = replies[i].whole("".join(parts[i]), finish_of(item))["choices"][0]
            tg.cancel_scope.cancel()
    finally:
        _cancel_all(client, streams)
    if failure is not None:
        client.report_error(failure.code)
        return error_response(failure.code, failure.message)
    if any(c is None for c in choices):  # the client went away
        return Response(status_code=499)
    whole = replies[0].whole("", "stop")
    return JSONResponse(
        {**whole, "choices": choices, "usage": _usage(replies)}, headers=admission_headers(streams[0].verdict)
    )


async def _watch_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` when the client goes away (a non-streaming reply reads nothing else)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _choice_pieces(
    streams: list[RequestStream], makers: list[PieceMaker]
) -> AsyncIterator[tuple[int, Piece | Notice | ProtocolError]]:
    """The choices' pieces as they come, interleaved, until every choice has ended:
    one task drains all the streams, woken by any of them."""
    wake = [anyio.Event()]
    for s in streams:
        s.on_put = lambda: wake[0].set()
    ended = [False] * len(streams)
    while not all(ended):
        for i, (stream, maker) in enumerate(zip(streams, makers, strict=True)):
            if ended[i]:
                continue
            for item in ready_pieces(stream, maker):
                last = isinstance(item, Piece) and item.finish_reason is not None
                ended[i] = last or isinstance(item, ProtocolError)
                yield i, item
        if not all(ended):
            await wake[0].wait()
            wake[0] = anyio.Event()


def _usage(replies: list[Reply]) -> dict[str, Any]:
    """The usage of all the choices together: one prompt, every choice's completion."""
    completion = sum(r.completion_tokens for r in replies)
    return {
        **replies[0].usage(),
        "completion_tokens": completion,
        "total_tokens": replies[0].prompt_tokens + completion,
    }


def _cancel_all(client: EngineClient, streams: list[RequestStream]) -> None:
    """Abort every choice (finished ones are no-ops) and close its stream."""
    for s in streams:
        client.cancel(s.request_id)
        s.close()


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def admission_headers(verdict: Verdict | None) -> dict[str, str]:
    """What admission predicted under a TTFT target: the first token's time
    after arrival, and, when that misses the target, that it comes best-effort."""
    if verdict is None:
        return {}
    headers = {"x-stallfree-predicted-ttft-ms": f"{verdict.predicted_s * 1e3:.0f}"}
    if not verdict.on_time:
        headers["x-stallfree-best-effort"] = "1"
    return headers
