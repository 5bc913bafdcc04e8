"""Next-token sampling, vectorized over the batch.

First the logits change for the requests that ask: ``logit_bias``, then the
presence, frequency and repetition penalties (from ``TokenCounts`` rows,
one scatter per iteration). Greedy rows then take the argmax. Other rows:
temperature, then min-p, top-k, top-p, then an exponential race (argmax of
p / Exp(1) noise, equivalent to drawing from p). A request with a seed draws
its noise from a generator seeded by (seed, token index), so its output does
not depend on batching or preemption.
"""

from __future__ import annotations

import torch

from core import faults
from core.model.token_counts import TokenCounts
from core.sched.request import Request, SamplingParams


class Sampler:
    """The model runner's sampler: keeps the token counts the penalties read."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.counts = TokenCounts(vocab_size, device)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """logits: [len(requests), vocab] float32, one row per request that samples."""
        params = [r.sampling for r in requests]
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        if biased:
            bias_logits(logits, [(i, params[i].logit_bias) for i in biased])
        penalized = [i for i, p in enumerate(params) if p.uses_history]
        rows = None
        if penalized:
            rows = self.counts.rows([requests[i] for i in penalized])
            penalize(logits, torch.tensor(penalized, device=logits.device), rows, self.counts, params)
        tokens = sample(logits, params, [r.num_output_tokens for r in requests])
        if rows is not None:
            self.counts.add(rows, torch.tensor([tokens[i] for i in penalized], device=logits.device))
        return tokens


def bias_logits(logits: torch.Tensor, biases: list[tuple[int, tuple[tuple[int, float], ...]]]) -> None:
    """Add each row's logit_bias, all rows in one indexed add."""
    rows = [i for i, pairs in biases for _ in pairs]
    ids = [token for _, pairs in biases for token, _ in pairs]
    values = [value for _, pairs in biases for _, value in pairs]
    dev = logits.device
    logits.index_put_(
        (torch.tensor(rows, device=dev), torch.tensor(ids, device=dev)),
        torch.tensor(values, device=dev, dtype=logits.dtype),
        accumulate=True,
    )


def penalize(
    logits: torch.Tensor, which: torch.Tensor, rows: torch.Tensor, counts: TokenCounts, params: list[SamplingParams]
) -> None:
    """OpenAI's presence and frequency penalties on the generated tokens, and
    the repetition penalty on every token seen, for the rows ``which``."""
    dev = logits.device
    chosen = [params[i] for i in which.tolist()]
    presence = torch.tensor([p.presence_penalty for p in chosen], device=dev)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in chosen], device=dev)[:, None]
    repetition = torch.tensor([p.repetition_penalty for p in chosen], device=dev)[:, None]
    seen_counts = counts.output[rows]
    x = logits[which] - frequency * seen_counts - presence * (seen_counts > 0)
    if any(p.repetition_penalty != 1.0 for p in chosen):
        seen = (seen_counts > 0) | counts.in_prompt[rows]
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    logits[which] = x


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """logits: [rows, vocab] float32; steps: tokens each request has generated so far."""
    faults.point("sample")
    greedy_ids = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if not random_rows:
        return greedy_ids.tolist()
    rows = torch.tensor(random_rows, device=logits.device)
    x = logits[rows] / torch.tensor([params[i].temperature for i in random_rows], device=logits.device)[:, None]
    min_p = [params[i].min_p for i in random_rows]
    if any(min_p):
        probs = x.softmax(dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=x.device)[:, None]
        x = x.masked_fill(probs < floor, float("-inf"))
    top_k = [params[i].top_k for i in random_rows]
    if any(top_k):
        vocab = x.shape[-1]
        k = torch.tensor([min(kk, vocab) if kk > 0 else vocab for kk in top_k], device=x.device)
        kth = x.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    top_p = [params[i].top_p for i in random_rows]
    if any(p < 1.0 for p in top_p):
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(dim=-1)
        # drop a token when the tokens before it already cover top_p
        drop = (probs.cumsum(dim=-1) - probs) >= torch.tensor(top_p, device=x.device)[:, None]
        x = x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    probs = x.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for j, i in enumerate(random_rows):
        seed = params[i].seed
        if seed is not None:
            gen = torch.Generator(device=logits.device).manual_seed(hash((seed, steps[i])) & 0x7FFF_FFFF_FFFF_FFFF)
            noise[j].exponential_(generator=gen)
    chosen = (probs / noise).argmax(dim=-1)
    greedy_ids[rows] = chosen
    return greedy_ids.tolist()
