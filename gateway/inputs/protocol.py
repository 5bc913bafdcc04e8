"""Validation of client input into one transport-neutral request.

Both the WebSocket protocol and the OpenAI-compatible API parse into
``GenerateRequest``; every rejection is a ``ProtocolError`` carrying one of
the documented error codes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import orjson

from stallfree.core.sched.config import RANGES
from stallfree.core.sched.request import MAX_LOGPROBS, SamplingParams
from stallfree.gateway.inputs.structured import grammar_of
from stallfree.gateway.inputs.tools import Tools

T = TypeVar("T")
C = TypeVar("C")

ERROR_CODES = (
    "invalid_request",
    "prompt_too_long",
    "overloaded",
    "unauthorized",
    "forbidden",
    "slow_consumer",
    "timeout",
    "internal",
    "unavailable",
)
ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 1024  # entries
MAX_ID_CHARS = 128
MAX_MESSAGES = 1024  # per chat request: rendering 33,000 empty messages cost seconds of CPU
MAX_JSON_DEPTH = 64  # nesting of a body or frame; deeper is refused before any field is read


class ProtocolError(Exception):
    def __init__(
        self,
        code: str,
        message: str,
        request_id: str | None = None,
        retry_after_s: int = 0,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.retry_after_s = retry_after_s  # > 0: when the client may try again (HTTP Retry-After)
        self.param = param  # the request field at fault, when there is one (OpenAI's error.param)


@dataclass(slots=True)
class GenerateRequest:
    """One generation as a client asked for it, whichever transport it came by
    (OpenAI's HTTP API or the WebSocket): what the gateway admits and hands to
    ``EngineClient.submit``. The gateway names it ``gen`` everywhere; ``req`` is
    the engine's ``core.sched.request.Request`` built from it, and a ``request``
    variable is only ever an HTTP handler's starlette ``Request`` (fields such
    as ``Piece.request`` keep their names)."""

    messages: list[dict[str, Any]] | None  # chat: rendered with the model's template
    prompt: str | None  # raw text
    sampling: SamplingParams
    max_tokens_given: bool  # False: fill the rest of the context
    priority: int = 0
    traceparent: str | None = None
    tenant: str = ""  # the API key's id (gateway.edge.auth.tenant_of); "" without keys
    tools: Tools | None = None  # chat: functions the model may (or must) call
    ttft_slo_ms: float | None = None  # its own TTFT target (0: none); None: the server's


def integer(body: dict[str, Any], name: str, default: int | None, low: int, high: int) -> int | None:
    """An integer field; absent or null means the default."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProtocolError("invalid_request", f"{name} must be an integer in [{low}, {high}]", param=name)
    return value


def _float(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    """A number field; absent or null means the default."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProtocolError("invalid_request", f"{name} must be a finite number", param=name)
    if not low <= value <= high:
        raise ProtocolError("invalid_request", f"{name} must be in [{low}, {high}]", param=name)
    return float(value)


def boolean(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """A true/false field; absent or null means the default (no "yes", no 1)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ProtocolError("invalid_request", f"{name} must be true or false", param=name)
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > MAX_STOP_STRINGS or not all(isinstance(s, str) for s in value):
        raise ProtocolError(
            "invalid_request", f"stop must be a string or a list of at most {MAX_STOP_STRINGS}", param="stop"
        )
    if any(len(s) > 256 for s in value):
        raise ProtocolError("invalid_request", "stop strings are limited to 256 characters", param="stop")
    return tuple(s for s in value if s)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}; ids are checked against the vocabulary by the engine."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise ProtocolError(
            "invalid_request", f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases", param="logit_bias"
        )
    pairs = []
    for key, bias in value.items():
        # canonical decimal only: int() also reads "١٢", "1_2", " 12" and "012",
        # so two keys could name one token and their biases add past ±100
        if not (key == "0" or (key[:1] in "123456789" and key.isascii() and key.isdigit() and len(key) <= 9)):
            shown = key if len(key) <= 20 else key[:20] + "..."
            raise ProtocolError(
                "invalid_request", f"logit_bias key {shown!r} is not a token id in decimal", param="logit_bias"
            )
        token = int(key)
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise ProtocolError(
                "invalid_request", "logit_bias values must be numbers in [-100, 100]", param="logit_bias"
            )
        pairs.append((token, float(bias)))
    return tuple(pairs)


def messages_field(value: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages, text only, as role/content dicts."""
    if not isinstance(value, list) or not value:
        raise ProtocolError("invalid_request", "messages must be a non-empty list", param="messages")
    if len(value) > MAX_MESSAGES:  # before the chat template renders them all
        raise ProtocolError("invalid_request", f"at most {MAX_MESSAGES} messages", param="messages")
    out = []
    for m in value:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ProtocolError("invalid_request", f"each message needs a role in {', '.join(ROLES)}", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: text only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise ProtocolError("invalid_request", "only text content parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if calls is not None and (not isinstance(calls, list) or not all(_is_call(c) for c in calls)):
            why = 'tool_calls: [{"id", "type": "function", "function": {"name", "arguments"}}]'
            raise ProtocolError("invalid_request", why, param="messages")
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise ProtocolError("invalid_request", "message content must be a string", param="messages")
        message: dict[str, Any] = {"role": m["role"], "content": content}
        if calls:
            message["tool_calls"] = calls
        if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _is_call(call: Any) -> bool:
    fn = call.get("function") if isinstance(call, dict) else None
    return isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)


def parse_generate(body: dict[str, Any], defaults: dict[str, Any], max_model_len: int) -> GenerateRequest:
    """Validate the fields both protocols share.

    defaults: ``max_tokens`` (None: the rest of the context) and ``temperature``.
    Exactly one of ``messages`` and ``prompt`` must be given.
    """
    has_messages, has_prompt = body.get("messages") is not None, body.get("prompt") is not None
    if has_messages == has_prompt:
        raise ProtocolError("invalid_request", "give exactly one of messages or prompt")
    messages = messages_field(body["messages"]) if has_messages else None
    prompt = body.get("prompt")
    if has_prompt and not isinstance(prompt, str):
        raise ProtocolError("invalid_request", "prompt must be a string", param="prompt")
    max_tokens = integer(body, "max_tokens", defaults.get("max_tokens"), 1, max_model_len)
    seed = integer(body, "seed", None, -(2**63), 2**63 - 1)
    ignore_eos = boolean(body, "ignore_eos")
    traceparent = body.get("traceparent")
    if traceparent is not None and not isinstance(traceparent, str):
        raise ProtocolError("invalid_request", "traceparent must be a string", param="traceparent")
    sampling = SamplingParams(
        max_tokens=max_tokens or 1,
        temperature=_float(body, "temperature", defaults.get("temperature", 1.0), 0.0, 100.0),
        top_p=_float(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=integer(body, "top_k", 0, 0, 1 << 20) or 0,
        seed=seed,
        stop=_stop(body.get("stop")),
        ignore_eos=ignore_eos,
        presence_penalty=_float(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_float(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_float(body, "repetition_penalty", 1.0, 0.01, 10.0),
        logit_bias=_logit_bias(body.get("logit_bias")),
        min_p=_float(body, "min_p", 0.0, 0.0, 1.0),
        logprobs=integer(body, "logprobs", None, 0, MAX_LOGPROBS),
        grammar=_grammar(body.get("response_format")),
        speculate=boolean(body, "speculate", True),
    )
    priority = integer(body, "priority", 0, -(2**31), 2**31 - 1) or 0
    gen = GenerateRequest(messages, prompt, sampling, max_tokens is not None, priority, traceparent)
    if body.get("ttft_slo_ms") is not None:  # the server's limits on the setting bound the field
        _, low, high = RANGES["ttft_slo_ms"]
        gen.ttft_slo_ms = _float(body, "ttft_slo_ms", 0.0, low, high)
    return gen


def _grammar(response_format: Any) -> str | None:
    try:
        return grammar_of(response_format)
    except ValueError as exc:
        raise ProtocolError("invalid_request", f"response_format: {exc}", param="response_format") from None


def error_body(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    kind = {
        "unauthorized": "authentication_error",
        "forbidden": "permission_error",
        "overloaded": "rate_limit_error",
        "internal": "server_error",
        "unavailable": "server_error",
    }
    kind_of = kind.get(code, "invalid_request_error")
    return {"error": {"message": message, "type": kind_of, "param": param, "code": code}}


HTTP_STATUS = {
    "invalid_request": 400,
    "prompt_too_long": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "overloaded": 429,
    "slow_consumer": 408,
    "timeout": 408,
    "internal": 500,
    "unavailable": 503,
}


def parse_json_object(raw: bytes | str, what: str) -> dict[str, Any]:
    """A request body or frame as a JSON object no deeper than MAX_JSON_DEPTH:
    one check at the edge, so no field's handler (nor a frame echoing it)
    meets a value nested hundreds of levels deep."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ProtocolError("invalid_request", f"{what} is not valid JSON") from None
    if not isinstance(data, dict):
        raise ProtocolError("invalid_request", f"{what} must be a JSON object")
    if _deeper_than(data, MAX_JSON_DEPTH):
        raise ProtocolError("invalid_request", f"{what} is nested deeper than {MAX_JSON_DEPTH} levels")
    return data


def _deeper_than(value: dict[str, Any] | list[Any], limit: int) -> bool:
    level: list[Any] = [value]
    for _ in range(limit):
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, dict | list)]
        if not level:
            return False
    return True


async def parse_off_loop(parse: Callable[[dict[str, Any], C], T], body: dict[str, Any], client: C) -> T:
    """parse(body, client); in a worker thread when the body carries a schema
    (``tools``, ``response_format``): checking and compiling one takes tens of
    milliseconds at the size cap, which the event loop every stream shares
    should not spend."""
    if body.get("tools") or isinstance(body.get("response_format"), dict):
        return await anyio.to_thread.run_sync(parse, body, client)
    return parse(body, client)
