"""Constrained decoding: each constrained request's next token is limited to
what its grammar (llguidance; JSON Schema for ``response_format``) allows.

One ``LLTokenizer`` per model (0.3-0.5 s, holding the interpreter lock the
whole time, so every stream stalls while it is built): the server builds it
at start-up (``warm``), elsewhere the first constrained request does. A
request's matcher is compiled in a worker thread from the iteration that
runs its first chunk (``prepare``; llguidance releases the lock while it
compiles, 13-20 ms for a schema of 300 patterned properties), so it overlaps
the forward pass instead of adding to the step; its first sampled token
waits for it only if it is not ready by then. The matcher advances by the
token each iteration samples and is rebuilt from the request's output when
it no longer matches (a matcher is dropped when a batch names its request
among the finished). The mask of every constrained row is filled, then
applied to those rows' logits only (bench/results/grammar_masks-2026-12-01.md:
about 6-10 µs per row to fill on this CPU).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy
import torch

from stallfree.core.model.tokenizer import Tokenizer
from stallfree.core.sched.request import Request


class Grammars:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll: llguidance.LLTokenizer | None = None
        self._matchers: dict[str, tuple[Request, llguidance.LLMatcher]] = {}
        self._compiling: dict[str, tuple[Request, Future[llguidance.LLMatcher]]] = {}
        self._compiler: ThreadPoolExecutor | None = None

    def warm(self) -> None:
        """Build the LLTokenizer now (a server does at start-up), not on the first constrained request."""
        self._ll_tokenizer()

    def prepare(self, requests: list[Request]) -> None:
        """Start compiling the matchers of these constrained requests (those
        without one), to be ready by their first sampled token."""
        for req in requests:
            if req.request_id in self._matchers or req.request_id in self._compiling:
                continue
            if self._compiler is None:
                self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar")
            ll = self._ll_tokenizer()
            assert req.sampling.grammar is not None
            self._compiling[req.request_id] = (req, self._compiler.submit(_compile, ll, req.sampling.grammar))

    def mask(self, logits: torch.Tensor, constrained: list[tuple[int, Request, tuple[int, ...]]]) -> None:
        """Set to -inf every token a request's grammar forbids, in its rows of
        logits: (first row, request, drafts). A request with drafts has a row
        per draft position: each row is masked for the grammar's state after
        the drafts before it, as far as the grammar allows them (the rows after
        a draft it forbids are never kept: that draft's row cannot draw it)."""
        plan = []  # (logits row, matcher, drafts to consume before it)
        for first, req, drafts in constrained:
            matcher = self._matcher(req)
            allowed = matcher.validate_tokens(list(drafts)) if drafts else 0
            plan += [(first + i, matcher, drafts[:i]) for i in range(allowed + 1)]
        bitmask = llguidance.numpy.allocate_token_bitmask(len(plan), self.vocab_size)
        for j, (_, matcher, before) in enumerate(plan):
            if before:
                matcher.consume_token(before[-1])
            llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, j)
            if before and (j + 1 == len(plan) or plan[j + 1][1] is not matcher):
                matcher.rollback(len(before))  # back to the request's own tokens
        bits = torch.arange(32, dtype=torch.int32)
        words = torch.from_numpy(bitmask)
        allowed_tokens = ((words[:, :, None] >> bits) & 1).bool().view(len(plan), -1)[:, : self.vocab_size]
        index = torch.tensor([row for row, _, _ in plan], device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed_tokens.to(logits.device), float("-inf"))

    def advance(self, requests: list[Request], tokens: list[list[int]]) -> None:
        """Each request drew these tokens (allowed by its masks)."""
        for req, new in zip(requests, tokens, strict=True):
            matcher = self._matchers[req.request_id][1]
            for token in new:
                matcher.consume_token(token)

    def release(self, request_ids: list[str]) -> None:
        """Ended requests' matchers."""
        for rid in request_ids:
            self._matchers.pop(rid, None)
            self._compiling.pop(rid, None)

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll is None:
            eos = sorted(self._tokenizer.eos_token_ids)
            self._ll = llguidance.LLTokenizer(self._tokenizer.to_hf_json(), n_vocab=self.vocab_size, eos_token=eos)
        return self._ll

    def _matcher(self, req: Request) -> llguidance.LLMatcher:
        entry = self._matchers.get(req.request_id)
        if entry is not None and entry[0] is req:
            matcher = entry[1]
        else:
            compiling = self._compiling.pop(req.request_id, None)
            if compiling is not None and compiling[0] is req:
                matcher = compiling[1].result()
            else:
                assert req.sampling.grammar is not None
                matcher = _compile(self._ll_tokenizer(), req.sampling.grammar)
            matcher.consume_tokens(req.output_token_ids)  # a request recomputed after preemption keeps its output
            self._matchers[req.request_id] = (req, matcher)
        return matcher


def _compile(ll: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    return llguidance.LLMatcher(ll, grammar, log_level=0)
