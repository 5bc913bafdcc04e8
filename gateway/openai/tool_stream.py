"""A chat reply's tool calls as they stream: text that may still become a
call is held back, so a call is never streamed as content."""

from __future__ import annotations

from stallfree.gateway.inputs.tools import ToolCall, Tools, may_start_call, read_calls


class HeldText:
    """The reply's text held while it may still be a tool call (all of it when a call is forced)."""

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
