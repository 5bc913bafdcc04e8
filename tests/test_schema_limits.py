"""Schemas from clients (``tools``, ``response_format``): the finite-instance
check is linear and capped, a schema-bearing body is parsed off the event
loop, and every ``tool_choice`` shape gets a 400 naming it (issue 36's
findings 2, 9 and 10)."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.gateway.inputs.finite_schema import MAX_SCHEMA_NODES, has_finite_instance
from stallfree.gateway.inputs.protocol import parse_off_loop
from tests.server import sim_server

NAMES = ["a", "b", "c", "d"]


@pytest.fixture(scope="module")
def server():
    s = sim_server()
    yield s
    s.stop()


def _subschema() -> st.SearchStrategy[Any]:
    leaf = st.one_of(
        st.booleans(),
        st.sampled_from([{"type": "string"}, {"enum": []}, {"const": 1}, {"type": []}, {"type": ["array", "object"]}]),
        st.sampled_from([*NAMES, "zz", "", "a/b"]).map(lambda n: {"$ref": f"#/$defs/{n}"}),
        st.just({"$ref": "#"}),
    )

    def extend(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        props = st.dictionaries(st.sampled_from(["p", "q", "r"]), inner, max_size=3)
        return st.one_of(
            st.builds(
                lambda p, req, extra: {
                    "type": "object",
                    "properties": p,
                    "required": req,
                    "additionalProperties": extra,
                },
                props,
                st.lists(st.sampled_from(["p", "q", "r", "s"]), max_size=3),
                st.one_of(st.just(True), st.just(False), inner),
            ),
            st.builds(lambda i, n: {"type": "array", "items": i, "minItems": n}, inner, st.integers(0, 2)),
            st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, max_size=3)),
            st.builds(lambda xs: {"oneOf": xs}, st.lists(inner, max_size=3)),
            st.builds(lambda xs: {"allOf": xs}, st.lists(inner, max_size=3)),
            st.builds(lambda p, req: {"properties": p, "required": req}, props, st.lists(st.sampled_from(["p", "q"]))),
            st.builds(
                lambda r, x: (
                    {**x, "$ref": r["$ref"]} if isinstance(r, dict) and "$ref" in r and isinstance(x, dict) else x
                ),
                inner,
                inner,
            ),
        )

    return st.recursive(leaf, extend, max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(root=_subschema(), defs=st.dictionaries(st.sampled_from(NAMES), _subschema(), max_size=4))
def test_the_linear_check_agrees_with_the_fixpoint_it_replaced(root, defs):
    schema = {**root, "$defs": defs} if isinstance(root, dict) else root
    assert has_finite_instance(schema) == reference_finite(schema)


def test_a_long_ref_chain_is_finite_or_not_as_its_end_says():
    def chain(n: int, end: Any) -> dict[str, Any]:
        defs = {"d0": end, **{f"d{i}": {"$ref": f"#/$defs/d{i - 1}"} for i in range(1, n)}}
        return {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{n - 1}"}}, "required": ["x"], "$defs": defs}

    assert has_finite_instance(chain(5000, {"type": "string"}))
    assert not has_finite_instance(chain(5000, {"$ref": f"#/$defs/d{4999}"}))  # a cycle through all of them


def test_a_schema_over_the_cap_is_refused_naming_its_field(server):
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_SCHEMA_NODES // 2)}}
    tool = {"type": "function", "function": {"name": "f", "parameters": big}}
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "tools": [tool]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text[:300]
    assert f"more than {MAX_SCHEMA_NODES} values" in r.json()["error"]["message"]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": big}}
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "response_format": fmt}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text[:300]


async def test_a_body_with_a_schema_is_parsed_in_a_worker_thread():
    seen: list[bool] = []

    def parse(body: dict[str, Any], client: object) -> int:
        seen.append(threading.current_thread() is threading.main_thread())
        return 1

    await parse_off_loop(parse, {"prompt": "hi"}, None)
    await parse_off_loop(parse, {"tools": [{"type": "function"}]}, None)
    await parse_off_loop(parse, {"response_format": {"type": "json_object"}}, None)
    assert seen == [True, False, False]


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "function", "function": "f"},
        {"type": "function", "function": None},
        {"type": "function", "function": ["f"]},
        {"type": "function", "function": 3},
        {"type": "function"},
        ["f"],
        3,
        "f",
    ],
)
def test_every_tool_choice_shape_gets_a_400_naming_it(server, choice):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": choice}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text[:300]


def test_responses_name_the_served_model_not_the_clients_string(server):
    model = "m" * 100_000
    body = {"prompt": "hi", "max_tokens": 3, "n": 2, "stream": True, "model": model}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    chunks = [orjson.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"stallfree"}
    assert len(r.content) < 20_000  # the 100 kB string came back in none of them
    plain = httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=30).json()
    assert plain["model"] == "stallfree"


# the quadratic fixpoint this module replaced, kept as the reference the property test compares with


def reference_finite(schema: Any) -> bool:
    refs: dict[str, Any] = {}
    _ref_collect(schema, schema, refs)
    finite_refs: set[str] = set()
    changed = True
    while changed:  # each pass adds at least one target or stops
        changed = False
        for ref, target in refs.items():
            if ref not in finite_refs and _ref_finite(target, finite_refs):
                finite_refs.add(ref)
                changed = True
    return _ref_finite(schema, finite_refs)


def _ref_finite(s: Any, finite_refs: set[str]) -> bool:
    if s is False:
        return False
    if not isinstance(s, dict):
        return True  # true, or something the grammar compiler judges
    if "$ref" in s and s["$ref"] not in finite_refs:
        return False
    if "enum" in s and isinstance(s["enum"], list) and not s["enum"]:
        return False
    if "const" in s or "enum" in s:
        return True
    for key in ("anyOf", "oneOf"):
        if isinstance(s.get(key), list) and not any(_ref_finite(x, finite_refs) for x in s[key]):
            return False
    if isinstance(s.get("allOf"), list) and not all(_ref_finite(x, finite_refs) for x in s["allOf"]):
        return False
    kinds = s.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else None
    if kinds is None:  # untyped: what the keywords present require
        return _object_ref_finite(s, finite_refs) if "required" in s else True
    return any(_kind_ref_finite(k, s, finite_refs) for k in kinds)


def _kind_ref_finite(kind: Any, s: dict[str, Any], finite_refs: set[str]) -> bool:
    if kind == "object":
        return _object_ref_finite(s, finite_refs)
    if kind == "array":
        min_items = s.get("minItems", 0)
        return not (isinstance(min_items, int) and min_items > 0) or _ref_finite(s.get("items", True), finite_refs)
    return True


def _object_ref_finite(s: dict[str, Any], finite_refs: set[str]) -> bool:
    props: dict[str, Any] = s["properties"] if isinstance(s.get("properties"), dict) else {}
    extra = s.get("additionalProperties", True)
    required: list[Any] = s["required"] if isinstance(s.get("required"), list) else []
    return all(_ref_finite(props.get(name, extra), finite_refs) for name in required)


def _ref_collect(node: Any, root: Any, refs: dict[str, Any]) -> None:
    """Every local ``$ref`` in node, with the subschema it points to."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            ref = n.get("$ref")
            if isinstance(ref, str) and ref not in refs and (target := _ref_resolve(root, ref)) is not None:
                refs[ref] = target
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)


def _ref_resolve(root: Any, ref: str) -> Any:
    if not ref.startswith("#"):
        return None  # remote: the grammar compiler refuses it
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
