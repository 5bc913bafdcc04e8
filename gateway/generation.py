"""One request's tokens as text pieces: detokenized, stop strings applied.

Shared by the WebSocket protocol and the OpenAI API, so both end a
generation the same way: a stop string cancels the engine request at once
(freeing its KV) and is reported as finish reason ``stop``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from core.detokenizer import Detokenizer
from core.request import Request
from gateway.engine_client import EngineClient
from gateway.protocol import ProtocolError
from gateway.streams import SLOW_CONSUMER, RequestStream

FINISH = {"stop": "stop", "length": "length", "abort": "cancelled"}


@dataclass(slots=True)
class Piece:
    index: int  # completion index of token_ids[0]
    text: str
    token_ids: list[int]
    emit_ns: int
    finish_reason: str | None = None  # stop | length | cancelled, on the last piece
    request: Request | None = None  # on the last piece


async def text_pieces(
    client: EngineClient, request_id: str, stream: RequestStream, stop: tuple[str, ...]
) -> AsyncIterator[Piece]:
    """Yield pieces until the request ends; raises ProtocolError for slow_consumer or an engine error."""
    detok = Detokenizer(client.tokenizer.token_bytes, stop)
    stopped = False
    while True:
        delta = await stream.get()
        if delta.finish_reason == SLOW_CONSUMER:
            raise ProtocolError(SLOW_CONSUMER, "client read too slowly; generation cancelled")
        if delta.finish_reason == "error":
            raise ProtocolError("internal", "the engine failed while running this request")
        ids = [] if stopped else delta.token_ids
        text = detok.push(ids) if ids else ""
        if detok.stopped and not stopped:
            stopped = True
            # the stop string's tokens were produced; what follows it is not sent
            client.cancel(request_id)
        if delta.finish_reason is not None:
            text += detok.flush()
            reason = "stop" if stopped else FINISH[delta.finish_reason]
            yield Piece(delta.first_index, text, ids, delta.emit_ns, reason, delta.request)
            return
        if ids or text:
            yield Piece(delta.first_index, text, ids, delta.emit_ns)
