"""Constrained decoding (issue 16): what the next-token mask costs on this CPU,
xgrammar beside llguidance, over the embedded model's tokenizer.

    .venv/bin/python -m bench.grammar_masks [--repeats 5] [--threads 1]

Needs ``xgrammar`` and ``llguidance`` in the venv (not project dependencies
yet). Two constraints: ``json_object`` (any JSON object) and a strict JSON
Schema. For each library and constraint:

* one-off cost: the tokenizer info / compiler (once per tokenizer), compiling
  a grammar (cache off: what a new schema costs), creating a matcher;
* one sequence: a real JSON document, tokenized by the project's tokenizer,
  fed token by token (fill the 49,152-bit mask, check the token is allowed,
  accept it, and EOS at the end); per-token fill time median and p99;
* batch 32: 32 matchers each at a different point of the document, one
  [32, 1536] int32 bitmask filled per iteration by the library's batch API
  (xgrammar ``BatchGrammarMatcher``, llguidance ``LLExecutor``) with 1 and
  all CPU threads, then the 32 sampled tokens accepted by the batch API;
* applying the [32, 1536] bitmask to [32, 49152] float32 logits on CPU, with
  each library's ``apply_token_bitmask_inplace`` and with plain torch;
* JSON Schema coverage: per keyword, a valid and an invalid instance fed token
  by token: enforced, silently ignored, or refused at compile time.

Before timing it checks correctness: every document token is allowed by the
mask and accepted, the matcher ends terminated/accepting, and invalid tokens
are masked out and rejected. The libraries alternate (A B A B) within each
repeat; results are medians [min–max] over repeats. Writes a new
bench/results/grammar_masks-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata as md
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from bench.record import dated, describe, machine
from core.model.gguf import GGUFFile
from core.model.loader import embedded_model_path
from core.model.tokenizer import Tokenizer

BATCH = 32

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}

# What a model might write; json.dumps' ", " / ": " separators.
DOCS: dict[str, Any] = {
    "json_object": {
        "city": "Paris",
        "country": "France",
        "population": 2102650,
        "coordinates": {"lat": 48.8566, "lon": 2.3522},
        "landmarks": ["Eiffel Tower", "Louvre Museum", "Notre-Dame de Paris"],
        "capital": True,
        "mayor": None,
        "notes": 'Population from the 2023 census; "Paris" proper, not the metro area.',
    },
    "json_schema": {
        "name": "Ada Lovelace",
        "age": 36,
        "tags": [
            "mathematician",
            "writer",
            "Analytical Engine",
            "first computer program",
            "Bernoulli numbers",
            "Note G",
            "poetical science",
            "Victorian era",
            "London",
            "daughter of Lord Byron",
        ],
    },
}

# (prefix of valid text, the bytes of one token the grammar must refuse right after it)
INVALID: dict[str, list[tuple[str, bytes]]] = {
    "json_object": [("", b"["), ("", b"hello"), ('{"city": "Paris"', b" Paris"), ('{"a": ', b"}")],
    "json_schema": [
        ("", b"["),
        ('{"name": "Ada", "age": ', b'"'),
        ('{"name": "Ada", "age": 3', b"."),
        ('{"name": "Ada", "age": 36', b"}"),
        ('{"name": "Ada", "age": 36, "tags": [', b" true"),
    ],
}


_NODE = {
    "type": "object",
    "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
    "required": ["v", "next"],
    "additionalProperties": False,
}
# JSON Schema coverage probe: (keyword, schema, a valid instance, an invalid one).
FEATURES: list[tuple[str, dict[str, Any], Any, Any]] = [
    ("pattern", {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"}, "AB-1234", "ab-1234"),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 4}, "abc", "abcdef"),
    ("format: email", {"type": "string", "format": "email"}, "a@b.co", "not an email"),
    ("format: date-time", {"type": "string", "format": "date-time"}, "2024-01-02T03:04:05Z", "yesterday"),
    ("minimum/maximum", {"type": "integer", "minimum": 1, "maximum": 10}, 7, 11),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, 0.5, -1),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, 15, 7),
    ("enum", {"enum": ["red", "green", 1]}, "green", "blue"),
    ("const", {"const": "x"}, "x", "y"),
    ("type: [string, null]", {"type": ["string", "null"]}, None, 1),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 3, True),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, 3, True),
    (
        "allOf",
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "string"}}, "required": ["b"]},
            ]
        },
        {"a": 1, "b": "x"},
        {"a": 1},
    ),
    ("not", {"not": {"type": "string"}}, 1, "s"),
    (
        "$ref/$defs, recursive",
        {"$defs": {"node": _NODE}, "$ref": "#/$defs/node"},
        {"v": 1, "next": {"v": 2, "next": None}},
        {"v": 1, "next": {"v": "x", "next": None}},
    ),
    ("minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, [1, 2], [1]),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    (
        "prefixItems",
        {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
        ["a", 1],
        ["a", "b"],
    ),
    (
        "additionalProperties: {schema}",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"a": 1},
        {"a": "x"},
    ),
    (
        "patternProperties ^x_",
        {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}, "additionalProperties": False},
        {"x_a": 1},
        {"y": 1},
    ),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, {"ab": 1}, {"AB": 1}),
    ("minProperties", {"type": "object", "minProperties": 1}, {"a": 1}, {}),
    (
        "dependentRequired",
        {"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
        {"b": 1},
        {"a": 1},
    ),
    (
        "if/then",
        {
            "type": "object",
            "properties": {"k": {"type": "string"}, "x": {}},
            "if": {"properties": {"k": {"const": "a"}}},
            "then": {"required": ["x"]},
        },
        {"k": "b"},
        {"k": "a"},
    ),
    (
        "properties in another order",
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
        {"b": 1, "a": 2},
        {"b": 1},
    ),
]


def constraint_schema(kind: str) -> dict[str, Any]:
    return {"type": "object"} if kind == "json_object" else SCHEMA


# -- the two libraries behind one small interface ---------------------------


class Xgr:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer, eos: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        start = time.perf_counter()
        self.info = xgr.TokenizerInfo(tok.token_bytes, xgr.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=eos)
        threads = os.cpu_count() or 1
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.setup_s = time.perf_counter() - start
        self.vocab = tok.vocab_size

    def compile(self, kind: str) -> Any:
        return self.compile_schema(constraint_schema(kind))

    def compile_schema(self, schema: dict[str, Any], strict_mode: bool = True) -> Any:
        # strict_mode (the default) also forbids properties the schema does not list
        return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=strict_mode)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m: Any) -> bool:
        return m.is_terminated()

    def rollback(self, m: Any, n: int) -> None:
        m.rollback(n)

    def reset(self, m: Any) -> None:
        m.reset()

    def batch(self, threads: int) -> Callable[[list[Any], torch.Tensor], None]:
        bm = self.xgr.BatchGrammarMatcher(max_threads=threads)
        return lambda ms, bitmask: bm.batch_fill_next_token_bitmask(ms, bitmask)

    def batch_accept(self, ms: list[Any], tokens: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(ms, tokens)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class Llg:
    name = "llguidance"

    def __init__(self, tok: Tokenizer, eos: list[int]) -> None:
        import llguidance
        import llguidance.torch as llgt

        self.llg, self.llgt = llguidance, llgt
        start = time.perf_counter()
        # the HF tokenizer JSON the GGUF metadata builds: byte-level BPE, specials marked
        self.tokenizer = llguidance.LLTokenizer(tok.to_hf_json(), n_vocab=tok.vocab_size, eos_token=eos)
        self.setup_s = time.perf_counter() - start
        self.vocab = tok.vocab_size

    def compile(self, kind: str) -> Any:
        return self.compile_schema(constraint_schema(kind))

    def compile_schema(self, schema: dict[str, Any], strict_mode: bool = True) -> Any:
        # llguidance compiles lazily: the grammar text, then the matcher builds the parser
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        m = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)  # errors via is_error()/get_error()
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m  # a template; per request matchers are deep copies (or a new LLMatcher)

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        self.llgt.fill_next_token_bitmask(m, bitmask, row)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m: Any) -> bool:
        return m.is_stopped() and m.is_accepting() and not m.is_error()

    def rollback(self, m: Any, n: int) -> None:
        assert m.rollback(n)

    def reset(self, m: Any) -> None:
        m.reset()

    def batch(self, threads: int) -> Callable[[list[Any], torch.Tensor], None]:
        ex = self.llg.LLExecutor(num_threads=threads)
        return lambda ms, bitmask: self.llgt.fill_next_token_bitmask_par(
            ex, [(m, i) for i, m in enumerate(ms)], bitmask
        )

    def batch_accept(self, ms: list[Any], tokens: list[int]) -> list[bool]:
        if not hasattr(self, "_ex1"):
            self._ex1 = self.llg.LLExecutor(num_threads=1)
        return self.llgt.consume_token_par(self._ex1, list(zip(ms, tokens, strict=True)))

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.llgt.apply_token_bitmask_inplace(logits, bitmask)  # torch.compile'd kernel


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def torch_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """No library: unpack the bits and masked_fill (the fallback a sampler could own)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, : logits.shape[1]]
    logits.masked_fill_(bits == 0, float("-inf"))


# -- checks --------------------------------------------------------------------


def verify(lib: Any, tok: Tokenizer, kind: str, ids: list[int], eos: int) -> dict[str, Any]:
    compiled = lib.compile(kind)
    bitmask = torch.full((1, (lib.vocab + 31) // 32), -1, dtype=torch.int32)
    m = lib.matcher(compiled)
    for pos, t in enumerate(ids):
        bitmask.fill_(-1)
        lib.fill(m, bitmask, 0)
        if not allowed(bitmask, 0, t):
            raise AssertionError(f"{lib.name}/{kind}: token {pos} {tok.token_bytes[t]!r} masked out")
        if pos == 0 and allowed(bitmask, 0, eos):
            raise AssertionError(f"{lib.name}/{kind}: EOS allowed at the start")
        if pos == len(ids) - 1 and allowed(bitmask, 0, 1):
            raise AssertionError(f"{lib.name}/{kind}: special token <|im_start|> allowed")
        if not lib.accept(m, t):
            raise AssertionError(f"{lib.name}/{kind}: token {pos} {tok.token_bytes[t]!r} refused")
        if pos == len(ids) - 2:  # roll back 5 tokens and replay them (speculation, stop strings)
            lib.rollback(m, 5)
            for t2 in ids[pos - 4 : pos + 1]:
                if not lib.accept(m, t2):
                    raise AssertionError(f"{lib.name}/{kind}: replay after rollback refused")
    if not lib.done(m):
        raise AssertionError(f"{lib.name}/{kind}: not terminated after EOS")
    n_allowed_start = None
    rejected = []
    for prefix, bad in INVALID[kind]:
        m = lib.matcher(compiled)
        for t in tok.encode(prefix):
            assert lib.accept(m, t), (lib.name, kind, prefix)
        bad_id = tok.token_bytes.index(bad)
        bitmask.fill_(-1)
        lib.fill(m, bitmask, 0)
        if prefix == "":
            n_allowed_start = int(np.unpackbits(bitmask.numpy().view(np.uint8)).sum())
        if allowed(bitmask, 0, bad_id):
            raise AssertionError(f"{lib.name}/{kind}: {bad!r} after {prefix!r} not masked")
        if lib.accept(m, bad_id):
            raise AssertionError(f"{lib.name}/{kind}: {bad!r} after {prefix!r} accepted")
        rejected.append(f"{bad!r} after {prefix!r}")
    return {
        "document_tokens_accepted": len(ids),
        "terminated": True,
        "rollback_5_and_replay": True,
        "invalid_masked_and_refused": rejected,
        "tokens_allowed_at_start": n_allowed_start,
    }


def coverage(lib: Any, tok: Tokenizer, eos: int) -> dict[str, str]:
    """Each FEATURES schema: compiled with the spec's semantics (xgrammar strict_mode off), then
    a valid and an invalid instance fed token by token: enforced / ignored (the invalid one
    passes) / rejects valid / error (refused at compile time, with the library's message)."""

    def passes(compiled: Any, value: Any) -> bool:
        m = lib.matcher(compiled)
        return all(lib.accept(m, t) for t in [*tok.encode(json.dumps(value)), eos]) and lib.done(m)

    out = {}
    for name, schema, good, bad in FEATURES:
        try:
            compiled = lib.compile_schema(schema, strict_mode=False)
        except Exception as exc:  # the message is the result
            out[name] = f"error: {str(exc).splitlines()[0][:80]}"
            continue
        ok, refused = passes(compiled, good), not passes(compiled, bad)
        out[name] = "enforced" if ok and refused else "ignored" if ok else "rejects valid" if refused else "broken"
    return out


# -- timings -------------------------------------------------------------------


def single(lib: Any, compiled: Any, ids: list[int]) -> list[float]:
    """Per-token fill times (s) for one fresh matcher over the whole document."""
    bitmask = torch.full((1, (lib.vocab + 31) // 32), -1, dtype=torch.int32)
    m = lib.matcher(compiled)
    times = []
    for t in ids:
        start = time.perf_counter()
        lib.fill(m, bitmask, 0)
        times.append(time.perf_counter() - start)
        assert allowed(bitmask, 0, t) and lib.accept(m, t)
    return times


def batched(lib: Any, compiled: Any, ids: list[int], threads: int) -> tuple[list[float], list[float], torch.Tensor]:
    """32 matchers at staggered positions; one iteration = fill [32, words], accept 32 tokens.
    Returns per-iteration fill and accept times (s) and the last bitmask."""
    fill = lib.batch(threads)
    n = len(ids)
    ms = [lib.matcher(compiled) for _ in range(BATCH)]
    pos = [i * n // BATCH for i in range(BATCH)]
    for m, p in zip(ms, pos, strict=True):
        for t in ids[:p]:
            assert lib.accept(m, t)
    bitmask = torch.full((BATCH, (lib.vocab + 31) // 32), -1, dtype=torch.int32)
    fills, accepts = [], []
    for _ in range(n):
        start = time.perf_counter()
        fill(ms, bitmask)
        fills.append(time.perf_counter() - start)
        tokens = [ids[p] for p in pos]
        assert all(allowed(bitmask, i, t) for i, t in enumerate(tokens)), lib.name
        start = time.perf_counter()
        ok = lib.batch_accept(ms, tokens)
        accepts.append(time.perf_counter() - start)
        assert all(ok), lib.name
        for i in range(BATCH):
            pos[i] += 1
            if pos[i] == n:  # finished: a new request with the same constraint takes the slot
                assert lib.done(ms[i])
                lib.reset(ms[i])
                pos[i] = 0
    return fills, accepts, bitmask


def timed(fn: Callable[[], None], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def summary(values: list[float], scale: float = 1e3, digits: int = 3) -> dict[str, float]:
    return {
        "median": round(statistics.median(values) * scale, digits),
        "min": round(min(values) * scale, digits),
        "max": round(max(values) * scale, digits),
    }


def fmt(s: dict[str, float]) -> str:
    return f"{s['median']:g} [{s['min']:g}–{s['max']:g}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the logits mask)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpus = os.cpu_count() or 1
    batch_threads = sorted({1, cpus})

    tok = Tokenizer.from_gguf_metadata(GGUFFile(embedded_model_path()).metadata)
    eos = sorted(tok.eos_token_ids)
    libs: list[Xgr | Llg] = [Xgr(tok, eos), Llg(tok, eos)]
    docs = {kind: [*tok.encode(json.dumps(doc)), eos[0]] for kind, doc in DOCS.items()}

    checks = {f"{lib.name}/{kind}": verify(lib, tok, kind, ids, eos[0]) for lib in libs for kind, ids in docs.items()}
    print("correctness: ok", flush=True)
    probe = {lib.name: coverage(lib, tok, eos[0]) for lib in libs}

    # raw samples: [lib][kind][metric] -> per-repeat values (s)
    raw: dict[str, dict[str, dict[str, list[float]]]] = {lib.name: {kind: {} for kind in docs} for lib in libs}
    apply_raw: dict[str, list[float]] = {"xgrammar": [], "llguidance": [], "torch": []}
    first_apply: dict[str, float] = {}
    logits_base = torch.randn(BATCH, tok.vocab_size)
    last_mask = None
    for rep in range(args.repeats + 1):  # repeat 0 warms up
        for kind, ids in docs.items():
            for lib in libs:
                r = raw[lib.name][kind]
                start = time.perf_counter()
                compiled = lib.compile(kind)
                compile_s = time.perf_counter() - start
                start = time.perf_counter()
                lib.matcher(compiled)
                matcher_s = time.perf_counter() - start
                times = single(lib, compiled, ids)
                samples = {
                    "compile": compile_s,
                    "matcher": matcher_s,
                    "single_median": statistics.median(times),
                    "single_p99": float(np.percentile(times, 99)),
                    "single_max": max(times),
                    "single_first": times[0],
                }
                for th in batch_threads:
                    fills, accepts, last_mask = batched(lib, compiled, ids, th)
                    samples[f"batch_fill_t{th}"] = statistics.median(fills)
                    samples[f"batch_fill_p99_t{th}"] = float(np.percentile(fills, 99))
                    if th == 1:
                        samples["batch_accept"] = statistics.median(accepts)
                if rep:
                    for k, v in samples.items():
                        r.setdefault(k, []).append(v)
        assert last_mask is not None
        for name, fn in (("xgrammar", libs[0].apply), ("llguidance", libs[1].apply), ("torch", torch_apply)):
            logits = logits_base.clone()
            if rep == 0:
                start = time.perf_counter()
                fn(logits, last_mask)  # llguidance: torch.compile happens here
                first_apply[name] = time.perf_counter() - start
                expect = logits_base.clone()
                torch_apply(expect, last_mask)
                assert torch.equal(logits, expect), name
            else:
                apply_raw[name].append(timed(functools.partial(fn, logits, last_mask), 50))
        print(f"repeat {rep} done", flush=True)

    versions = {p: md.version(p) for p in ("xgrammar", "llguidance", "torch")}
    m = machine()
    results: dict[str, Any] = {
        "machine": describe(m),
        "machine_facts": m,
        "versions": versions,
        "repeats": args.repeats,
        "batch": BATCH,
        "batch_threads": batch_threads,
        "torch_threads": args.threads,
        "vocab_size": tok.vocab_size,
        "documents": {
            kind: {"tokens_with_eos": len(ids), "text": json.dumps(DOCS[kind])} for kind, ids in docs.items()
        },
        "schema": SCHEMA,
        "correctness": checks,
        "json_schema_coverage": probe,
        "tokenizer_setup_ms": {lib.name: round(lib.setup_s * 1e3, 1) for lib in libs},
        "results": {
            lib: {
                kind: {
                    k: summary(
                        v, 1e3 if k in ("compile", "matcher") else 1e6, 1 if k not in ("compile", "matcher") else 3
                    )
                    for k, v in r.items()
                }
                for kind, r in per_kind.items()
            }
            for lib, per_kind in raw.items()
        },
        "units": "compile, matcher: ms; single_*: µs per token; batch_*: µs per iteration (32 rows)",
        "apply_bitmask_32x49152_us": {k: summary(v, 1e6, 1) for k, v in apply_raw.items()},
        "apply_first_call_ms": {k: round(v * 1e3, 1) for k, v in first_apply.items()},
    }
    base = dated("grammar_masks")
    base.with_suffix(".json").write_text(json.dumps(results, indent=2))

    lines = [
        "# Next-token mask cost: xgrammar vs llguidance",
        "",
        f"Machine: {describe(m)}. Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        f"Tokenizer: the embedded SmolLM2-135M GGUF, vocab {tok.vocab_size}. Repeats: {args.repeats} "
        "(plus one warm-up); medians [min–max] over repeats. "
        f"Documents: json_object {len(docs['json_object'])} tokens, "
        f"json_schema {len(docs['json_schema'])} tokens (with EOS).",
        "",
        "Correctness (before timing): every document token allowed and accepted, matcher terminated after EOS, "
        "rollback of 5 tokens and replay, EOS and special tokens masked where they must be, invalid tokens "
        "masked and refused: ok for all four.",
        "",
        "Tokenizer info / compiler, once per tokenizer: "
        + ", ".join(f"{lib.name} {lib.setup_s * 1e3:.0f} ms" for lib in libs)
        + ".",
        "",
        "| library | constraint | compile ms | new matcher ms | 1 seq: fill µs/token median | p99 | first mask µs "
        + "".join(f"| batch 32 fill µs/iter, {t} thread{'s' if t > 1 else ''} " for t in batch_threads)
        + "| batch 32 accept µs/iter |",
        "|---|---|---|---|---|---|---" + "|---" * len(batch_threads) + "|---|",
    ]
    for lib, per_kind in results["results"].items():
        for kind, r in per_kind.items():
            lines.append(
                f"| {lib} | {kind} | {fmt(r['compile'])} | {fmt(r['matcher'])} | {fmt(r['single_median'])} "
                f"| {fmt(r['single_p99'])} | {fmt(r['single_first'])} "
                + "".join(f"| {fmt(r[f'batch_fill_t{t}'])} " for t in batch_threads)
                + f"| {fmt(r['batch_accept'])} |"
            )
    lines += [
        "",
        f"Applying a [32, {(tok.vocab_size + 31) // 32}] bitmask to [32, {tok.vocab_size}] float32 logits on CPU "
        f"(torch threads {args.threads}), µs per call:",
        "",
        "| kernel | µs | first call ms |",
        "|---|---|---|",
    ]
    labels = {
        "xgrammar": "xgrammar.apply_token_bitmask_inplace (C++ CPU kernel)",
        "llguidance": "llguidance.torch.apply_token_bitmask_inplace (torch.compile)",
        "torch": "plain torch: unpack bits + masked_fill_",
    }
    for k, s in results["apply_bitmask_32x49152_us"].items():
        lines.append(f"| {labels[k]} | {fmt(s)} | {results['apply_first_call_ms'][k]:g} |")
    lines += [
        "",
        "Batch fill: xgrammar `BatchGrammarMatcher.batch_fill_next_token_bitmask`, llguidance "
        "`llguidance.torch.fill_next_token_bitmask_par` (`LLExecutor`). Batch accept: "
        "`BatchGrammarMatcher.batch_accept_token` / `consume_token_par` (1 thread).",
    ]
    lines += [
        "",
        "JSON Schema coverage probe: a valid and an invalid instance per keyword, fed token by token "
        "(xgrammar with `strict_mode=False`, the spec's semantics). *ignored* = the invalid instance "
        "passes (silently under-constrained); *error* = the schema is refused at compile time.",
        "",
        "| keyword | " + " | ".join(probe) + " |",
        "|---|" + "---|" * len(probe),
    ]
    lines += [f"| {name} | " + " | ".join(probe[lib][name] for lib in probe) + " |" for name, *_ in FEATURES]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {base}.json / .md")


if __name__ == "__main__":
    main()
