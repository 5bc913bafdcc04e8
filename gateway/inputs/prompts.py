"""A request's prompt as token ids: a completion's text, or a chat rendered
through the model's template (tools listed where the template takes them)."""

from __future__ import annotations

from stallfree.core.model.tokenizer import Tokenizer
from stallfree.gateway.inputs.protocol import GenerateRequest, ProtocolError
from stallfree.gateway.inputs.tools import template_messages


def prompt_ids(tokenizer: Tokenizer, gen: GenerateRequest) -> list[int]:
    """CPU work: run it off the event loop (``Admission.tokenize``)."""
    if gen.messages is None:
        return tokenizer.encode(gen.prompt or "")
    tools = gen.tools
    listing = (
        [{"type": "function", "function": f} for f in tools.functions] if tools and tokenizer.takes_tools else None
    )
    try:
        text = tokenizer.render_chat(template_messages(gen.messages, tools, tokenizer.takes_tools), tools=listing)
    except Exception as exc:  # a template error is the caller's input problem
        raise ProtocolError("invalid_request", f"chat template failed: {exc}") from None
    return tokenizer.encode(text)
