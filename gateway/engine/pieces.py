"""One request's deltas as text pieces: detokenized, stop strings applied.

Shared by the WebSocket protocol and the OpenAI API, so both end a
generation the same way: a stop string cancels the engine request at once
(freeing its KV) and is reported as finish reason ``stop``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from stallfree.core.model.detokenizer import Detokenizer
from stallfree.core.sched.batch import Logprobs
from stallfree.core.sched.request import FinishReason, RequestEnd
from stallfree.gateway.engine.streams import Delta, Notice, RequestStream
from stallfree.gateway.inputs.protocol import ProtocolError

# The one mapping from the engine's finish reasons to what clients of both
# APIs see: a normal end with its wire string, or an error frame/response.
WIRE_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "cancelled"}
WIRE_ERROR = {
    FinishReason.SLOW_CONSUMER: ("slow_consumer", "client read too slowly; generation cancelled"),
    FinishReason.ERROR: ("internal", "the engine failed while running this request"),
}


@dataclass(slots=True)
class Piece:
    index: int  # completion index of token_ids[0]
    text: str
    token_ids: list[int]
    emit_ns: int
    finish_reason: str | None = None  # stop | length | cancelled, on the last piece
    end: RequestEnd | None = None  # on the last piece
    logprobs: list[Logprobs] | None = None  # one per token of token_ids, when the request asked


class PieceMaker:
    """Turns deltas into pieces, synchronously (no awaits on the hot path)."""

    def __init__(self, token_bytes: list[bytes], stop: tuple[str, ...], cancel: Callable[[], None]) -> None:
        self._detok = Detokenizer(token_bytes, stop)
        self._cancel = cancel
        self._stopped = False

    def feed(self, delta: Delta) -> Piece | None:
        """The piece for this delta (None if nothing to show). Raises ProtocolError
        for a slow consumer or an engine error."""
        if delta.finish_reason in WIRE_ERROR:
            raise ProtocolError(*WIRE_ERROR[delta.finish_reason])
        ids = [] if self._stopped else delta.token_ids
        logprobs = delta.logprobs[: len(ids)] if delta.logprobs is not None else None
        text = self._detok.push(ids) if ids else ""
        if self._detok.stopped and not self._stopped:
            self._stopped = True  # what follows the stop string is not sent
            self._cancel()
        if delta.finish_reason is not None:
            text += self._detok.flush()
            reason = WIRE_FINISH[FinishReason.STOP if self._stopped else delta.finish_reason]
            return Piece(delta.first_index, text, ids, delta.emit_ns, reason, delta.end, logprobs)
        if ids or text:
            return Piece(delta.first_index, text, ids, delta.emit_ns, logprobs=logprobs)
        return None


def ready_pieces(stream: RequestStream, maker: PieceMaker) -> Iterator[Piece | Notice | ProtocolError]:
    """What the stream holds now, for either protocol's writer: word of the
    engine first (a ``Notice``), then its tokens as pieces. The last one
    yielded is the final piece (a finish reason) or the ProtocolError that
    ended the generation (a slow consumer, an engine error)."""
    notice = stream.take_notice()
    if notice is not None:
        yield notice
    while (delta := stream.get_nowait()) is not None:
        try:
            piece = maker.feed(delta)
        except ProtocolError as exc:
            yield exc
            return
        if piece is not None:
            yield piece
            if piece.finish_reason is not None:
                return
