"""Next-token sampling, vectorized over the batch.

Greedy rows take the argmax. Other rows: temperature, then top-k, then top-p,
then an exponential race (argmax of p / Exp(1) noise, equivalent to drawing
from p). A request with a seed draws its noise from a generator seeded by
(seed, token index), so its output does not depend on batching or preemption.
"""

from __future__ import annotations

import torch

from core import faults
from core.sched.request import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """logits: [rows, vocab] float32; steps: tokens each request has generated so far."""
    faults.point("sample")
    greedy_ids = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if not random_rows:
        return greedy_ids.tolist()
    rows = torch.tensor(random_rows, device=logits.device)
    x = logits[rows] / torch.tensor([params[i].temperature for i in random_rows], device=logits.device)[:, None]
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
