"""``POST /v1/completions``: a prompt's text continued."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from stallfree.gateway.engine.client import EngineClient
from stallfree.gateway.engine.pieces import Piece
from stallfree.gateway.inputs.protocol import GenerateRequest
from stallfree.gateway.openai.api import handle, parse_openai
from stallfree.gateway.openai.fields import COMPLETIONS
from stallfree.gateway.openai.logprobs import CompletionLogprobs
from stallfree.gateway.openai.replies import Reply, finish_of

DEFAULTS: dict[str, Any] = {"temperature": 1.0, "max_tokens": 16}


class CompletionReply(Reply):
    chunk_object = whole_object = "text_completion"

    def chunk(self, text: str | None, finish: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        choice = {"index": self.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return self.envelope(self.chunk_object, choice)

    def stream(self, piece: Piece) -> list[dict[str, Any]]:
        finish = finish_of(piece) if piece.finish_reason else None
        logprobs = self.piece_logprobs(piece)
        return [self.chunk(piece.text, finish, logprobs)] if piece.text or finish or logprobs else []

    def whole(self, text: str, finish: str) -> dict[str, Any]:
        logprobs = self.logprobs.whole if self.logprobs is not None else None
        choice = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {**self.envelope(self.whole_object, choice), "usage": self.usage()}


def parse(body: dict[str, Any], client: EngineClient) -> GenerateRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        body = {**body, "prompt": prompt[0]}
    return parse_openai(body, client, DEFAULTS, COMPLETIONS, "completions")


def reply(
    request_id: str, model: str, prompt_tokens: int, gen: GenerateRequest, token_bytes: list[bytes], index: int
) -> Reply:
    logprobs = CompletionLogprobs(token_bytes) if gen.sampling.logprobs is not None else None
    return CompletionReply(request_id, model, prompt_tokens, logprobs, index)


async def completions(request: Request) -> Response:
    return await handle(request, "cmpl", parse, reply)
