"""Vectorized sampling."""

import pytest
import torch

from stallfree.core.model.sampler import sample
from stallfree.core.sched.request import SamplingParams


def test_greedy_and_mixed_batch():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.7, top_p=0.01)]
    assert sample(logits, params, [0, 0, 0]) == [1, 0, 2]


def test_seed_makes_draws_reproducible_and_index_dependent():
    logits = torch.zeros(1, 1000)
    p = [SamplingParams(temperature=1.0, seed=7)]
    a = [sample(logits, p, [i])[0] for i in range(20)]
    b = [sample(logits, p, [i])[0] for i in range(20)]
    assert a == b
    assert len(set(a)) > 10


def test_temperature_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.clamp_min(1e-9).log().repeat(4000, 1)
    draws = torch.tensor(sample(logits, [SamplingParams(temperature=1.0)] * 4000, [0] * 4000))
    freq = torch.bincount(draws, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_top_p_and_top_k_cut_the_tail():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(500, 1)
    top_p = sample(logits, [SamplingParams(temperature=1.0, top_p=0.7)] * 500, [0] * 500)
    assert set(top_p) <= {0, 1}  # p(0)=0.64, so tokens 0 and 1 cover 0.7
    top_k = sample(logits, [SamplingParams(temperature=5.0, top_k=3)] * 500, [0] * 500)
    assert set(top_k) == {0, 1, 2}


def test_top_k_beyond_the_vocabulary_spares_the_rest_of_the_batch():
    """The engine refuses such requests; the sampler still must not fail its batch."""
    logits = torch.tensor([[0.0, 9.0, 0.0], [9.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=1.0, top_k=100000), SamplingParams()]
    token, greedy = sample(logits, params, [0, 0])
    assert token in (0, 1, 2) and greedy == 0


def _req(rid, prompt, output, **sampling):
    from stallfree.core.sched.request import Request

    r = Request(rid, list(prompt), SamplingParams(**sampling), 0)
    r.output_token_ids = list(output)
    return r


def _reference_penalties(logits, req):
    """One request at a time, the way the OpenAI and HF docs define them."""
    x = logits.clone()
    p = req.sampling
    for token, bias in p.logit_bias:
        x[token] += bias
    counts = torch.bincount(torch.tensor(req.output_token_ids, dtype=torch.long), minlength=x.shape[0]).float()
    x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    seen = set(req.prompt_token_ids) | set(req.output_token_ids)
    for t in seen:
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    return x


def test_batched_penalties_and_bias_match_the_per_request_definition():
    from stallfree.core.model.sampler import Sampler, bias_logits, penalize

    torch.manual_seed(0)
    vocab = 50
    reqs = [
        _req("a", [1, 2, 3], [4, 4, 5], presence_penalty=0.5, frequency_penalty=0.3),
        _req("b", [6, 7], [], repetition_penalty=1.7),
        _req("c", [1], [2, 2, 2, 9], frequency_penalty=-0.4, repetition_penalty=0.8, logit_bias=((3, 2.5), (9, -1.0))),
        _req("d", [8], [8]),  # no penalties: untouched
    ]
    logits = torch.randn(len(reqs), vocab) * 3
    expect = torch.stack([_reference_penalties(logits[i], r) for i, r in enumerate(reqs)])
    sampler = Sampler(vocab, torch.device("cpu"))
    got = logits.clone()
    params = [r.sampling for r in reqs]
    bias_logits(got, [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias])
    which = [i for i, p in enumerate(params) if p.uses_history]
    penalize(got, which, sampler.counts.rows([reqs[i] for i in which]), sampler.counts, params)
    assert torch.allclose(got, expect, atol=1e-5)


def test_counts_follow_sampled_tokens_and_rebuild_after_preemption():
    from stallfree.core.model.sampler import Sampler

    vocab = 20
    sampler = Sampler(vocab, torch.device("cpu"))
    req = _req("r", [1, 2], [], frequency_penalty=2.0)
    logits = torch.zeros(1, vocab)
    logits[0, 5] = 3.0
    logits[0, 6] = 2.5
    (first,) = sampler(logits.clone(), [req]).tokens[0]
    req.output_token_ids.append(first)
    (second,) = sampler(logits.clone(), [req]).tokens[0]
    assert (first, second) == (5, 6)  # 5 was penalized by its one occurrence (3 - 2 < 2.5)
    row = sampler.counts.rows([req])
    assert sampler.counts.output[row].sum().item() == 1  # counted once, without a rebuild
    req.output_token_ids.append(second)
    req.output_token_ids[:] = [6, 6, 6]  # a history the row does not match (recomputed elsewhere)
    row = sampler.counts.rows([req])
    assert sampler.counts.output[row, 6].item() == 3 and sampler.counts.output[row, 5].item() == 0


def test_rows_are_reused_and_grown_for_big_batches():
    from stallfree.core.model.token_counts import TokenCounts

    counts = TokenCounts(10, torch.device("cpu"), capacity=2)
    reqs = [_req(f"r{i}", [i], [i], presence_penalty=1.0) for i in range(5)]
    rows = counts.rows(reqs)
    assert counts.capacity >= 5 and len(set(rows.tolist())) == 5
    for i, row in enumerate(rows.tolist()):
        assert counts.output[row, i].item() == 1 and counts.in_prompt[row, i]
    later = [_req(f"s{i}", [9], [], presence_penalty=1.0) for i in range(counts.capacity)]
    counts.rows(later)  # evicts the least recently used rows
    again = counts.rows(reqs[:1])  # rebuilt correctly wherever it lands
    assert counts.output[again, 0].item() == 1


def test_logit_bias_forces_and_bans_tokens():
    from stallfree.core.model.sampler import Sampler

    sampler = Sampler(10, torch.device("cpu"))
    logits = torch.zeros(2, 10)
    logits[:, 3] = 5.0
    reqs = [_req("f", [1], [], logit_bias=((7, 100.0),)), _req("b", [1], [], logit_bias=((3, -100.0),))]
    assert sampler(logits, reqs).tokens == [[7], [0]]


def test_min_p_drops_unlikely_tokens():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]]).repeat(400, 1)
    draws = sample(logits, [SamplingParams(temperature=1.0, min_p=0.5)] * 400, [0] * 400)
    assert set(draws) == {0, 1}  # p(2)/p(0) = e^-3 < 0.5


@pytest.mark.parametrize(
    "params",
    [
        dict(top_p=0.9),
        dict(top_k=5),
        dict(min_p=0.2),
        dict(top_p=0.8, top_k=12, min_p=0.05),
        dict(top_p=0.999),  # the cut lies beyond the candidates: the whole vocabulary is sorted
        dict(top_k=40),  # more than the candidates
        dict(),  # no cut at all
    ],
)
def test_drawing_among_candidates_matches_the_whole_vocabulary(monkeypatch, params):
    """Small candidate lists force both paths; each must draw from the same distribution."""
    import stallfree.core.model.sampler as sampler

    torch.manual_seed(1)
    vocab, draws = 64, 20000
    logits = (torch.randn(vocab) * 1.5).repeat(draws, 1)
    p = [SamplingParams(temperature=1.0, **params)] * draws
    monkeypatch.setattr(sampler, "CANDIDATES", (4, 16))
    fast = torch.bincount(torch.tensor(sample(logits, p, [0] * draws)), minlength=vocab).float() / draws
    whole = sampler._draw_whole_vocabulary(logits.clone(), p, [0] * draws)
    slow = torch.bincount(whole, minlength=vocab).float() / draws
    assert (fast - slow).abs().sum() / 2 < 0.05  # total variation distance (sampling noise: ~0.03)


def test_cuts_inside_the_candidates_never_sort_the_whole_vocabulary(monkeypatch):
    import stallfree.core.model.sampler as sampler

    def whole(*args):
        raise AssertionError("sorted the whole vocabulary")

    monkeypatch.setattr(sampler, "_draw_whole_vocabulary", whole)
    logits = torch.randn(8, 50_000) * 4
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0, top_k=50)] * 4
    assert len(sample(logits, params, [0] * 8)) == 8


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-38, 1e-6])
def test_a_tiny_temperature_samples_greedily(temperature):
    """Inside the accepted range, yet logits / 1e-38 overflow: the draw must still be the argmax."""
    logits = torch.randn(4, 49152) * 8
    params = [SamplingParams(temperature=temperature, seed=s) for s in range(4)]
    assert sample(logits, params, [0] * 4) == logits.argmax(dim=-1).tolist()
