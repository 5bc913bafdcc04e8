"""response_format: the sampler enforces the schema token by token (llguidance)."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import BaseModel

from bench.servers import StallfreeServer

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_even_a_random_model_follows_the_schema(tiny):
    """The tiny model's weights are random: every valid document comes from the mask."""
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
    for seed in range(4):
        body = {"prompt": "x", "max_tokens": 40, "temperature": 1.0, "seed": seed, "response_format": fmt}
        choice = httpx.post(tiny.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        doc = json.loads(choice["text"])
        assert set(doc) == {"ok", "n"} and isinstance(doc["ok"], bool) and 0 <= doc["n"] <= 9


@pytest.mark.slow
def test_json_object_streamed_and_over_the_websocket(tiny):
    from websockets.sync.client import connect

    body = {"prompt": "x", "max_tokens": 200, "temperature": 0, "response_format": {"type": "json_object"}}
    r = httpx.post(tiny.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    if chunks[-1]["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert text.startswith("{")
    with connect(tiny.url.replace("http", "ws") + "/v1/stream") as ws:
        frame = {"type": "generate", "id": "g", "prompt": "x", "max_tokens": 200, "temperature": 0}
        ws.send(json.dumps({**frame, "response_format": {"type": "json_object"}}))
        frames = []
        while not frames or frames[-1]["type"] not in ("done", "error"):
            frames.append(json.loads(ws.recv()))
    assert "".join(f["text"] for f in frames if f["type"] == "token") == text  # same greedy path


def _schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "why"),
    [
        ({"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "objectx"}}}, "objectx"),
        ({"type": "json_schema", "json_schema": {"name": "t", "schema": {"not": {"type": "string"}}}}, "not"),
        ({"type": "json_schema", "json_schema": {"name": "t"}}, "schema object"),
        ({"type": "xml"}, "type must be"),
        ("json", "type must be"),
        (_schema({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}), "finite"),
        (_schema({"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]}), "finite"),
    ],
)
def test_a_schema_that_cannot_be_enforced_is_refused(tiny, fmt, why):
    for path, base in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("/v1/completions", {"prompt": "x"}),
    ]:
        r = httpx.post(tiny.url + path, json={**base, "response_format": fmt}, timeout=10)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "response_format" and why in error["message"], r.text
    assert httpx.get(tiny.url + "/readyz", timeout=10).status_code == 200  # and the server keeps serving


class City(BaseModel):
    name: str
    country: str
    population: int


@pytest.mark.slow
def test_the_official_client_parses_a_pydantic_model_from_the_real_model():
    from openai import OpenAI

    server = StallfreeServer("--dtype", "fp32", "--threads", "1")
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        reply = client.beta.chat.completions.parse(
            model="m",
            messages=[{"role": "user", "content": "Give the name, country and population of Paris as JSON."}],
            response_format=City,
            temperature=0,
            max_tokens=60,
        )
        city = reply.choices[0].message.parsed
        assert isinstance(city, City) and city.name and city.population >= 0
    finally:
        server.stop()


def test_a_matcher_compiles_in_a_worker_thread_while_the_first_chunk_runs(monkeypatch):
    """Compiling a schema's matcher (13-20 ms for 300 patterned properties,
    with the lock released) happens beside the step, not in it; the first
    sampled token uses that matcher, not a second compile."""
    import threading

    import torch

    from stallfree.core.model import grammar as grammar_module
    from stallfree.core.model.loader import load_tiny
    from stallfree.core.model.sampler import Sampler
    from stallfree.core.sched.request import Request, SamplingParams
    from stallfree.gateway.inputs.structured import grammar_of

    compiled_on: list[str] = []
    compile_matcher = grammar_module._compile

    def recording(ll, text):
        compiled_on.append(threading.current_thread().name)
        return compile_matcher(ll, text)

    monkeypatch.setattr(grammar_module, "_compile", recording)
    loaded = load_tiny()
    sampler = Sampler(loaded.config.vocab_size, torch.device("cpu"), loaded.tokenizer)
    assert sampler.grammars is not None
    sampler.grammars.warm()
    req = Request("r", [1, 2, 3], SamplingParams(grammar=grammar_of(_schema(SCHEMA))), 0)
    sampler.grammars.prepare([req])
    token = sampler(torch.zeros(1, loaded.config.vocab_size), [req]).tokens[0][0]
    assert compiled_on and compiled_on[0].startswith("grammar") and len(compiled_on) == 1
    assert loaded.tokenizer.decode([token]).startswith("{")
