"""Workloads: what a load run sends and when. A ``Arrival`` is one request to
send at ``at_s``; prompts of a given token length (``PromptMaker``), trace
prompts of exact token lengths (``WordPrompts``: made of words that are one
token each, and runs the trace marks as shared, Mooncake's equal hash ids, are
equal words, so a prefix cache sees the trace's sharing), length and arrival
patterns, and the interference scenario.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass

from stallfree.core.analysis.traces import TraceRequest, prompt_ids
from stallfree.core.model.tokenizer import Tokenizer

WORDS = (
    "the",
    "report",
    "river",
    "market",
    "engine",
    "signal",
    "window",
    "garden",
    "history",
    "science",
    "music",
    "table",
    "number",
    "system",
    "question",
    "answer",
    "city",
    "morning",
    "winter",
    "light",
    "paper",
    "story",
    "machine",
    "network",
    "ocean",
    "mountain",
    "value",
    "model",
    "energy",
    "memory",
    "forest",
    "budget",
    "token",
    "planet",
    "school",
    "office",
    "kitchen",
    "letter",
    "bridge",
    "station",
    "theory",
)


@dataclass(slots=True)
class Arrival:
    at_s: float
    prompt: str
    max_tokens: int
    group: str = "request"  # e.g. decoder / long, for the interference scenario
    prompt_tokens: int | None = None  # its exact length, where the workload fixes it (traces)


class PromptMaker:
    """Prompts of a given token length for this tokenizer, each with a unique start
    (so no prefix cache serves them, not even from an earlier run with the same
    seed: the seed fixes lengths and words, a per-instance nonce the start)."""

    def __init__(self, tokenizer: Tokenizer, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.nonce = os.urandom(4).hex()
        self.n = 0

    def __call__(self, tokens: int) -> str:
        self.n += 1
        words = [f"Request {self.nonce}-{self.n}:"]
        words += self.rng.choices(WORDS, k=tokens + 8)
        ids = self.tokenizer.encode(" ".join(words))[: max(1, tokens)]
        return self.tokenizer.decode(ids)


def prompt_lengths(spec: str, n: int, rng: random.Random) -> list[int]:
    """fixed:N | uniform:A-B | longtail (most short, a few long, like chat traffic)."""
    kind, _, arg = spec.partition(":")
    if kind == "fixed":
        return [int(arg)] * n
    if kind == "uniform":
        low, high = (int(x) for x in arg.split("-"))
        return [rng.randint(low, high) for _ in range(n)]
    if kind == "longtail":
        return [
            rng.choice([rng.randint(32, 256)] * 16 + [rng.randint(512, 1024)] * 3 + [rng.randint(2000, 3000)])
            for _ in range(n)
        ]
    raise ValueError(f"prompt length spec {spec!r}: fixed:N, uniform:A-B or longtail")


def arrivals(kind: str, n: int, rate: float, rng: random.Random) -> list[float]:
    """poisson (rate per second) or burst (all at once)."""
    if kind == "burst":
        return [0.0] * n
    if kind == "poisson":
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.expovariate(rate)
        return out
    raise ValueError(f"arrival pattern {kind!r}: poisson or burst")


class WordPrompts:
    """Trace prompts of exact token lengths for a byte-level BPE tokenizer.

    Its words that are one token with their leading space (`` river``) stay
    one token beside each other (the pre-tokenizer splits before spaces), so
    a prompt of n such words is n tokens. A trace request's shared runs are
    drawn from their keys: equal keys, equal words, equal tokens. The seed
    and a per-instance nonce fix the words: a second run shares nothing with
    an earlier one (its prefix cache starts cold), as with ``PromptMaker``.
    """

    def __init__(self, tokenizer: Tokenizer, seed: int = 0) -> None:
        word = re.compile(rb" [a-z]{3,10}")
        self.words = [
            b.decode()
            for i, b in enumerate(tokenizer.token_bytes)
            if word.fullmatch(b) and tokenizer.encode(b.decode()) == [i]
        ]
        if len(self.words) < 1000:
            raise ValueError("this tokenizer has too few one-token words for exact-length prompts")
        self.seed = f"{seed}/{os.urandom(4).hex()}"
        self._runs: dict[str, list[int]] = {}

    def __call__(self, r: TraceRequest) -> str:
        ids = prompt_ids(r, self.seed, len(self.words), low=0, blocks=self._runs)
        return "".join(self.words[i] for i in ids)


def trace_jobs(requests: list[TraceRequest], prompts: WordPrompts) -> list[Arrival]:
    """A replayed trace window (``core.analysis.traces.replay``) as jobs of exact lengths."""
    return [Arrival(r.at_s, prompts(r), r.output_tokens, prompt_tokens=r.prompt_tokens) for r in requests]


def interference_jobs(
    make: PromptMaker, streams: int, long_prompts: int, long_tokens: int, delay_s: float, decode_tokens: int
) -> list[Arrival]:
    """N streams decoding, then long prompts arriving while they run."""
    jobs = [Arrival(0.0, make(32), decode_tokens, "decoder") for _ in range(streams)]
    jobs += [Arrival(delay_s, make(long_tokens), 8, "long") for _ in range(long_prompts)]
    return jobs
