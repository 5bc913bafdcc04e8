"""Constrained decoding: each constrained request's next token is limited to
what its grammar (llguidance; JSON Schema for ``response_format``) allows.

One ``LLTokenizer`` per model, built on the first constrained request (about
0.3 s). A request gets a matcher on its first sampled token; the matcher
advances by the token each iteration samples and is rebuilt from the
request's output when it no longer matches (a matcher is dropped when a
batch names its request among the finished). The mask of every constrained row is filled, then
applied to those rows' logits only (bench/results/grammar_masks-2026-12-01.md:
about 6-10 µs per row to fill on this CPU).
"""

from __future__ import annotations

import llguidance
import llguidance.numpy
import torch

from core.model.tokenizer import Tokenizer
from core.sched.request import Request


class Grammars:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll: llguidance.LLTokenizer | None = None
        self._matchers: dict[str, tuple[Request, llguidance.LLMatcher]] = {}

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

    def _matcher(self, req: Request) -> llguidance.LLMatcher:
        entry = self._matchers.get(req.request_id)
        if entry is not None and entry[0] is req:
            matcher = entry[1]
        else:
            if self._ll is None:
                eos = sorted(self._tokenizer.eos_token_ids)
                self._ll = llguidance.LLTokenizer(self._tokenizer.to_hf_json(), n_vocab=self.vocab_size, eos_token=eos)
            assert req.sampling.grammar is not None
            matcher = llguidance.LLMatcher(self._ll, req.sampling.grammar, log_level=0)
            matcher.consume_tokens(req.output_token_ids)  # a request recomputed after preemption keeps its output
            self._matchers[req.request_id] = (req, matcher)
        return matcher
