"""``POST /v1/chat/completions``: a conversation's next message, with tool
calls (offered, or forced by a grammar) and chat-shaped logprobs."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from stallfree.core.sched.request import MAX_LOGPROBS
from stallfree.gateway.engine.client import EngineClient
from stallfree.gateway.engine.pieces import Piece
from stallfree.gateway.inputs.protocol import GenerateRequest, ProtocolError, boolean, integer
from stallfree.gateway.inputs.tools import CallStream, ToolCall, Tools, forced_call, parse_tools, read_calls
from stallfree.gateway.inputs.tools import grammar as tool_grammar
from stallfree.gateway.openai.api import handle, parse_openai
from stallfree.gateway.openai.fields import CHAT
from stallfree.gateway.openai.logprobs import ChatLogprobs, LogprobsFormat
from stallfree.gateway.openai.replies import Reply, finish_of
from stallfree.gateway.openai.tool_stream import HeldText

DEFAULTS: dict[str, Any] = {"temperature": 1.0, "max_tokens": None}


class ChatReply(Reply):
    chunk_object = "chat.completion.chunk"
    whole_object = "chat.completion"

    def __init__(
        self,
        request_id: str,
        model: str,
        prompt_tokens: int,
        logprobs: LogprobsFormat | None,
        index: int,
        tools: Tools | None,
    ) -> None:
        super().__init__(request_id, model, prompt_tokens, logprobs, index)
        self.tools = tools
        self.held = HeldText(tools)
        self.call = CallStream() if tools is not None and tools.forced else None  # a forced call, as it comes

    def opening(self) -> list[dict[str, Any]]:
        choice = {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        return [self.envelope(self.chunk_object, {**choice, "finish_reason": None})]

    def chunk(self, text: str | None, finish: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": text} if text else {}
        choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self.envelope(self.chunk_object, choice)

    def stream(self, piece: Piece) -> list[dict[str, Any]]:
        finish = finish_of(piece) if piece.finish_reason else None
        logprobs = self.piece_logprobs(piece)
        out: list[dict[str, Any]] = []
        if self.call is not None:  # a forced call: streamed as it is generated
            name, arguments = self.call.feed(piece.text)
            out += self._call_deltas(0, name, arguments + (self.call.finish() if finish is not None else ""))
            if finish == "stop" and self.call.name is not None:  # cut by max_tokens, it stays "length"
                finish = "tool_calls"
            if finish or logprobs:
                out.append(self.chunk("", finish, logprobs))
            return out
        text = self.held.feed(piece.text)
        if finish is not None and self.held.text:
            text, found = self.held.finish()
            if found:
                if text:
                    out.append(self.chunk(text, None))
                out += [
                    chunk for i, call in enumerate(found) for chunk in self._call_deltas(i, call.name, call.arguments)
                ]
                text, finish = "", "tool_calls"
        if text or finish or logprobs:
            out.append(self.chunk(text, finish, logprobs))
        return out

    def whole(self, text: str, finish: str) -> dict[str, Any]:
        logprobs = self.logprobs.whole if self.logprobs is not None else None
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
                message["tool_calls"] = [self._call_json(i, c) for i, c in enumerate(calls)]
                finish = "tool_calls"
        choice = {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish}
        return {**self.envelope(self.whole_object, choice), "usage": self.usage()}

    def _call_json(self, i: int, call: ToolCall) -> dict[str, Any]:
        return {
            "id": f"call_{self.id}_{i}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }

    def _call_deltas(self, i: int, name: str | None, arguments: str) -> list[dict[str, Any]]:
        """OpenAI's streamed pieces of call i: its id and name (once), then argument text."""
        parts: list[dict[str, Any]] = []
        if name is not None:
            parts.append({**self._call_json(i, ToolCall(name, "")), "index": i})
        if arguments:
            parts.append({"index": i, "function": {"arguments": arguments}})
        chunks = []
        for part in parts:
            chunk = self.chunk(None, None)
            chunk["choices"][0]["delta"] = {"tool_calls": [part]}
            chunks.append(chunk)
        return chunks


def parse(body: dict[str, Any], client: EngineClient) -> GenerateRequest:
    tools, forcing = _tools(body)
    body = {**body, "logprobs": _logprobs(body)}
    body = {**body, "max_tokens": body.get("max_completion_tokens", body.get("max_tokens"))}
    gen = parse_openai(body, client, DEFAULTS, CHAT, "chat completions")
    gen.tools = tools
    if forcing is not None:
        if gen.sampling.grammar is not None:
            raise ProtocolError(
                "invalid_request", "tool_choice: a forced call and a response_format", param="tool_choice"
            )
        gen.sampling.grammar = forcing
    return gen


def _tools(body: dict[str, Any]) -> tuple[Tools | None, str | None]:
    """The offered tools and, for a required or named call, the grammar that forces it."""
    try:
        tools = parse_tools(body.get("tools"), body.get("tool_choice"))
        return tools, (tool_grammar(tools) if tools is not None else None)
    except ValueError as exc:
        field = str(exc).split(":", 1)[0]
        raise ProtocolError("invalid_request", str(exc), param=field) from None


def _logprobs(body: dict[str, Any]) -> int | None:
    """Chat's ``logprobs: true`` and ``top_logprobs: k`` as the one alternatives count (None: not asked)."""
    asked = boolean(body, "logprobs")
    top = integer(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
    if top and not asked:
        raise ProtocolError("invalid_request", "top_logprobs needs logprobs: true", param="top_logprobs")
    return top if asked else None


def reply(
    request_id: str, model: str, prompt_tokens: int, gen: GenerateRequest, token_bytes: list[bytes], index: int
) -> Reply:
    logprobs = ChatLogprobs(token_bytes) if gen.sampling.logprobs is not None else None
    return ChatReply(request_id, model, prompt_tokens, logprobs, index, gen.tools)


async def chat_completions(request: Request) -> Response:
    return await handle(request, "chatcmpl", parse, reply)
