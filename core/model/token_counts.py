"""What each request has seen, as rows of device tensors, for the penalties.

A request that uses penalties gets a row: its generated tokens counted per
vocabulary entry, and which tokens its prompt holds. A row is built once
(one scatter over the request's tokens) and then advanced by one scatter per
iteration for the whole batch, so sampling never loops over a request's
history. A row whose count no longer matches its request (a request
recomputed after preemption, or one evicted to make room) is rebuilt.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from stallfree.core.sched.request import Request


class TokenCounts:
    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 64) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.output = torch.zeros(capacity, vocab_size, device=device)  # occurrences of each generated token
        self.in_prompt = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=device)
        self._row_of: OrderedDict[str, int] = OrderedDict()  # request id -> row, least recently used first
        self._counted = [0] * capacity  # generated tokens each row has counted

    @property
    def capacity(self) -> int:
        return self.output.shape[0]

    def rows(self, requests: list[Request]) -> torch.Tensor:
        """The rows of these requests (distinct), each up to date with what it has generated."""
        if len(requests) > self.capacity:
            self._grow(len(requests))
        rows = []
        for req in requests:
            row = self._row_of.get(req.request_id)
            if row is None:
                row = self._row_of[req.request_id] = self._take_row()
            self._row_of.move_to_end(req.request_id)  # this batch's rows are never the ones evicted
            if self._counted[row] != req.num_output_tokens:
                self._build(row, req)
            rows.append(row)
        return torch.tensor(rows, device=self.device)

    def release(self, request_ids: list[str]) -> None:
        """Ended requests give their rows back."""
        for rid in request_ids:
            self._row_of.pop(rid, None)

    def add(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count one new token per row (the tokens just sampled)."""
        self.output.index_put_((rows, tokens), torch.ones(len(rows), device=self.device), accumulate=True)
        for row in rows.tolist():
            self._counted[row] += 1

    def _take_row(self) -> int:
        free = set(range(self.capacity)) - set(self._row_of.values())
        if free:
            row = min(free)
        else:  # the least recently used request's row
            _, row = self._row_of.popitem(last=False)
        self._counted[row] = -1  # forces a build
        return row

    def _build(self, row: int, req: Request) -> None:
        self.output[row].zero_()
        if req.output_token_ids:
            ids = torch.tensor(req.output_token_ids, device=self.device)
            self.output[row].index_add_(0, ids, torch.ones(len(ids), device=self.device))
        self.in_prompt[row].zero_()
        self.in_prompt[row, torch.tensor(req.prompt_token_ids, device=self.device)] = True
        self._counted[row] = req.num_output_tokens

    def _grow(self, needed: int) -> None:
        extra = max(needed, 2 * self.capacity) - self.capacity
        self.output = torch.cat([self.output, self.output.new_zeros(extra, self.vocab_size)])
        self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros(extra, self.vocab_size)])
        self._counted += [0] * extra
