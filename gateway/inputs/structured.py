"""``response_format`` (OpenAI's, also taken by the WebSocket ``generate``
frame) as an llguidance grammar the sampler enforces token by token.

    {"type": "text"}                                   no constraint
    {"type": "json_object"}                            any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}

A schema is always enforced (``strict`` or not). One llguidance cannot
enforce (``not``, ``uniqueItems``, ``if``/``then``, ...) or that is not JSON
Schema is a ValueError saying why (a 400 naming ``response_format``).
"""

from __future__ import annotations

from typing import Any

import llguidance

from stallfree.gateway.inputs.finite_schema import check_size, has_finite_instance

MAX_SCHEMA_CHARS = 64 * 1024


def grammar_of(response_format: Any) -> str | None:
    """The grammar for a response_format, or None for plain text. Raises ValueError."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("json_schema needs a schema object: {name, schema: {...}, strict}")
    else:
        raise ValueError("type must be text, json_object or json_schema")
    check_size(schema)
    try:
        # compact JSON: a small model left free to add whitespace may never stop
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except Exception as exc:  # the library's own words say what is wrong with the schema
        raise ValueError(f"not a usable JSON Schema: {exc}") from None
    if len(grammar) > MAX_SCHEMA_CHARS:
        raise ValueError(f"schema larger than {MAX_SCHEMA_CHARS} characters")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"not a usable JSON Schema: {error}")
    if not has_finite_instance(schema):
        raise ValueError("the schema has no finite instance (a $ref cycle or a property that requires itself)")
    return grammar
