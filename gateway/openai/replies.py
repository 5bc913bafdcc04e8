"""What both OpenAI endpoints build for one choice: its usage, logprobs and
the envelope of its objects. Each endpoint's subclass says how a streamed
piece and a whole reply look (``gateway.openai.completions``,
``gateway.openai.chat``)."""

from __future__ import annotations

import time
from typing import Any

from stallfree.gateway.engine.pieces import Piece
from stallfree.gateway.openai.logprobs import LogprobsFormat


def finish_of(piece: Piece) -> str:
    """``stop``, ``length``, or ``cancelled`` for a request cancelled by the
    server (drain on shutdown): never ``stop`` for text that did not end.
    OpenAI's Python and JS clients pass finish reasons through unvalidated."""
    return piece.finish_reason or "stop"


class Reply:
    """One choice's OpenAI reply as it is built: streamed chunks (``opening``,
    ``stream``, ``chunk``) or the whole object (``whole``), with its usage."""

    chunk_object = ""  # the streamed objects' "object"
    whole_object = ""  # the whole reply's

    def __init__(self, request_id: str, model: str, prompt_tokens: int, logprobs: LogprobsFormat | None, index: int):
        self.id, self.model, self.prompt_tokens = request_id, model, prompt_tokens
        self.logprobs = logprobs
        self.index = index  # the choice
        self.created = int(time.time())
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens served from the prefix cache, known at the end
        self.draft_tokens = self.accepted_tokens = 0  # speculative decoding's, known at the end

    def count(self, piece: Piece) -> None:
        self.completion_tokens += len(piece.token_ids)
        if piece.end is not None:
            self.cached_tokens = piece.end.num_cached_tokens
            self.draft_tokens = piece.end.num_draft_tokens
            self.accepted_tokens = piece.end.num_accepted_tokens

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage; draft tokens as its predicted outputs' (vLLM reports them
        only in metrics): kept ones accepted, the others rejected."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {
                "accepted_prediction_tokens": self.accepted_tokens,
                "rejected_prediction_tokens": self.draft_tokens - self.accepted_tokens,
            },
        }

    def piece_logprobs(self, piece: Piece) -> dict[str, Any] | None:
        return self.logprobs.piece(piece.token_ids, piece.logprobs) if self.logprobs is not None else None

    def envelope(self, kind: str, choice: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

    def opening(self) -> list[dict[str, Any]]:
        """Chunks streamed before any token."""
        return []

    def chunk(self, text: str | None, finish: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """One streamed object."""
        raise NotImplementedError

    def stream(self, piece: Piece) -> list[dict[str, Any]]:
        """The streamed objects for this piece (already counted)."""
        raise NotImplementedError

    def whole(self, text: str, finish: str) -> dict[str, Any]:
        """The reply in one object, with usage."""
        raise NotImplementedError
