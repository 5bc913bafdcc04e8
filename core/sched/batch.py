"""What one iteration runs (Batch), the tokens it produced (NewToken) and
what it did (IterationRecord)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from stallfree.core.sched.handoff import KvImport
from stallfree.core.sched.request import Request


@dataclass(slots=True, frozen=True)
class Item:
    """One request's share of an iteration: tokens [start, start + num_tokens).

    A speculating decode's last ``len(drafts)`` tokens are its draft tokens,
    not yet the request's: the runner feeds them after its last token and
    samples at each of their positions too (``core.sched.drafts``).

    Fixed when scheduled: ``samples`` (the item ends at the request's last
    token, or its drafts, so it yields a new one) does not change when the
    request later grows.
    """

    request: Request  # the runner reads its tokens and block table
    start: int  # tokens already in the KV cache (the chunk's prefix length)
    num_tokens: int
    is_prefill: bool
    drafts: tuple[int, ...] = ()
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        end = self.start + self.num_tokens - len(self.drafts)
        object.__setattr__(self, "samples", end == self.request.num_tokens)

    def token_ids(self) -> list[int]:
        """The tokens it runs: the request's, then its drafts."""
        end = self.start + self.num_tokens - len(self.drafts)
        return self.request.tokens(self.start, end) + list(self.drafts)


@dataclass(slots=True)
class Batch:
    """A flattened ragged batch: decode items first, then prefill chunks, then
    speculating decodes (several query tokens each, like a chunk). The order
    matters to the model runner: it counts the one-token decodes and takes that
    many leading sequences as one query row each (``kernels.attention_meta``).

    Before the items run, the engine has the runner make ``copies`` and
    write ``imports``, and release what it holds for ``finished``."""

    iteration: int
    items: list[Item] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # decodes sent back for KV room (recompute)
    # partial prefills sent back to give their slot to a prompt due earlier (under TTFT targets)
    yielded: list[Request] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, copy) KV blocks
    imports: list[KvImport] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # requests ended since the previous batch
    target_s: float = 0.0  # the TBT target this iteration was sized to (0: none applied)
    predicted_s: float = 0.0  # the cost model's prediction of its time (0: no cost model)
    # why its predicted time may exceed that target: "decodes" (they alone fill it),
    # "floor" (prefill was kept moving at the floor) or "deadlines" (sized to the
    # stretched target while TTFT targets pressed: SchedulerConfig.tbt_stretch); None: sized within it
    over_target: str | None = None
    drafts_declined: int = 0  # decodes with draft tokens proposed that the cost model said would not pay

    def run_over(self, reason: str) -> None:
        """Record why the iteration's predicted time may exceed its target; the first reason stands."""
        self.over_target = self.over_target or reason

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)

    @property
    def decode_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items if not item.is_prefill)

    @property
    def prefill_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items if item.is_prefill)

    @property
    def draft_tokens(self) -> int:
        return sum(len(item.drafts) for item in self.items)

    def shape(self) -> tuple[list[int], list[tuple[int, int]]]:
        """What its time depends on: each decode's context, each chunk's (prefix,
        tokens). A speculating decode counts as a decode per token it verifies
        (its token and each draft, each after the ones before): a row each in
        the GEMMs, the head and the sampler, in the decode regime (no prompt)."""
        decodes = [item.start + i for item in self.items if not item.is_prefill for i in range(item.num_tokens)]
        chunks = [(item.start, item.num_tokens) for item in self.items if item.is_prefill]
        return decodes, chunks


@dataclass(slots=True, frozen=True)
class Logprobs:
    """A sampled token's log-probability under the model's own distribution
    (before temperature, penalties and bias), and the most likely tokens'."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


@dataclass(slots=True)
class Sampled:
    """What the runner returns, per item that samples, in item order: the tokens
    it yields (one, or a speculating decode's kept drafts and the token after
    them: ``core.sched.drafts.verified``), with their logprobs where the
    request asked for them."""

    tokens: list[list[int]]
    logprobs: list[list[Logprobs] | None] | None = None  # None: nobody in the batch asked

    def per_item(self, items: list[Item]) -> Iterator[tuple[Item, list[int], list[Logprobs] | None]]:
        """Each item with the tokens it yielded and their logprobs (none for an item that does not sample)."""
        tokens = iter(self.tokens)
        logprobs = iter(self.logprobs) if self.logprobs is not None else None
        for item in items:
            if item.samples:
                yield item, next(tokens), next(logprobs) if logprobs is not None else None
            else:
                yield item, [], None


@dataclass(slots=True, frozen=True)
class NewToken:
    """A token an iteration produced for a request (``Scheduler.update``)."""

    request: Request
    token: int
    stalled: bool  # the gap before it was stalled: another request's prefill ran in it
    logprobs: Logprobs | None = None
    draft: bool = False  # a draft token the model kept (speculative decoding)


@dataclass(slots=True)
class IterationRecord:
    """One iteration as it happened; the dashboard, metrics and simulator read it."""

    iteration: int
    start_ns: int
    end_ns: int
    decode_tokens: int
    prefill_tokens: int
    chunks: dict[str, int]  # request id -> prefill tokens in this iteration
    request_ids: list[str]  # every request this iteration served
    token_budget: int
    chunking: str
    num_running: int
    num_waiting: int
    num_partial_prefills: int
    kv_used_blocks: int
    kv_free_blocks: int
    kv_cached_blocks: int
    preemptions: int
    draft_tokens: int = 0  # draft tokens verified (in decode_tokens)
    accepted_tokens: int = 0  # of them, kept
    drafts_declined: int = 0  # decodes whose drafts the cost model said would not pay
    tbt_slo_ms: float = 0.0  # the TBT target setting (it sized this iteration if it had decodes)
    tbt_aim: float = 1.0  # the fraction of the target the scheduler sized to (Scheduler.aim)
    predicted_ns: int = 0  # the cost model's prediction of its duration (0: no cost model)
    # what beside the token counts the prediction reads (Batch.shape): the
    # decodes' cached tokens and the chunks' cached prefixes, summed
    decode_context_tokens: int = 0
    chunk_prefix_tokens: int = 0
    correction: float = 1.0  # measured / fitted time the cost model has learnt for iterations of its kind
    # it had decodes and ran over the TBT target, and why: "decodes", "floor" (see
    # Batch.over_target) or "prediction" (sized within the target, measured over it)
    target_missed: str | None = None
    # The step thread over its ``Engine.step`` call (``StepLoop``; 0 where no
    # thread of its own ran it, as in the simulator): where an iteration ran
    # long, whether the thread computed all along (CPU time near the duration)
    # or lost the core (preempted: the scheduler gave it to another thread;
    # waits: it blocked, on the interpreter lock or a lock of its own), and
    # the page faults it took (memory first touched, or given back and taken
    # again); and the garbage collector's time in it, whichever thread collected.
    thread_cpu_ns: int = 0
    thread_preempted: int = 0
    thread_waits: int = 0
    page_faults: int = 0
    collector_ns: int = 0

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns
