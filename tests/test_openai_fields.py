"""Every field of OpenAI's chat and completions schemas is honoured or refused
with a 400 naming it; no-op defaults are accepted (one table, both endpoints,
streaming and not)."""

from __future__ import annotations

import json

import httpx
import pytest

from stallfree.gateway.openai.fields import CHAT, COMPLETIONS, IMPLEMENTED

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

# a value each implemented field takes, and for the others one that asks for more than the default
GOOD = {
    "model": "m",
    "max_tokens": 2,
    "max_completion_tokens": 2,
    "temperature": 0.5,
    "top_p": 0.9,
    "stop": ["\n\n"],
    "seed": 7,
    "stream": True,
    "stream_options": {"include_usage": True},
    "user": "someone",
    "top_k": 5,
    "min_p": 0.05,
    "repetition_penalty": 1.2,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "logit_bias": {"42": 5, "7": -100},
    "ignore_eos": True,
    "response_format": {"type": "json_object"},
    "tools": [TOOL],
    "tool_choice": "auto",
    "n": 2,
    "logprobs": 2,  # chat: true (below)
    "top_logprobs": 2,
    "priority": 1,
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "speculate": False,
    "ttft_slo_ms": 2000,
    "messages": [{"role": "user", "content": "Hi"}],
    "prompt": "Hi",
}
NO_OP = {
    "parallel_tool_calls": True,
    "functions": None,
    "function_call": "none",
    "modalities": ["text"],
    "audio": None,
    "prediction": None,
    "reasoning_effort": None,
    "verbosity": None,
    "web_search_options": None,
    "store": False,
    "metadata": None,
    "service_tier": "auto",
    "prompt_cache_key": "conversation-1",
    "safety_identifier": "hashed-user",
    "best_of": 1,
    "echo": False,
    "suffix": "",
}
REFUSED = {
    "parallel_tool_calls": "yes",
    "functions": [TOOL["function"]],
    "function_call": "auto",
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
    "store": True,
    "metadata": {"k": "v"},
    "service_tier": "flex",
    "prompt_cache_key": 5,
    "safety_identifier": 5,
    "best_of": 2,
    "echo": True,
    "suffix": " the end",
}


def post(server, chat: bool, body: dict) -> httpx.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"messages": GOOD["messages"]} if chat else {"prompt": GOOD["prompt"]}
    return httpx.post(server.url + path, json={**base, "max_tokens": 1, **body}, timeout=30)


def test_the_table_covers_both_schemas():
    assert set(GOOD) | set(NO_OP) >= set(CHAT) | set(COMPLETIONS)
    assert {f for f, rule in {**CHAT, **COMPLETIONS}.items() if rule != IMPLEMENTED} == set(NO_OP) == set(REFUSED)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_every_field_is_honoured_or_refused_by_name(server, chat, stream):
    fields = CHAT if chat else COMPLETIONS
    other = COMPLETIONS if chat else CHAT
    for name, rule in fields.items():
        value = GOOD.get(name) if rule == IMPLEMENTED else NO_OP[name]
        if chat and name == "logprobs":
            value = True
        if name in ("messages", "prompt"):
            continue  # the base of every request
        body = {name: value, "stream": stream}
        if chat and name == "top_logprobs":
            body["logprobs"] = True
        r = post(server, chat, body)
        assert r.status_code == 200, (name, value, r.text)
        if rule != IMPLEMENTED:
            r = post(server, chat, {name: REFUSED[name], "stream": stream})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == name and name in error["message"], (name, r.text)
    for name in set(other) - set(fields):
        r = post(server, chat, {name: GOOD.get(name, REFUSED.get(name)), "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
    r = post(server, chat, {"frobnicate": 1, "stream": stream})
    assert r.status_code == 400 and "frobnicate: unknown field" in r.json()["error"]["message"]


def test_no_op_defaults_from_the_official_client(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    comp = client.completions.create(model="m", prompt="Hi", max_tokens=2, best_of=1, n=None, suffix="", echo=False)
    assert comp.choices[0].text is not None
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, n=1, store=False, tools=[]
    )
    assert chat.choices[0].message.content is not None


def test_usage_reports_cached_prompt_tokens(server):
    long = "The same long system prompt for every turn. " * 40
    body = {"messages": [{"role": "system", "content": long}, {"role": "user", "content": "Hi"}], "max_tokens": 2}
    first = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).json()["usage"]
    again = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"] - 16  # all full blocks hit


def test_tokenize_and_detokenize(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, timeout=10).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] > 0
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, timeout=10).json()
    assert back["prompt"] == "Hello world"
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=10)
    usage = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    ).json()["usage"]
    assert chat.json()["count"] == usage["prompt_tokens"]  # what a chat request costs
    for path, body, param in [
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "extra": 1}, "extra"),
    ]:
        r = httpx.post(server.url + path, json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)


@pytest.mark.slow
def test_penalties_and_logit_bias_change_what_the_model_says(tiny):
    """A real model (the tiny random one) through the official client."""
    from openai import OpenAI

    client = OpenAI(base_url=tiny.url + "/v1", api_key="x", max_retries=0)

    def text(**extra) -> str:
        comp = client.completions.create(model="m", prompt="a b a b a b", max_tokens=24, temperature=0, **extra)
        return comp.choices[0].text

    def detokenize(ids: list[int]) -> str:
        return httpx.post(tiny.url + "/detokenize", json={"tokens": ids}, timeout=10).json()["prompt"]

    plain = text()
    assert text(logit_bias={"42": 100}) == detokenize([42] * 24)  # every token the biased one
    assert text(frequency_penalty=2.0, presence_penalty=2.0) != plain
    assert text(extra_body={"repetition_penalty": 3.0}) != plain
    bad = httpx.post(tiny.url + "/v1/completions", json={"prompt": "x", "logit_bias": {"999999": 1}}, timeout=10)
    assert bad.status_code == 400 and "logit_bias" in bad.json()["error"]["message"]
    bad = httpx.post(tiny.url + "/v1/completions", json={"prompt": "x", "presence_penalty": 3}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "presence_penalty"


@pytest.mark.slow
def test_logprobs_in_openai_shapes_streaming_and_not(tiny):
    from openai import OpenAI
    from websockets.sync.client import connect

    client = OpenAI(base_url=tiny.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Count to five"}]
    ask = dict(model="m", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**ask)
    content = whole.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob  # greedy
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    text = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert text == whole.choices[0].message.content
    streamed = [
        e
        for chunk in client.chat.completions.create(**ask, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]

    comp = client.completions.create(model="m", prompt="one two", max_tokens=4, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset == sorted(lp.text_offset) and all(len(top) <= 2 for top in lp.top_logprobs)
    plain = client.completions.create(model="m", prompt="one two", max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == comp.choices[0].text

    with connect(tiny.url.replace("http", "ws") + "/v1/stream") as ws:
        ws.send('{"type": "generate", "id": "g", "prompt": "one two", "max_tokens": 4, "logprobs": 2}')
        frames = []
        while not frames or frames[-1]["type"] not in ("done", "error"):
            frames.append(json.loads(ws.recv()))
    tokens = [f for f in frames if f["type"] == "token"]
    assert sum(len(f["token_ids"]) for f in tokens) == 4
    for f in tokens:
        assert [e["token_id"] for e in f["logprobs"]] == f["token_ids"]
        assert all(len(e["top"]) == 2 and e["logprob"] <= 0 for e in f["logprobs"])

    for body, param in [
        ({"messages": messages, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": messages, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": messages, "logprobs": "yes"}, "logprobs"),
    ]:
        r = httpx.post(tiny.url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(tiny.url + "/v1/completions", json={"prompt": "x", "logprobs": 21}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


@pytest.mark.slow
def test_n_choices_share_the_prompt_and_stream_interleaved(tiny):
    from openai import OpenAI

    client = OpenAI(base_url=tiny.url + "/v1", api_key="x", max_retries=0)
    ask = dict(model="m", prompt="one two three", max_tokens=6, temperature=1.0, seed=3, n=3)
    whole = client.completions.create(**ask)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # each choice its own draw, even with one seed
    prompt_tokens = whole.usage.prompt_tokens
    assert whole.usage.completion_tokens == 18 and whole.usage.total_tokens == prompt_tokens + 18
    again = client.completions.create(**ask)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts  # seeded: reproducible
    streamed: dict[int, str] = {}
    order = []
    for chunk in client.completions.create(**ask, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
            order.append(c.index)
    assert [streamed[i] for i in range(3)] == texts
    assert order != sorted(order)  # interleaved, not one choice after another
    greedy = dict(model="m", prompt="one two three four five six seven", max_tokens=8, temperature=0)
    alone = client.completions.create(**greedy).choices[0].text
    assert [c.text for c in client.completions.create(**greedy, n=3).choices] == [alone] * 3  # shared KV, copied right
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2, logprobs=True
    )
    assert [c.index for c in chat.choices] == [0, 1] and all(len(c.logprobs.content) == 4 for c in chat.choices)


@pytest.mark.slow
def test_a_client_leaving_frees_every_choice(tiny):
    body = {"prompt": "one two", "max_tokens": 400, "n": 4, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", tiny.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text":"' in line:
                break
    assert tiny.wait_kv_baseline() == 0
