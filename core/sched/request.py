"""One request's state: its tokens, its place in the state machine, its timestamps.

A request's progress is one number, ``num_computed_tokens``: how many of its
tokens (prompt, then generated) have their KV in the cache. Prefill, chunked
prefill, decode and recompute after preemption are all "catch up to
``num_tokens``"; the status says which pass of the scheduler serves it.
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, field
from enum import StrEnum

from stallfree.core.sched.handoff import KvHandoff

MAX_LOGPROBS = 20  # alternatives per token, OpenAI's limit


class RequestStatus(StrEnum):
    WAITING = "waiting"  # queued, or preempted and queued again for recompute
    PREFILLING = "prefilling"  # admitted; prompt (or recompute) only partly in the KV cache
    DECODING = "decoding"  # prompt done; one new token per iteration
    FINISHED = "finished"  # ended; ``Request.finish_reason`` says why


class FinishReason(StrEnum):
    """Why a request ended: the one vocabulary of engine, metrics, logs and
    spans. The gateway maps it to each API's wire strings in one place."""

    STOP = "stop"  # sampled a stop token (or the gateway matched a stop string)
    LENGTH = "length"  # reached max_tokens or the context limit
    ABORT = "abort"  # cancelled by the client or the gateway
    ERROR = "error"  # an iteration holding it failed, or the engine stopped
    SLOW_CONSUMER = "slow_consumer"  # the gateway cut it off: its client read too slowly


MIN_TEMPERATURE = 1e-4  # temperatures below it sample greedily (0 included)


@dataclass(slots=True)
class SamplingParams:
    """What the caller asked for; validated before a request reaches the engine."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # OpenAI's penalties on the tokens generated so far: subtract presence once
    # per token seen, frequency once per occurrence
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (and HF's): logits of tokens in the prompt or the output are
    # divided by it when positive, multiplied when negative
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    logprobs: int | None = None  # return each token's log-probability and this many alternatives
    grammar: str | None = None  # llguidance grammar the output must follow (response_format)
    speculate: bool = True  # may it get draft tokens when the engine speculates (an opt-out)

    @property
    def greedy(self) -> bool:
        """Below MIN_TEMPERATURE the draw is the argmax: logits / 1e-38 overflow
        to inf and the softmax to NaN (it drew '66666666'), and long before
        that the distribution is one-hot to float precision."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def argmax_only(self) -> bool:
        """Is the argmax of the raw logits all this request's sampling reads?
        (Greedy, nothing that moves the logits first, no logprobs.)"""
        return (
            self.greedy
            and not self.logit_bias
            and not self.uses_history
            and self.logprobs is None
            and self.grammar is None
        )

    @property
    def uses_history(self) -> bool:
        """Does sampling need the tokens this request has seen (penalties)?"""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError("max_tokens must be an integer >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError("temperature must be a finite number >= 0")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError("top_p must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError("top_k must be an integer >= 0 (0 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (math.isfinite(getattr(self, name)) and -2 <= getattr(self, name) <= 2):
                raise ValueError(f"{name} must be in [-2, 2]")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10):
            raise ValueError("repetition_penalty must be in (0, 10]")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError("min_p must be in [0, 1]")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}]")
        if any(not (math.isfinite(b) and -100 <= b <= 100) for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")


@dataclass(slots=True)
class Chunk:
    """One slice of a prefill (or recompute) processed in one iteration."""

    iteration: int
    start_ns: int
    end_ns: int
    tokens: int
    prefix_len: int  # tokens already in the KV cache when the chunk ran


@dataclass(slots=True)
class Timeline:
    """Monotonic timestamps (perf_counter_ns) of one request's life.

    Every interval reported anywhere (spans, metrics, done frames) is a
    difference of these; see ``core.sched.timings.request_timings``.
    """

    arrival_ns: int
    scheduled_ns: int | None = None  # first time any of its tokens ran
    first_token_ns: int | None = None
    finished_ns: int | None = None
    chunks: list[Chunk] = field(default_factory=list)
    token_ns: list[int] = field(default_factory=list)  # one per generated token
    # per inter-token gap: was it stalled, i.e. did another request's prefill
    # chunk run between the two tokens?
    stalled: list[bool] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival: InitVar[int]  # perf_counter_ns; kept once, in the timeline (``arrival_ns``)
    priority: int = 0  # lower runs earlier, as in vLLM
    tenant: str = ""  # who pays: the API key's id (the fair policy shares the engine between tenants)
    # the prefix cache's scope: prompts hit only blocks cached under the same salt
    # (the gateway sets the tenant unless GatewaySettings.share_prefix_cache)
    cache_salt: str = ""
    # another choice of the same prompt (OpenAI's n > 1): admitted once that one's
    # prompt is computed, onto its blocks (BlockManager.share), not computing it again
    prefill_after: str | None = None
    handoff: KvHandoff | None = None  # disaggregated prefill (core.sched.handoff)
    # its TTFT target (ms; 0: none); None: the server's, set when the scheduler takes it
    ttft_slo_ms: float | None = None
    tbt_slo_ms: float = 0.0  # the server's TBT target when the scheduler took it (its goodness is judged by it)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None  # set when status becomes FINISHED
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # draft tokens verified for it (speculative decoding)
    num_accepted_tokens: int = 0  # of them, kept by the model
    # KV state, owned by the BlockManager
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    footprint_blocks: int = 0  # blocks reserved at admission: prompt + decode reserve
    last_token_iteration: int = 0  # iteration that produced the latest token
    timeline: Timeline = field(init=False)

    def __post_init__(self, arrival: int) -> None:
        self.timeline = Timeline(arrival_ns=arrival)

    @property
    def arrival_ns(self) -> int:
        return self.timeline.arrival_ns

    @property
    def imported_tokens(self) -> int:
        """Tokens whose KV arrived from another engine (0: none)."""
        return self.handoff.imported_tokens if self.handoff is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids in positions [start, end) of prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def end(self) -> RequestEnd:
        """What the gateway needs of it once it has ended (``finish_reason`` set)."""
        assert self.finish_reason is not None, "ended"
        return RequestEnd(
            self.finish_reason,
            self.timeline,
            self.num_output_tokens,
            self.num_cached_tokens,
            self.num_preemptions,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            self.ttft_slo_ms or 0.0,
            self.tbt_slo_ms,
        )


@dataclass(slots=True, frozen=True)
class RequestEnd:
    """A request's end as the engine reports it: why it ended and what the
    engine learnt of it on the way. The gateway has the rest (what it sent,
    the tokens it was given), so nothing else crosses back."""

    reason: FinishReason
    timeline: Timeline
    num_output_tokens: int
    num_cached_tokens: int  # prefix-cache hit at first admission
    num_preemptions: int
    num_draft_tokens: int
    num_accepted_tokens: int
    ttft_slo_ms: float  # the targets the scheduler held it to (0: none)
    tbt_slo_ms: float
