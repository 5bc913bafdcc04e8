"""Scheduler and KV-cache settings, and the one place they are checked.

``SchedulerConfig`` is frozen: a live change (``PUT /api/config``) builds a
new one on the step thread, so no other thread ever sees one half-changed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Chunking(StrEnum):
    """How an iteration's batch mixes prefill with decodes (see ``SchedulerConfig``)."""

    STALL_FREE = "stall_free"
    NONE = "none"
    DECODE_FIRST = "decode_first"


class Policy(StrEnum):
    """Which waiting prompt is admitted next (``core.sched.policy``)."""

    FCFS = "fcfs"
    SJF = "sjf"
    LPM = "lpm"
    PRIORITY = "priority"
    FAIR = "fair"


class Speculate(StrEnum):
    """Where draft tokens come from (``core.sched.drafts``)."""

    OFF = "off"
    NGRAM = "ngram"  # prompt lookup: what followed the request's latest n-gram earlier in its own tokens


CHUNKING_MODES = tuple(c.value for c in Chunking)
POLICIES = tuple(p.value for p in Policy)
SPECULATE_MODES = tuple(s.value for s in Speculate)

# Settings the step thread may change between iterations (PUT /api/config).
LIVE_SETTINGS = (
    "chunking",
    "token_budget",
    "policy",
    "max_partial_prefills",
    "dynamic_chunking",
    "max_defer_s",
    "long_prefill_tokens",
    "tbt_slo_ms",
    "ttft_slo_ms",
    "ttft_reserve",
    "tbt_stretch",
    "speculate",
    "draft_tokens",
    "ngram_min",
    "ngram_max",
)


# setting -> (type, low, high) for numbers; (str, allowed values, None); (bool, None, None)
RANGES: dict[str, tuple[type, Any, Any]] = {
    "token_budget": (int, 1, 1 << 20),
    "max_num_seqs": (int, 1, 4096),
    "max_partial_prefills": (int, 1, 4096),
    "max_model_len": (int, 1, 1 << 24),
    "chunking": (str, CHUNKING_MODES, None),
    "policy": (str, POLICIES, None),
    "max_defer_s": (float, 0.001, 86400.0),
    "dynamic_chunking": (bool, None, None),
    "decode_reserve_tokens": (int, 0, 1 << 20),
    "long_prefill_tokens": (int, 0, 1 << 24),
    "tbt_slo_ms": (float, 0.0, 600_000.0),
    "ttft_slo_ms": (float, 0.0, 600_000.0),
    "ttft_reserve": (float, 0.0, 0.95),
    "tbt_stretch": (float, 1.0, 10.0),
    "speculate": (str, SPECULATE_MODES, None),
    "draft_tokens": (int, 1, 16),
    "ngram_min": (int, 1, 16),
    "ngram_max": (int, 1, 16),
}


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """How each iteration's batch is formed.

    chunking:
      ``stall_free``   Sarathi-Serve: decodes, then partial prefills, then new
                       prompts, all inside ``token_budget``.
      ``none``         vLLM-V0 prefill-first: waiting prompts run whole in an
                       iteration of their own while decodes wait.
      ``decode_first`` FasterTransformer-style: new prompts wait until no
                       request is decoding.

    tbt_slo_ms: a time target for the gap between a decode's tokens. While an
    iteration holds decodes, its prefill tokens are the most whose predicted
    time (the cost model: the decodes with their contexts, each chunk with its
    prefix) stays within it, down to ``prefill_floor`` tokens; with no decode
    it takes the whole ``token_budget``. 0: off (tokens only).

    ttft_slo_ms: a time target for a request's first token (a request may
    bring its own). Waiting and partly prefilled prompts are ordered by their
    deadlines and slack (``core.sched.deadline``): within each policy's
    classes (priority, tenant) a prompt whose slack says it can no longer meet
    its target goes after those that still can, and among those the nearest
    deadline goes first; the starvation ceiling still puts any prompt waiting
    past ``max_defer_s`` first. 0: off (arrival order).

    ttft_reserve: with TTFT targets, the share of each target kept in hand.
    While every queued prompt has a target and can still meet it, an
    iteration's prefill takes only the tokens that finish each prompt (in
    deadline order) by its deadline less that share of its target
    (``core.sched.deadline.tokens_needed``), so iterations run below the TBT
    target and decodes' gaps have room; as deadlines near, chunks grow back
    to what the TBT target allows. 0: off (prefill as fast as the TBT target
    and the budget allow).

    tbt_stretch: with a TBT target and TTFT targets, how far past the TBT
    target an iteration may grow while the TTFT targets press: while a queued
    prompt would miss its TTFT target at the pace the TBT target allows (or
    already has), chunks are sized to ``tbt_stretch`` x the target instead
    (``Batch.over_target``: "deadlines"), so a backlog of prompts clears in
    fewer, larger iterations. 1: the TBT target holds whatever the queue.
    serve's derived targets come with 1.5 (``core.analysis.targets``).

    speculate: ``ngram`` verifies up to ``draft_tokens`` draft tokens per
    decode (prompt lookup, ``ngram_min``..``ngram_max`` tokens matched) in the
    decode's own pass. Drafts take only what the batch leaves once every
    decode has its token and every prefill its chunk (budget and TBT target
    alike), and only where the cost model says they pay (``Scheduler``).
    """

    token_budget: int = 512
    max_num_seqs: int = 64
    max_partial_prefills: int = 2
    max_model_len: int = 8192
    chunking: Chunking = Chunking.STALL_FREE
    policy: Policy = Policy.FCFS
    max_defer_s: float = 30.0
    dynamic_chunking: bool = False
    # KV admission reserves room for this many generated tokens (at most
    # max_tokens) beyond the prompt, so admitted prompts can start decoding
    # without preempting anybody.
    decode_reserve_tokens: int = 64
    # A prompt with more tokens than this still to prefill is "long": short
    # prompts' chunks go first, a quarter of the leftover budget stays with the
    # long ones. 0: what one iteration can take (the token budget, or under a
    # TBT target the tokens that fit it); at least the context length: off.
    long_prefill_tokens: int = 0
    tbt_slo_ms: float = 0.0
    ttft_slo_ms: float = 0.0
    ttft_reserve: float = 0.0
    tbt_stretch: float = 1.0
    speculate: Speculate = Speculate.OFF
    draft_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4

    @property
    def prefill_floor(self) -> int:
        """Prefill tokens an iteration keeps for waiting prompts however many
        decodes run: the budget's headroom over ``max_num_seqs``, and the least
        a TBT target leaves when the decodes alone fill it (the article's
        warning: a budget of 256 with 256 decoders starves new prompts)."""
        return max(16, self.max_num_seqs // 4)

    @property
    def min_token_budget(self) -> int:
        """Every decode gets a token and prefill still gets a real share."""
        return self.max_num_seqs + self.prefill_floor

    def validated(self) -> tuple[SchedulerConfig, list[str]]:
        """Return a checked copy (budget clamped up if too small) and warnings.

        Raises ValueError naming the field for values that cannot be repaired:
        each setting has one type and a finite range (``RANGES``). Mode and
        policy given as strings come back as their enums.
        """
        for name, (kind, low, high) in RANGES.items():
            value = getattr(self, name)
            if kind is bool:
                if not isinstance(value, bool):
                    raise ValueError(f"{name} must be true or false")
            elif kind is str:
                if value not in low:
                    raise ValueError(f"{name} must be one of {', '.join(low)}")
            else:
                numeric = isinstance(value, int) or (kind is float and isinstance(value, float))
                if isinstance(value, bool) or not numeric or not math.isfinite(value) or not low <= value <= high:
                    what = "an integer" if kind is int else "a number"
                    raise ValueError(f"{name} must be {what} in [{low}, {high}]")
        if self.ngram_min > self.ngram_max:
            raise ValueError("ngram_min must be at most ngram_max")
        warnings = []
        budget = self.token_budget
        if budget < self.min_token_budget:
            warnings.append(
                f"token_budget {budget} leaves no prefill headroom over "
                f"max_num_seqs {self.max_num_seqs}; clamped to {self.min_token_budget}"
            )
            budget = self.min_token_budget
        checked = dataclasses.replace(
            self,
            token_budget=budget,
            chunking=Chunking(self.chunking),
            policy=Policy(self.policy),
            speculate=Speculate(self.speculate),
        )
        return checked, warnings

    def with_changes(self, changes: dict[str, Any]) -> tuple[SchedulerConfig, list[str]]:
        """Apply live changes (only LIVE_SETTINGS) and validate the result."""
        unknown = set(changes) - set(LIVE_SETTINGS)
        if unknown:  # not named back: a name is the caller's input, of any size
            live = ", ".join(LIVE_SETTINGS)
            raise ValueError(f"{len(unknown)} setting(s) cannot be changed at runtime; the live settings: {live}")
        return dataclasses.replace(self, **changes).validated()


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache geometry."""

    num_blocks: int = 4096
    block_size: int = 16
    enable_prefix_caching: bool = True

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size
