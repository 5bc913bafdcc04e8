"""OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions.

Streaming is SSE (``data: {...}`` chunks, then ``data: [DONE]``), with
``stream_options.include_usage``. A client that disconnects aborts its
request (and frees its KV) whether it streams or not. Which of OpenAI's
fields are honoured is ``gateway.openai_fields``; logprobs, ``n``,
structured output and tool calls are shaped here.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from core.sched.request import MAX_LOGPROBS
from gateway.auth import request_key, tenant_of
from gateway.engine_client import EngineClient
from gateway.generation import Piece, PieceMaker, ready_pieces
from gateway.openai_fields import check_fields
from gateway.openai_logprobs import LogprobsShape
from gateway.protocol import (
    HTTP_STATUS,
    GenerateRequest,
    ProtocolError,
    boolean,
    error_body,
    integer,
    parse_generate,
    parse_json_object,
)
from gateway.streams import RequestStream
from gateway.tools import CallStream, ToolCall, Tools, forced_call, may_start_call, parse_tools, read_calls
from gateway.tools import grammar as tool_grammar


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


def _parse(body: dict[str, Any], client: EngineClient, chat: bool) -> GenerateRequest:
    check_fields(body, chat)
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
    tools, tool_grammar = None, None
    if chat:
        tools, tool_grammar = _tools(body)
        body = {**body, "logprobs": _chat_logprobs(body)}
        body = {**body, "max_tokens": body.get("max_completion_tokens", body.get("max_tokens"))}
        defaults: dict[str, Any] = {"temperature": 1.0, "max_tokens": None}
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            body = {**body, "prompt": prompt[0]}
        defaults = {"temperature": 1.0, "max_tokens": 16}
    req = parse_generate(body, defaults, client.snapshot.config.max_model_len)
    req.tools = tools
    if tool_grammar is not None:
        if req.sampling.grammar is not None:
            raise ProtocolError(
                "invalid_request", "tool_choice: a forced call and a response_format", param="tool_choice"
            )
        req.sampling.grammar = tool_grammar
    return req


def _tools(body: dict[str, Any]) -> tuple[Tools | None, str | None]:
    """The offered tools and, for a required or named call, the grammar that forces it."""
    try:
        tools = parse_tools(body.get("tools"), body.get("tool_choice"))
        return tools, (tool_grammar(tools) if tools is not None else None)
    except ValueError as exc:
        field = str(exc).split(":", 1)[0]
        raise ProtocolError("invalid_request", str(exc), param=field) from None


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's ``logprobs: true`` and ``top_logprobs: k`` as the one alternatives count (None: not asked)."""
    asked = boolean(body, "logprobs")
    top = integer(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
    if top and not asked:
        raise ProtocolError("invalid_request", "top_logprobs needs logprobs: true", param="top_logprobs")
    return top if asked else None


async def completions(request: Request) -> Response:
    return await _handle(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _handle(request, chat=True)


async def _handle(request: Request, chat: bool) -> Response:
    client: EngineClient = request.app.state.client
    try:
        body = await read_json(request, client.settings.max_body_bytes, client.settings.body_timeout_s)
        req = _parse(body, client, chat)
        if req.traceparent is None:
            req.traceparent = request.headers.get("traceparent")
        req.tenant = tenant_of(request_key(request.headers), client.settings.api_keys) or ""
        request_id = client.new_id("chatcmpl" if chat else "cmpl")
        n = integer(body, "n", 1, 1, MAX_CHOICES) or 1
        if n > 1 and req.tools is not None:
            raise ProtocolError("invalid_request", "n: more than one choice with tools is not supported", param="n")
        streams, prompt_tokens = await client.submit_choices(req, request_id, n)
    except ProtocolError as exc:
        client.report_error(exc.code)
        return error_response(exc.code, exc.message, exc.retry_after_s, exc.param)
    model = body.get("model") or client.settings.model_name
    token_bytes = client.tokenizer.token_bytes
    ids = [s.request_id for s in streams]
    makers = [PieceMaker(token_bytes, req.sampling.stop, functools.partial(client.cancel, rid)) for rid in ids]

    def shape(i: int) -> _Shape:
        logprobs = LogprobsShape(token_bytes, chat) if req.sampling.logprobs is not None else None
        return _Shape(request_id, model, chat, prompt_tokens, logprobs, req.tools, index=i)

    return await _respond(request, client, body, streams, makers, [shape(i) for i in range(n)])


class _Shape:
    """Builds OpenAI response objects for one request."""

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        prompt_tokens: int,
        logprobs: LogprobsShape | None,
        tools: Tools | None = None,
        index: int = 0,
    ) -> None:
        self.id, self.model, self.chat, self.prompt_tokens = request_id, model, chat, prompt_tokens
        self.logprobs = logprobs
        self.tools = tools
        self.index = index  # the choice
        self.created = int(time.time())
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens served from the prefix cache, known at the end

    def count(self, piece: Piece) -> None:
        self.completion_tokens += len(piece.token_ids)
        if piece.request is not None:
            self.cached_tokens = piece.request.num_cached_tokens

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def piece_logprobs(self, piece: Piece) -> dict[str, Any] | None:
        return self.logprobs.piece(piece.token_ids, piece.logprobs) if self.logprobs is not None else None

    def chunk(
        self, text: str | None, finish: str | None, first: bool = False, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else {}
            if text and not first:
                delta["content"] = text
            choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": self.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

    def call_json(self, i: int, call: ToolCall) -> dict[str, Any]:
        return {
            "id": f"call_{self.id}_{i}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }

    def _call_deltas(self, i: int, name: str | None, arguments: str) -> list[dict[str, Any]]:
        """OpenAI's streamed pieces of call i: its id and name (once), then argument text."""
        parts: list[dict[str, Any]] = []
        if name is not None:
            head = self.call_json(i, ToolCall(name, ""))
            parts.append({**head, "index": i})
        if arguments:
            parts.append({"index": i, "function": {"arguments": arguments}})
        chunks = []
        for part in parts:
            chunk = self.chunk(None, None)
            chunk["choices"][0]["delta"] = {"tool_calls": [part]}
            chunks.append(chunk)
        return chunks

    def call_stream_chunks(self, call: CallStream, text: str, last: bool) -> list[dict[str, Any]]:
        """A forced call's pieces for this much more text: its id and name once, then its arguments."""
        name, arguments = call.feed(text)
        return self._call_deltas(0, name, arguments + (call.finish() if last else ""))

    def call_chunks(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """Calls read from a finished reply, each as OpenAI streams it."""
        return [chunk for i, call in enumerate(calls) for chunk in self._call_deltas(i, call.name, call.arguments)]

    def whole(self, text: str, finish: str) -> dict[str, Any]:
        logprobs = self.logprobs.whole if self.logprobs is not None else None
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.tools is not None:
                if self.tools.forced:  # the reply is the call; cut short (length), it is no call and no text
                    forced = forced_call(text)
                    text, calls = "", [forced] if forced is not None else []
                    message["content"] = None
                else:
                    text, calls = read_calls(text)
                if calls:
                    message = {"role": "assistant", "content": text or None}
                    message["tool_calls"] = [self.call_json(i, c) for i, c in enumerate(calls)]
                    finish = "tool_calls"
            choice = {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish}
            kind = "chat.completion"
        else:
            choice = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            kind = "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
        }


class _HeldText:
    """A chat reply's text held back while it may still be a tool call (all of
    it when a call is forced), so a call is never streamed as content."""

    def __init__(self, tools: Tools | None) -> None:
        self.tools = tools
        self.text = ""
        self.holding = tools is not None

    def feed(self, text: str) -> str:
        """What may be streamed now."""
        if not self.holding or self.tools is None:
            return text
        self.text += text
        if self.tools.forced or may_start_call(self.text):
            return ""
        self.holding = False
        text, self.text = self.text, ""
        return text

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self.text = self.text, ""
        return read_calls(text)


def _finish(piece: Piece) -> str:
    """``stop``, ``length``, or ``cancelled`` for a request cancelled by the
    server (drain on shutdown): never ``stop`` for text that did not end.
    OpenAI's Python and JS clients pass finish reasons through unvalidated."""
    return piece.finish_reason or "stop"


MAX_CHOICES = 16


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _choice_pieces(
    streams: list[RequestStream], makers: list[PieceMaker]
) -> AsyncIterator[tuple[int, Piece | ProtocolError]]:
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
                ended[i] = isinstance(item, ProtocolError) or item.finish_reason is not None
                yield i, item
        if not all(ended):
            await wake[0].wait()
            wake[0] = anyio.Event()


async def _respond(
    request: Request,
    client: EngineClient,
    body: dict[str, Any],
    streams: list[RequestStream],
    makers: list[PieceMaker],
    shapes: list[_Shape],
) -> Response:
    """Every choice of one prompt (OpenAI's ``n``), in one response or one
    interleaved SSE stream (``data: {...}`` chunks, then ``data: [DONE]``).
    A client that goes away cancels every choice and frees its KV."""

    def usage() -> dict[str, Any]:
        completion = sum(s.completion_tokens for s in shapes)
        return {
            **shapes[0].usage(),
            "completion_tokens": completion,
            "total_tokens": shapes[0].prompt_tokens + completion,
        }

    def cancel_all() -> None:
        for s in streams:
            client.cancel(s.request_id)
            s.close()

    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events() -> AsyncIterator[bytes]:
            held = [_HeldText(shape.tools) for shape in shapes]
            calls = [CallStream() if shape.tools is not None and shape.tools.forced else None for shape in shapes]
            try:
                if shapes[0].chat:
                    for shape in shapes:
                        yield _event(shape.chunk("", None, first=True))
                async for i, item in _choice_pieces(streams, makers):
                    if isinstance(item, ProtocolError):
                        client.report_error(item.code)
                        yield _event(error_body(item.code, item.message))
                        continue
                    shape = shapes[i]
                    shape.count(item)
                    finish = _finish(item) if item.finish_reason else None
                    logprobs = shape.piece_logprobs(item)
                    if (call := calls[i]) is not None:  # a forced call: streamed as it is generated
                        for chunk in shape.call_stream_chunks(call, item.text, finish is not None):
                            yield _event(chunk)
                        if finish == "stop" and call.name is not None:  # cut by max_tokens, it stays "length"
                            finish = "tool_calls"
                        if finish or logprobs:
                            yield _event(shape.chunk("", finish, logprobs=logprobs))
                        continue
                    text = held[i].feed(item.text)
                    if finish is not None and held[i].text:
                        text, found = held[i].finish()
                        if found:
                            if text:
                                yield _event(shape.chunk(text, None))
                            for chunk in shape.call_chunks(found):
                                yield _event(chunk)
                            text, finish = "", "tool_calls"
                    if text or finish or logprobs:
                        yield _event(shape.chunk(text, finish, logprobs=logprobs))
                if include_usage:
                    yield _event({**shapes[0].chunk(None, None), "choices": [], "usage": usage()})
                yield b"data: [DONE]\n\n"
            finally:
                cancel_all()  # finished choices are no-ops; a client gone mid-stream frees them all

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    parts: list[list[str]] = [[] for _ in streams]
    choices: list[dict[str, Any] | None] = [None] * len(streams)
    failure: ProtocolError | None = None

    async def watch_disconnect(scope: anyio.CancelScope) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_disconnect, tg.cancel_scope)
            async for i, item in _choice_pieces(streams, makers):
                if isinstance(item, ProtocolError):
                    failure = item
                    break
                parts[i].append(item.text)
                shapes[i].count(item)
                shapes[i].piece_logprobs(item)
                if item.finish_reason:
                    choices[i] = shapes[i].whole("".join(parts[i]), _finish(item))["choices"][0]
            tg.cancel_scope.cancel()
    finally:
        cancel_all()
    if failure is not None:
        client.report_error(failure.code)
        return error_response(failure.code, failure.message)
    if any(c is None for c in choices):  # the client went away
        return Response(status_code=499)
    whole = shapes[0].whole("", "stop")
    return JSONResponse({**whole, "choices": choices, "usage": usage()})
