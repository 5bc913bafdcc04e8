"""Token log-probabilities in OpenAI's two shapes.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
Completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``.
A streamed chunk carries its own tokens'; a whole response all of them.
"""

from __future__ import annotations

from typing import Any

from core.sched.batch import Logprobs


class LogprobsShape:
    def __init__(self, token_bytes: list[bytes], chat: bool) -> None:
        self.token_bytes = token_bytes
        self.chat = chat
        self.offset = 0  # characters of completion text so far (completions' text_offset)
        self.whole: dict[str, Any] = {"content": []} if chat else _empty_completion()

    def piece(self, token_ids: list[int], logprobs: list[Logprobs] | None) -> dict[str, Any] | None:
        """This piece's logprobs (None when the request did not ask); also kept for ``whole``."""
        if logprobs is None:
            return None
        if self.chat:
            content = [self._chat_entry(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)]
            self.whole["content"] += content
            return {"content": content}
        part = _empty_completion()
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

    def _text(self, token: int) -> str:
        return self.token_bytes[token].decode("utf-8", errors="replace")

    def _chat_entry(self, token: int, lp: Logprobs) -> dict[str, Any]:
        top = [{"token": self._text(t), "logprob": v, "bytes": list(self.token_bytes[t])} for t, v in lp.top]
        return {
            "token": self._text(token),
            "logprob": lp.logprob,
            "bytes": list(self.token_bytes[token]),
            "top_logprobs": top,
        }


def _empty_completion() -> dict[str, Any]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
