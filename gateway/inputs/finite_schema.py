"""Does a JSON Schema have a finite instance?

A schema whose every instance is infinite (a ``$ref`` cycle, an object that
requires a property of its own type) compiles to a grammar the model can
never finish: it generated until ``max_tokens`` and returned invalid JSON
with ``finish_reason: "stop"``. Such a schema is refused up front.

Keywords that only narrow strings and numbers do not matter here; what can
force nesting is a local ``$ref``, a required property, a non-empty array's
items, ``allOf`` (all) and ``anyOf``/``oneOf`` (any). So each subschema is a
node that is finite when all (AND) or any (OR) of its children are, and the
answer is the least fixpoint, found by propagation with a counter per AND
node: linear in the schema's size. (A pass over every ``$ref`` until nothing
changed was quadratic: a chain of 8,000 ``$defs`` held the event loop 8.7 s.)
The schema is also capped at ``MAX_SCHEMA_NODES`` values.
"""

from __future__ import annotations

from collections import deque
from typing import Any

MAX_SCHEMA_NODES = 20_000  # JSON values in one schema (objects, arrays, scalars)


class SchemaTooLarge(ValueError):
    pass


def has_finite_instance(schema: Any) -> bool:
    """Raises SchemaTooLarge past MAX_SCHEMA_NODES."""
    check_size(schema)
    graph = _Graph(schema)
    return graph.solve(graph.node(schema))


def check_size(schema: Any) -> None:
    """Raises SchemaTooLarge past MAX_SCHEMA_NODES (before anything else reads the schema)."""
    stack, count = [schema], 0
    while stack:
        n = stack.pop()
        count += 1
        if count > MAX_SCHEMA_NODES:
            raise SchemaTooLarge(f"a schema of more than {MAX_SCHEMA_NODES} values")
        if isinstance(n, dict):
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)


class _Graph:
    """AND/OR nodes: ``all_of[i]`` says which; ``children[i]`` their inputs.
    An AND without children is true, an OR without children false."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.all_of: list[bool] = []
        self.children: list[list[int]] = []
        self._of_schema: dict[int, int] = {}  # id(subschema) -> its node; a $ref cycle meets itself here

    def _new(self, all_of: bool, children: list[int] | None = None) -> int:
        self.all_of.append(all_of)
        self.children.append(children or [])
        return len(self.all_of) - 1

    def node(self, s: Any) -> int:
        """The node of subschema s, built once per subschema, iteratively (no recursion limit)."""
        if id(s) in self._of_schema:
            return self._of_schema[id(s)]
        top = self._new(True)
        self._of_schema[id(s)] = top
        work = [(top, s)]
        while work:
            at, sub = work.pop()
            for child in self._conjuncts(sub):
                self.children[at].append(self._child(child, work))
        return top

    def _child(self, part: tuple[str, Any], work: list[tuple[int, Any]]) -> int:
        """A conjunct as a node: ("schema", s), ("any", [parts]), ("all", [parts])."""
        kind, value = part
        if kind == "schema":
            if id(value) in self._of_schema:
                return self._of_schema[id(value)]
            n = self._new(True)
            if isinstance(value, (dict, bool)):  # only containers and booleans are shared by identity
                self._of_schema[id(value)] = n
            work.append((n, value))
            return n
        return self._new(kind == "all", [self._child(p, work) for p in value])

    def _conjuncts(self, s: Any) -> list[tuple[str, Any]]:
        """What s needs, all of it, as parts for _child. False is an empty "any"."""
        never: tuple[str, Any] = ("any", [])
        if s is False:
            return [never]
        if not isinstance(s, dict):
            return []  # true, or something the grammar compiler judges
        needs: list[tuple[str, Any]] = []
        if "$ref" in s:
            target = _resolve(self.root, s["$ref"]) if isinstance(s["$ref"], str) else None
            needs.append(("schema", target) if target is not None else never)
        if "enum" in s and isinstance(s["enum"], list) and not s["enum"]:
            return [never]
        if "const" in s or "enum" in s:
            return needs
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list):
                needs.append(("any", [("schema", x) for x in s[key]]))
        if isinstance(s.get("allOf"), list):
            needs += [("schema", x) for x in s["allOf"]]
        kinds = s.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else None
        if kinds is None:  # untyped: what the keywords present require
            if "required" in s:
                needs += _object_needs(s)
        else:
            needs.append(("any", [("all", _kind_needs(k, s)) for k in kinds]))
        return needs

    def solve(self, goal: int) -> bool:
        """Least fixpoint: true AND nodes are those whose children all become true."""
        parents: list[list[int]] = [[] for _ in self.all_of]
        waiting = [len(c) for c in self.children]
        for n, children in enumerate(self.children):
            for c in children:
                parents[c].append(n)
        true = [self.all_of[n] and not waiting[n] for n in range(len(self.all_of))]
        queue = deque(n for n, t in enumerate(true) if t)
        while queue:
            for p in parents[queue.popleft()]:
                if true[p]:
                    continue
                waiting[p] -= 1
                if not self.all_of[p] or not waiting[p]:
                    true[p] = True
                    queue.append(p)
        return true[goal]


def _kind_needs(kind: Any, s: dict[str, Any]) -> list[tuple[str, Any]]:
    if kind == "object":
        return _object_needs(s)
    if kind == "array":
        min_items = s.get("minItems", 0)
        return [("schema", s.get("items", True))] if isinstance(min_items, int) and min_items > 0 else []
    return []


def _object_needs(s: dict[str, Any]) -> list[tuple[str, Any]]:
    props: dict[str, Any] = s["properties"] if isinstance(s.get("properties"), dict) else {}
    extra = s.get("additionalProperties", True)
    required: list[Any] = s["required"] if isinstance(s.get("required"), list) else []
    return [("schema", props.get(name, extra) if isinstance(name, str) else extra) for name in required]


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
