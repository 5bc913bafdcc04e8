"""Next-token sampling, vectorized over the batch.

First the logits change for the requests that ask: ``logit_bias``, then the
presence, frequency and repetition penalties (from ``TokenCounts`` rows,
one scatter per iteration). Greedy rows then take the argmax. Other rows:
temperature, then min-p, top-k, top-p, then an exponential race (argmax of
p / Exp(1) noise, equivalent to drawing from p). A request with a seed draws
its noise from a generator seeded by (seed, token index), so its output does
not depend on batching, preemption or draft tokens.

A request with draft tokens (speculative decoding) has a row per draft
position and one after: each is sampled as that position's token would be,
and the drafts are kept while they equal the draw (``core.sched.drafts``).
"""

from __future__ import annotations

import torch

from stallfree import kernels
from stallfree.core import faults
from stallfree.core.model.grammar import Grammars
from stallfree.core.model.token_counts import TokenCounts
from stallfree.core.model.tokenizer import Tokenizer
from stallfree.core.sched.batch import Logprobs, Sampled
from stallfree.core.sched.drafts import verified
from stallfree.core.sched.request import Request, SamplingParams


class Sampler:
    """The model runner's sampler: keeps the token counts the penalties read
    and the grammar matchers of constrained requests."""

    def __init__(self, vocab_size: int, device: torch.device, tokenizer: Tokenizer | None = None) -> None:
        self.counts = TokenCounts(vocab_size, device)
        self.grammars = Grammars(tokenizer, vocab_size) if tokenizer is not None else None

    def release(self, request_ids: list[str]) -> None:
        """The ended requests' rows and matchers."""
        self.counts.release(request_ids)
        if self.grammars is not None:
            self.grammars.release(request_ids)

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, requests: list[Request], drafts: list[tuple[int, ...]] | None = None
    ) -> Sampled:
        """logits: [rows, vocab] float32: one row per request that samples, or for
        a request with draft tokens one per draft position and one after them
        (each row sampled as that position's own token, then ``verified``)."""
        drafts = drafts or [()] * len(requests)
        row_requests = [r for r, d in zip(requests, drafts, strict=True) for _ in range(1 + len(d))]
        steps = [r.num_output_tokens + i for r, d in zip(requests, drafts, strict=True) for i in range(1 + len(d))]
        params = [r.sampling for r in row_requests]
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = logits[torch.tensor(asked, device=logits.device)].log_softmax(dim=-1) if asked else None
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        if biased:
            bias_logits(logits, [(i, params[i].logit_bias) for i in biased])
        penalized = [i for i, p in enumerate(params) if p.uses_history]
        rows = None
        if penalized:
            if any(len(d) for d, r in zip(drafts, requests, strict=True) if r.sampling.uses_history):
                raise ValueError("a request with penalties cannot have drafts (the scheduler never gives it any)")
            rows = self.counts.rows([row_requests[i] for i in penalized])
            penalize(logits, penalized, rows, self.counts, params)
        firsts = [0]
        for d in drafts:
            firsts.append(firsts[-1] + 1 + len(d))
        constrained = [j for j, r in enumerate(requests) if r.sampling.grammar is not None]
        if constrained:
            if self.grammars is None:
                raise ValueError("this sampler has no tokenizer for grammars")
            self.grammars.mask(logits, [(firsts[j], requests[j], drafts[j]) for j in constrained])
        drawn = sample(logits, params, steps)
        tokens = [
            verified(d, drawn[first : first + 1 + len(d)]) if d else [drawn[first]]
            for first, d in zip(firsts, drafts, strict=False)
        ]
        if constrained and self.grammars is not None:
            self.grammars.advance([requests[j] for j in constrained], [tokens[j] for j in constrained])
        if rows is not None:
            self.counts.add(rows, torch.tensor([drawn[i] for i in penalized], device=logits.device))
        if raw is None:
            return Sampled(tokens)
        per_row = token_logprobs(raw, asked, [drawn[i] for i in asked], params, len(params))
        logprobs: list[list[Logprobs] | None] = []
        for first, got in zip(firsts, tokens, strict=False):
            lps = per_row[first : first + len(got)]
            logprobs.append([lp for lp in lps if lp is not None] if lps[0] is not None else None)
        return Sampled(tokens, logprobs)


def token_logprobs(
    raw: torch.Tensor, asked: list[int], tokens: list[int], params: list[SamplingParams], rows: int
) -> list[Logprobs | None]:
    """Each asking row's sampled token's log-probability and its top alternatives
    (raw: the model's log-softmax for those rows, taken before any change)."""
    dev = raw.device
    chosen = raw.gather(1, torch.tensor(tokens, device=dev)[:, None]).squeeze(1).tolist()
    most = max(params[i].logprobs or 0 for i in asked)
    top_lp, top_ids = raw.topk(most, dim=-1) if most else (raw[:, :0], raw[:, :0].long())
    top_lp_rows, top_id_rows = top_lp.tolist(), top_ids.tolist()
    out: list[Logprobs | None] = [None] * rows
    for j, i in enumerate(asked):
        n = params[i].logprobs or 0
        out[i] = Logprobs(chosen[j], tuple(zip(top_id_rows[j][:n], top_lp_rows[j][:n], strict=True)))
    return out


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
    logits: torch.Tensor, which: list[int], rows: torch.Tensor, counts: TokenCounts, params: list[SamplingParams]
) -> None:
    """OpenAI's presence and frequency penalties on the generated tokens, and
    the repetition penalty on every token seen, for the rows ``which``."""
    dev = logits.device
    chosen = [params[i] for i in which]
    presence = torch.tensor([p.presence_penalty for p in chosen], device=dev)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in chosen], device=dev)[:, None]
    repetition = torch.tensor([p.repetition_penalty for p in chosen], device=dev)[:, None]
    seen_counts = counts.output[rows]
    x = logits[which] - frequency * seen_counts - presence * (seen_counts > 0)
    if any(p.repetition_penalty != 1.0 for p in chosen):
        seen = (seen_counts > 0) | counts.in_prompt[rows]
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    logits[which] = x


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token, the first on ties (``kernels.argmax``)."""
    return kernels.argmax(logits)


# Random rows draw among the most likely tokens only, when the top-k, min-p
# and top-p cuts fall inside them (checked per row: 64 candidates, then 1,024
# for the rows that need more, then the whole vocabulary sorted for the rest).
# A partial top-k replaces a full sort, which cost 50-60x a greedy step at
# batch 64 (bench/results/sampler_cost-2026-12-01.md).
CANDIDATES = (64, 1024)


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """logits: [rows, vocab] float32; steps: tokens each request has generated so far."""
    faults.point("sample")
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return _greedy(logits).tolist()
    dev = logits.device
    chosen = [params[i] for i in random_rows]
    chosen_steps = [steps[i] for i in random_rows]
    temperature = torch.tensor([p.temperature for p in chosen], device=dev)[:, None]
    every_row = len(random_rows) == len(params)  # then no row copies: these are 64 x 49,152 floats
    x = (logits if every_row else logits[torch.tensor(random_rows, device=dev)]) / temperature
    probs = x.softmax(dim=-1)
    picked = torch.empty(len(random_rows), dtype=torch.long, device=dev)
    left = torch.arange(len(random_rows), device=dev)  # rows not drawn yet

    def of(rows: torch.Tensor) -> tuple[list[SamplingParams], list[int]]:
        return [chosen[j] for j in rows.tolist()], [chosen_steps[j] for j in rows.tolist()]

    for k in CANDIDATES:
        tokens, exact = _draw_from_candidates(probs if len(left) == len(probs) else probs[left], *of(left), k)
        picked[left[exact]] = tokens[exact]
        left = left[~exact]
        if len(left) == 0:
            break
    else:
        picked[left] = _draw_whole_vocabulary(x[left], *of(left))
    if every_row:
        return picked.tolist()
    tokens_out = _greedy(logits)
    tokens_out[torch.tensor(random_rows, device=dev)] = picked
    return tokens_out.tolist()


def _draw_from_candidates(
    probs: torch.Tensor, params: list[SamplingParams], steps: list[int], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw each row among its k most likely tokens; also which rows' draws are
    exact (every cut fell inside the k), the others are to be drawn again."""
    dev = probs.device
    vocab = probs.shape[-1]
    k = min(k, vocab)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)
    min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
    cand_p, cand_ids = probs.topk(k, dim=-1)  # most likely first
    floor = min_p * cand_p[:, :1]
    passes = (torch.arange(k, device=dev)[None, :] < top_k[:, None]) & (cand_p >= floor)
    # top-p is relative to what top-k and min-p kept: the candidates', or the whole vocabulary's above the floor
    kept_p = cand_p * passes
    mass = kept_p.sum(dim=-1, keepdim=True)
    wide = top_k > k  # no top-k cut inside the candidates: the vocabulary's mass above the floor
    if bool(wide.any()):
        whole = (probs * (probs >= floor)).sum(dim=-1, keepdim=True) if bool(min_p.any()) else torch.ones_like(mass)
        mass = torch.where(wide[:, None], whole, mass)
    keep = passes & (kept_p.cumsum(dim=-1) - kept_p < top_p * mass)
    exact = ((top_k <= k) | (top_k >= vocab)) & (~keep[:, -1] | (k == vocab))
    noise = _noise(cand_p.shape, params, steps, dev)
    tokens = cand_ids.gather(1, (cand_p * keep / noise).argmax(dim=-1, keepdim=True)).squeeze(1)
    return tokens, exact


def _noise(shape: torch.Size, params: list[SamplingParams], steps: list[int], device: torch.device) -> torch.Tensor:
    """Exp(1) noise per row; a seeded request's row comes from its own (seed, token index) generator."""
    noise = torch.empty(shape, device=device).exponential_()
    for j, p in enumerate(params):
        if p.seed is not None:
            gen = torch.Generator(device=device).manual_seed(hash((p.seed, steps[j])) & 0x7FFF_FFFF_FFFF_FFFF)
            noise[j].exponential_(generator=gen)
    return noise


def _draw_whole_vocabulary(x: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> torch.Tensor:
    """The same cuts over every token (rows whose cut lies beyond the candidates)."""
    dev = x.device
    min_p = [p.min_p for p in params]
    if any(min_p):
        probs = x.softmax(dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=dev)[:, None]
        x = x.masked_fill(probs < floor, float("-inf"))
    vocab = x.shape[-1]
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    sorted_x, order = x.sort(dim=-1, descending=True)
    kth = sorted_x.gather(1, torch.tensor(top_k, device=dev)[:, None] - 1)
    x = x.masked_fill(x < kth, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
    sorted_probs = x.gather(1, order).softmax(dim=-1)
    # drop a token when the tokens before it already cover top_p
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    x = x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    return (x.softmax(dim=-1) / _noise(x.shape, params, steps, dev)).argmax(dim=-1)
