"""Token log-probabilities in OpenAI's two formats.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
Completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``.
A streamed chunk carries its own tokens'; a whole response all of them.
"""

from __future__ import annotations

from typing import Any

from stallfree.core.sched.batch import Logprobs


class LogprobsFormat:
    """One endpoint's logprobs for one choice: each piece's, and all of them (``whole``)."""

    def __init__(self, token_bytes: list[bytes]) -> None:
        self.token_bytes = token_bytes
        self.whole: dict[str, Any] = {}

    def piece(self, token_ids: list[int], logprobs: list[Logprobs] | None) -> dict[str, Any] | None:
        """This piece's logprobs (None when the request did not ask); also kept for ``whole``."""
        raise NotImplementedError

    def _text(self, token: int) -> str:
        return self.token_bytes[token].decode("utf-8", errors="replace")


class ChatLogprobs(LogprobsFormat):
    def __init__(self, token_bytes: list[bytes]) -> None:
        super().__init__(token_bytes)
        self.whole = {"content": []}

    def piece(self, token_ids: list[int], logprobs: list[Logprobs] | None) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        content = [self._entry(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)]
        self.whole["content"] += content
        return {"content": content}

    def _entry(self, token: int, lp: Logprobs) -> dict[str, Any]:
        top = [{"token": self._text(t), "logprob": v, "bytes": list(self.token_bytes[t])} for t, v in lp.top]
        return {
            "token": self._text(token),
            "logprob": lp.logprob,
            "bytes": list(self.token_bytes[token]),
            "top_logprobs": top,
        }


class CompletionLogprobs(LogprobsFormat):
    def __init__(self, token_bytes: list[bytes]) -> None:
        super().__init__(token_bytes)
        self.offset = 0  # characters of completion text so far (text_offset)
        self.whole = _empty()

    def piece(self, token_ids: list[int], logprobs: list[Logprobs] | None) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        part = _empty()
        for token, lp in zip(token_ids, logprobs, strict=True):
            text = self._text(token)
            part["tokens"].append(text)
            part["token_logprobs"].append(lp.logprob)
            part["top_logprobs"].append({self._text(t): v for t, v in lp.top})
            part["text_offset"].append(self.offset)
            self.offset += len(text)
        for key, values in part.items():
            self.whole[key] += values
        return part


def _empty() -> dict[str, Any]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
