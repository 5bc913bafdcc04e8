"""Every field of OpenAI's chat and completions request schemas, and what we do with it.

A field is either implemented (validated where it is used), accepted only
with the value that asks for the default (clients and benchmark tools send
``best_of: 1``, ``n: null``, ``suffix: ""``), or refused. Nothing is
accepted and silently ignored: a value that would change the answer and
that we do not honour is a 400 naming the field. Unknown fields are refused
too, as OpenAI does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from stallfree.gateway.inputs.protocol import ProtocolError

IMPLEMENTED = "implemented"


@dataclass(frozen=True, slots=True)
class NoOp:
    """A field taken only with values that ask for nothing beyond the default."""

    accepts: Callable[[Any], bool]
    accepted: str  # for the error message

    def __call__(self, value: Any) -> bool:
        return self.accepts(value)


def _null_or(*defaults: Any) -> NoOp:
    def accepts(value: Any) -> bool:
        return value is None or any(value == d and type(value) is type(d) for d in defaults)

    return NoOp(accepts, " or ".join(["null", *(orjson.dumps(d).decode() for d in defaults)]))


_null = NoOp(lambda value: value is None, "null")
_string = NoOp(lambda value: value is None or isinstance(value, str), "a string")
_text_only = NoOp(lambda value: value is None or value == ["text"], '["text"]')
_no_tools = NoOp(lambda value: value is None or value == [], "null or []")


# name -> IMPLEMENTED, or the test for a value that only asks for the default
COMMON: dict[str, str | NoOp] = {
    "model": IMPLEMENTED,
    "max_tokens": IMPLEMENTED,
    "temperature": IMPLEMENTED,
    "top_p": IMPLEMENTED,
    "stop": IMPLEMENTED,
    "seed": IMPLEMENTED,
    "stream": IMPLEMENTED,
    "stream_options": IMPLEMENTED,
    "user": IMPLEMENTED,  # an end-user id: informational
    "n": IMPLEMENTED,
    "presence_penalty": IMPLEMENTED,
    "frequency_penalty": IMPLEMENTED,
    "logit_bias": IMPLEMENTED,
    # stallfree's (and vLLM's) extensions
    "top_k": IMPLEMENTED,
    "min_p": IMPLEMENTED,
    "repetition_penalty": IMPLEMENTED,
    "ignore_eos": IMPLEMENTED,
    "priority": IMPLEMENTED,
    "ttft_slo_ms": IMPLEMENTED,  # its own TTFT target in ms (0: none), instead of the server's
    "traceparent": IMPLEMENTED,
    "speculate": IMPLEMENTED,  # false: no draft tokens for this request when the server speculates
}

CHAT: dict[str, str | NoOp] = {
    **COMMON,
    "messages": IMPLEMENTED,
    "max_completion_tokens": IMPLEMENTED,
    "logprobs": IMPLEMENTED,
    "top_logprobs": IMPLEMENTED,
    "response_format": IMPLEMENTED,
    "tools": IMPLEMENTED,
    "tool_choice": IMPLEMENTED,
    "parallel_tool_calls": NoOp(lambda value: value is None or isinstance(value, bool), "true or false"),
    "functions": _no_tools,
    "function_call": _null_or("none"),
    "modalities": _text_only,
    "audio": _null,
    "prediction": _null,
    "reasoning_effort": _null,
    "verbosity": _null,
    "web_search_options": _null,
    "store": _null_or(False),
    "metadata": _null,
    "service_tier": _null_or("auto", "default"),
    "prompt_cache_key": _string,  # a routing hint; the prefix cache needs none
    "safety_identifier": _string,
}

COMPLETIONS: dict[str, str | NoOp] = {
    **COMMON,
    "prompt": IMPLEMENTED,
    "best_of": _null_or(1),
    "echo": _null_or(False),
    "logprobs": IMPLEMENTED,
    "suffix": _null_or(""),
    "response_format": IMPLEMENTED,  # an extension here, as in vLLM
}


def check_fields(body: dict[str, Any], fields: dict[str, str | NoOp], endpoint: str) -> None:
    """Refuse unknown fields and values we would not honour, naming the field (CHAT or COMPLETIONS)."""
    for name, value in body.items():
        rule = fields.get(name)
        if rule is None:
            raise ProtocolError("invalid_request", f"{name}: unknown field for {endpoint}", param=name)
        if isinstance(rule, NoOp) and not rule(value):
            why = f"{name}: {orjson.dumps(value).decode()[:80]} is not supported (accepted: {rule.accepted})"
            raise ProtocolError("invalid_request", why, param=name)
