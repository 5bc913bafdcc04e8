"""Does a JSON Schema have a finite instance?

A schema whose every instance is infinite (a ``$ref`` cycle, an object that
requires a property of its own type) compiles to a grammar the model can
never finish: it generated until ``max_tokens`` and returned invalid JSON
with ``finish_reason: "stop"``. Such a schema is refused up front.

The check is a least fixpoint over the schema's local ``$ref`` targets: a
target is finite once it can be satisfied using only targets already known
finite. Keywords that only narrow strings and numbers do not matter here;
what can force nesting is a required property, a non-empty array's items,
``allOf`` (all) and ``anyOf``/``oneOf`` (any).
"""

from __future__ import annotations

from typing import Any


def has_finite_instance(schema: Any) -> bool:
    refs: dict[str, Any] = {}
    _collect_refs(schema, schema, refs)
    finite_refs: set[str] = set()
    changed = True
    while changed:  # each pass adds at least one target or stops
        changed = False
        for ref, target in refs.items():
            if ref not in finite_refs and _finite(target, finite_refs):
                finite_refs.add(ref)
                changed = True
    return _finite(schema, finite_refs)


def _finite(s: Any, finite_refs: set[str]) -> bool:
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
        if isinstance(s.get(key), list) and not any(_finite(x, finite_refs) for x in s[key]):
            return False
    if isinstance(s.get("allOf"), list) and not all(_finite(x, finite_refs) for x in s["allOf"]):
        return False
    kinds = s.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else None
    if kinds is None:  # untyped: what the keywords present require
        return _object_finite(s, finite_refs) if "required" in s else True
    return any(_kind_finite(k, s, finite_refs) for k in kinds)


def _kind_finite(kind: Any, s: dict[str, Any], finite_refs: set[str]) -> bool:
    if kind == "object":
        return _object_finite(s, finite_refs)
    if kind == "array":
        min_items = s.get("minItems", 0)
        return not (isinstance(min_items, int) and min_items > 0) or _finite(s.get("items", True), finite_refs)
    return True


def _object_finite(s: dict[str, Any], finite_refs: set[str]) -> bool:
    props: dict[str, Any] = s["properties"] if isinstance(s.get("properties"), dict) else {}
    extra = s.get("additionalProperties", True)
    required: list[Any] = s["required"] if isinstance(s.get("required"), list) else []
    return all(_finite(props.get(name, extra), finite_refs) for name in required)


def _collect_refs(node: Any, root: Any, refs: dict[str, Any]) -> None:
    """Every local ``$ref`` in node, with the subschema it points to."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            ref = n.get("$ref")
            if isinstance(ref, str) and ref not in refs and (target := _resolve(root, ref)) is not None:
                refs[ref] = target
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)


def _resolve(root: Any, ref: str) -> Any:
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
