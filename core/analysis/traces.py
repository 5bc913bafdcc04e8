"""Request traces: production logs read into one shape, and scaled for replay.

Three formats, told apart by the file:

- ``.csv`` with ``TIMESTAMP,ContextTokens,GeneratedTokens``: the Azure LLM
  inference trace 2023 (Splitwise); every prompt unique.
- ``.jsonl`` rows with ``timestamp`` (ms), ``input_length``, ``output_length``
  and ``hash_ids``: Mooncake's trace; one hash id per 512-token block of the
  prompt, equal ids meaning equal blocks (shared prefixes).
- ``.jsonl`` rows with ``t`` (s), ``prompt_tokens``, ``output_tokens`` and
  optionally ``prefix`` and ``prefix_tokens`` (requests naming one prefix
  share those tokens), ``id``, ``priority``: stallfree's own.

Sharing is kept as ``shared`` runs at the start of a prompt, each a key and a
length: prompts are built so that equal keys give equal tokens, and the
prefix cache sees the trace's real sharing. ``replay`` takes a window and
scales its rate and lengths; ``prompt_ids`` builds a prompt's token ids.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import itertools
import random
from dataclasses import dataclass
from pathlib import Path

import orjson

MOONCAKE_BLOCK = 512  # tokens per hash id in Mooncake's trace


@dataclass(slots=True, frozen=True)
class TraceRequest:
    at_s: float  # arrival, seconds from the trace's (or window's) first request
    prompt_tokens: int
    output_tokens: int
    # runs of prompt tokens that other requests share, from the start: (key, tokens); equal keys, equal tokens
    shared: tuple[tuple[str, int], ...] = ()
    request_id: str = ""
    priority: int = 0


@dataclass(slots=True, frozen=True)
class Replay:
    """Which part of a trace to replay, and how scaled."""

    start: int = 0  # first row of the window
    count: int | None = None  # rows in the window (None: to the end)
    rate: float | None = None  # mean arrival rate to replay the window at, requests/s (rescales every gap)
    time_scale: float = 1.0  # or: multiply every gap by this
    length_scale: float = 1.0  # multiply prompt, output and shared-run lengths
    max_context: int | None = None  # cap prompt + output: the output to half of it, then the prompt to the rest
    # requests logged at one time are spread evenly up to the next logged time: a
    # trace on a coarse clock (Mooncake's: a 3 s grid, ~10 requests a tick) would
    # otherwise replay its ticks as bursts its traffic never had
    spread_ties: bool = True
    max_output: int | None = None  # cap each output (scaled) at this: a prefill-heavy workload from a trace

    def describe(self) -> str:
        end = "end" if self.count is None else self.start + self.count
        pace = f"{self.rate:g} req/s" if self.rate is not None else f"time x{self.time_scale:g}"
        cap = f", context cap {self.max_context}" if self.max_context else ""
        cap += f", outputs capped at {self.max_output}" if self.max_output else ""
        ties = ", equal arrival times spread to the next" if self.spread_ties else ""
        return f"rows {self.start}-{end}, {pace}, lengths x{self.length_scale:g}{cap}{ties}"


def read_trace(path: Path) -> list[TraceRequest]:
    """Every request of a trace file, arrivals from its first one; errors name the line."""
    if path.suffix == ".csv":
        return _read_azure(path)
    requests = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
            requests.append(_mooncake_row(row, lineno) if "hash_ids" in row else _own_row(row, lineno))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{path}:{lineno}: bad trace line ({exc!r})") from None
        r = requests[-1]
        if r.at_s < 0 or r.prompt_tokens < 1 or r.output_tokens < 1:
            raise ValueError(f"{path}:{lineno}: the arrival must be >= 0, prompt and output lengths >= 1")
    return _from_first(requests)


def _read_azure(path: Path) -> list[TraceRequest]:
    requests = []
    with path.open(newline="") as f:
        for lineno, row in enumerate(csv.DictReader(f), 2):
            try:
                at = dt.datetime.fromisoformat(row["TIMESTAMP"]).timestamp()
                prompt, output = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: bad trace row ({exc!r})") from None
            if prompt < 1 or output < 1:
                continue  # a request that generated nothing (a handful in the trace) cannot be streamed
            requests.append(TraceRequest(at, prompt, output, request_id=f"a{lineno}"))
    return _from_first(requests)


def _mooncake_row(row: dict, lineno: int) -> TraceRequest:
    prompt = int(row["input_length"])
    shared, left = [], prompt
    for hid in row["hash_ids"]:
        if left <= 0:
            break
        shared.append((f"b{int(hid)}", min(MOONCAKE_BLOCK, left)))
        left -= shared[-1][1]
    return TraceRequest(float(row["timestamp"]) / 1e3, prompt, int(row["output_length"]), tuple(shared), f"m{lineno}")


def _own_row(row: dict, lineno: int) -> TraceRequest:
    prompt, prefix = int(row["prompt_tokens"]), row.get("prefix")
    shared = ((f"p:{prefix}", min(int(row.get("prefix_tokens", 0)), prompt)),) if prefix else ()
    rid = str(row.get("id", f"r{lineno}"))
    return TraceRequest(float(row["t"]), prompt, int(row["output_tokens"]), shared, rid, int(row.get("priority", 0)))


def _from_first(requests: list[TraceRequest]) -> list[TraceRequest]:
    t0 = min((r.at_s for r in requests), default=0.0)
    return [dataclasses.replace(r, at_s=r.at_s - t0) for r in requests]


def replay(requests: list[TraceRequest], how: Replay) -> list[TraceRequest]:
    """The window of ``how``, arrivals from its first request, at its rate and lengths."""
    if how.start < 0 or (how.count is not None and how.count < 1):
        raise ValueError("the window must start at a row >= 0 and hold at least one")
    for name in ("time_scale", "length_scale", "rate", "max_output"):
        value = getattr(how, name)
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0")
    rows = requests[how.start : None if how.count is None else how.start + how.count]
    if not rows:
        raise ValueError(f"the window starts at row {how.start}; the trace has {len(requests)}")
    rows = sorted(_from_first(rows), key=lambda r: r.at_s)
    if how.spread_ties:
        rows = _spread_ties(rows)
    factor = how.time_scale
    span = rows[-1].at_s
    if how.rate is not None:
        if len(rows) < 2 or span <= 0:
            raise ValueError("a rate needs a window of at least two requests apart in time")
        factor = (len(rows) - 1) / span / how.rate
    return [_scaled(r, factor, how) for r in rows]


def _spread_ties(rows: list[TraceRequest]) -> list[TraceRequest]:
    """Requests sharing an arrival time, evenly over the time to the next one
    (the last group over the gap before it)."""
    times = sorted({r.at_s for r in rows})
    if len(times) == len(rows) or len(times) < 2:
        return rows
    after = dict(itertools.pairwise(times))
    after[times[-1]] = times[-1] + (times[-1] - times[-2])
    groups: dict[float, list[TraceRequest]] = {}
    for r in rows:
        groups.setdefault(r.at_s, []).append(r)
    spread = []
    for t, group in groups.items():
        step = (after[t] - t) / len(group)
        spread += [dataclasses.replace(r, at_s=t + i * step) for i, r in enumerate(group)]
    return spread


def _scaled(r: TraceRequest, factor: float, how: Replay) -> TraceRequest:
    s = how.length_scale

    def length(n: int) -> int:
        return max(1, round(n * s))

    output = length(r.output_tokens)
    if how.max_output:
        output = min(output, how.max_output)
    # shared runs scale alike wherever they occur, so equal keys keep equal lengths
    shared = [(key, length(n)) for key, n in r.shared]
    prompt = length(r.prompt_tokens) if not shared or sum(n for _, n in r.shared) < r.prompt_tokens else 0
    prompt = max(prompt, sum(n for _, n in shared))
    if how.max_context:
        output = min(output, max(1, how.max_context // 2))
        prompt = min(prompt, how.max_context - output)
    kept, room = [], prompt
    for key, n in shared:
        if n > room:
            break
        kept.append((key, n))
        room -= n
    return dataclasses.replace(r, at_s=r.at_s * factor, prompt_tokens=prompt, output_tokens=output, shared=tuple(kept))


def prompt_ids(
    r: TraceRequest, seed: object, vocab: int, low: int = 17, blocks: dict[str, list[int]] | None = None
) -> list[int]:
    """r's prompt as token ids in [low, vocab): each shared run drawn from its key
    (and ``seed``), so equal keys give equal tokens; the rest unique to the
    request. ``blocks`` caches the shared runs across calls (a long trace
    repeats them)."""
    population = range(low, vocab)
    ids: list[int] = []
    for key, n in r.shared:
        run = blocks.get(key) if blocks is not None else None
        if run is None or len(run) < n:  # choices() of a prefix is a prefix of choices()
            run = random.Random(f"{seed}/{key}").choices(population, k=n)
            if blocks is not None:
                blocks[key] = run
        ids += run[:n]
    rest = r.prompt_tokens - len(ids)
    ids += random.Random(f"{seed}/request/{r.request_id}/{r.at_s}").choices(population, k=rest)
    return ids
