"""Tool calling: tools and tool_choice, forced calls by grammar, streamed deltas."""

from __future__ import annotations

import json

import httpx
import pytest

from stallfree.gateway.inputs.tools import Tools, may_start_call, read_calls, template_messages

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}
NESTED = {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_has_valid_arguments_even_from_a_random_model(tiny, choice):
    for seed in range(3):
        reply = client(tiny).chat.completions.create(
            model="m",
            messages=MESSAGES,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            max_tokens=80,
            seed=seed,
            temperature=1.0,
        )
        c = reply.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.id
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f") and len(args["city"]) <= 20
        else:
            assert choice == "required" and call.function.name == "get_time"


@pytest.mark.slow
def test_streamed_call_deltas_reassemble_to_the_same_call(tiny):
    ask = dict(model="m", messages=MESSAGES, tools=[WEATHER], tool_choice="required", max_tokens=80, temperature=0)
    whole = client(tiny).chat.completions.create(**ask).choices[0].message.tool_calls[0]
    name, fragments, ids, finish = "", [], set(), None
    for chunk in client(tiny).chat.completions.create(**ask, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content  # a call is never streamed as text
        for part in delta.tool_calls or []:
            assert part.index == 0
            ids.add(part.id) if part.id else None
            name += part.function.name or ""
            fragments.append(part.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(ids) == 1
    assert (name, "".join(fragments)) == (whole.function.name, whole.function.arguments)  # the same text
    assert len([f for f in fragments if f]) > 2  # the arguments stream as they are generated


@pytest.mark.slow
def test_tool_results_go_back_to_the_model(tiny):
    """An assistant turn with tool_calls and the tool's answer render and run."""
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
    ]
    reply = client(tiny).chat.completions.create(model="m", messages=history, tools=[WEATHER], max_tokens=5)
    assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_bad_tools_are_refused_by_name(tiny):
    cases = [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [_tool("count", {"type": "integer"})], "tool_choice": "required"}, "tools"),  # not an object
        ({"tools": [_tool("nest", NESTED)]}, "tools"),  # no finite instance
    ]
    for extra, param in cases:
        r = httpx.post(tiny.url + "/v1/chat/completions", json={"messages": MESSAGES, **extra}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_reading_calls_from_text():
    text = 'Sure. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert read_calls(text)[0] == "Sure."
    assert [(c.name, c.arguments) for c in read_calls(text)[1]] == [("get_time", "{}")]
    assert read_calls("<tool_call>not json</tool_call>")[1] == []
    assert read_calls("plain answer") == ("plain answer", [])
    assert may_start_call("  <tool") and may_start_call("<tool_call>{") and not may_start_call("The")
    llama = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Nice"}}'
    assert [(c.name, c.arguments) for c in read_calls(llama)[1]] == [("get_weather", '{"city":"Nice"}')]
    assert read_calls('{"answer": 42}') == ('{"answer": 42}', [])  # JSON that is not a call stays text


def test_templates_without_tools_get_the_hermes_system_section():
    tools = Tools([WEATHER["function"]], "auto")
    out = template_messages(MESSAGES, tools, template_takes_tools=False)
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert template_messages(MESSAGES, tools, template_takes_tools=True) == MESSAGES


def test_a_forced_call_streams_its_arguments_and_holds_back_the_closing():
    from stallfree.gateway.inputs.tools import CallStream, forced_call

    text = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}\n</tool_call>'
    stream, got, names = CallStream(), [], []
    for i in range(0, len(text), 5):
        name, part = stream.feed(text[i : i + 5])
        names += [name] if name else []
        got.append(part)
    got.append(stream.finish())
    assert names == ["get_weather"] and "".join(got) == '{"city":"Paris","unit":"c"}'
    assert forced_call(text).arguments == "".join(got)
    assert forced_call(text[:-3]) is None  # cut short: no call


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_max_tokens_ends_as_length_without_its_markup(tiny, stream):
    ask = dict(model="m", messages=MESSAGES, tools=[WEATHER], tool_choice="required", max_tokens=6, temperature=0)
    if not stream:
        c = client(tiny).chat.completions.create(**ask).choices[0]
        assert c.finish_reason == "length" and not c.message.content and not c.message.tool_calls
        return
    content, finish = "", None
    for chunk in client(tiny).chat.completions.create(**ask, stream=True):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "length" and "<tool_call>" not in content
