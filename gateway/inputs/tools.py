"""Tool calling for chat completions: ``tools`` and ``tool_choice``.

The model is told about the tools by its own chat template when the
template takes ``tools`` (Qwen2, Llama 3); otherwise (SmolLM2's plain
ChatML) by a system section in the Hermes format those models were tuned
on. Either way a call is written as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice``: ``none`` (tools not offered), ``auto`` (the model decides;
calls are read from its text), ``required`` or a named function (the output
is constrained by an llguidance grammar to a call whose arguments follow the
function's JSON Schema, so even a small model returns valid arguments).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import llguidance

from stallfree.gateway.inputs.finite_schema import SchemaTooLarge, has_finite_instance

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3 may open a call with it
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)
MAX_TOOLS = 128


@dataclass(slots=True)
class Tools:
    functions: list[dict[str, Any]]  # OpenAI's {"name", "description", "parameters"}
    choice: str  # auto | required | the name of the function that must be called

    @property
    def forced(self) -> bool:
        return self.choice != "auto"


def parse_tools(tools: Any, tool_choice: Any) -> Tools | None:
    """The request's tools, or None when none are offered. Raises ValueError naming the field."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: a list of at most {MAX_TOOLS} functions")
    functions = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError('tools: each is {"type": "function", "function": {"name", "description", "parameters"}}')
        parameters = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            # OpenAI's arguments are an object: a schema of anything else made them a bare string or number
            raise ValueError(f'tools: parameters of {fn["name"]} must be a JSON Schema of type "object"')
        try:
            finite = has_finite_instance(parameters)
        except SchemaTooLarge as exc:
            raise ValueError(f"tools: parameters of {fn['name']}: {exc}") from None
        if not finite:
            raise ValueError(f"tools: parameters of {fn['name']} have no finite instance (a $ref cycle?)")
        functions.append(
            {"name": fn["name"], "description": str(fn.get("description") or ""), "parameters": parameters}
        )
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    if tool_choice in (None, "auto"):
        return Tools(functions, "auto")
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return Tools(functions, "required")
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or name not in names:
        raise ValueError('tool_choice: none, auto, required or {"type": "function", "function": {"name": <a tool>}}')
    return Tools(functions, name)


def grammar(tools: Tools) -> str | None:
    """For required or named calls: exactly one call of an allowed function with valid arguments."""
    if not tools.forced:
        return None
    allowed = [f for f in tools.functions if tools.choice in ("required", f["name"])]
    shapes = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in allowed
    ]
    schema: dict[str, Any] = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
    schema["x-guidance"] = {"whitespace_flexible": False}  # compact: a small model may pad forever
    lark = f'start: "{CALL_OPEN}\\n" call "\\n{CALL_CLOSE}"\ncall: %json {json.dumps(schema)}\n'
    text = llguidance.LLMatcher.grammar_from_lark(lark)
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise ValueError(f"tools: a parameters schema cannot be enforced: {error}")
    return text


def system_section(tools: Tools) -> str:
    """The Hermes-format tool list, for chat templates that do not take ``tools``."""
    listing = "\n".join(json.dumps({"type": "function", "function": f}) for f in tools.functions)
    shape = '{"name": <function-name>, "arguments": <args-json-object>}'
    return (
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f"{CALL_OPEN}{CALL_CLOSE} XML tags:\n{CALL_OPEN}\n{shape}\n{CALL_CLOSE}"
    )


def template_messages(
    messages: list[dict[str, Any]], tools: Tools | None, template_takes_tools: bool
) -> list[dict[str, Any]]:
    """Messages as a template without tool support can render them: earlier calls
    as ``<tool_call>`` text, tool results as ``<tool_response>`` user turns, the
    tool list in the system message."""
    if template_takes_tools:
        return messages
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "".join(f"{CALL_OPEN}\n{json.dumps(_call_json(c))}\n{CALL_CLOSE}" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m.get("content") or "") + calls})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools is not None:
        section = system_section(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _call_json(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function", {})
    arguments = fn.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        parsed = arguments
    return {"name": fn.get("name"), "arguments": parsed}


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def read_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split a reply into its text and the calls it makes: ``<tool_call>`` blocks
    (Hermes, Qwen2), or a reply that is one JSON call (Llama 3, after an optional
    ``<|python_tag|>``). A block that is not a call stays text."""
    calls = [c for m in _CALL.finditer(text) if (c := _call(m.group(1))) is not None]
    if calls:
        return _CALL.sub("", text).strip(), calls
    whole = _call(text.strip().removeprefix(PYTHON_TAG))
    return ("", [whole]) if whole is not None else (text, [])


def _call(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if "arguments" not in obj and "parameters" not in obj:
        return None
    arguments = obj.get("arguments", obj.get("parameters"))
    return ToolCall(obj["name"], json.dumps(arguments, separators=(",", ":"), ensure_ascii=False))


def may_start_call(text: str) -> bool:
    """Could a reply that begins with this text still turn out to be a tool call?"""
    head = text.lstrip()
    return any(marker.startswith(head) or head.startswith(marker) for marker in (CALL_OPEN, PYTHON_TAG, "{"))


# A forced call's exact text (its grammar leaves no freedom in the layout)
_FORCED_HEAD = re.compile(r"\s*" + re.escape(CALL_OPEN) + r'\n\{"name":("(?:[^"\\]|\\.)*"),"arguments":')
_FORCED_TAIL = "}\n" + CALL_CLOSE


class CallStream:
    """A forced call's text as it grows, in OpenAI's streaming pieces: the
    function name as soon as it is complete, then the arguments' JSON text as
    it comes (the closing ``}`` and tag held back until the end)."""

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self._sent = 0  # end of the argument text sent so far

    def feed(self, text: str) -> tuple[str | None, str]:
        """(the name, the first time it is known; argument text to send now)."""
        self.text += text
        new_name = None
        if self.name is None:
            head = _FORCED_HEAD.match(self.text)
            if head is None:
                return None, ""
            self.name = new_name = json.loads(head.group(1))
            self._sent = head.end()
        upto = max(self._sent, len(self.text) - len(_FORCED_TAIL))
        out, self._sent = self.text[self._sent : upto], upto
        return new_name, out

    def finish(self) -> str:
        """The rest of the arguments, once the reply has ended."""
        end = len(self.text) - len(_FORCED_TAIL) if self.text.endswith(_FORCED_TAIL) else len(self.text)
        out = self.text[self._sent : max(self._sent, end)] if self.name is not None else ""
        self._sent = max(self._sent, end)
        return out


def forced_call(text: str) -> ToolCall | None:
    """The call of a complete forced reply (the arguments' text as generated), else None."""
    head = _FORCED_HEAD.match(text)
    if head is None or not text.endswith(_FORCED_TAIL):
        return None
    return ToolCall(json.loads(head.group(1)), text[head.end() : len(text) - len(_FORCED_TAIL)])
