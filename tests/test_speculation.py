"""Speculative decoding by prompt lookup: the drafts, their verification, their
place in the budget and their cost rule (``core.sched.drafts``, pass 4 of the
scheduler). Budget, displacement and KV invariants over random traces with
speculation on are in test_scheduler_properties."""

from __future__ import annotations

import json
import random

import llguidance
import pytest
import torch

from stallfree.core.analysis.cost_model import LLAMA3_8B, CostModel, HardwareSpec
from stallfree.core.analysis.sim_runner import SimRunner, VirtualClock
from stallfree.core.model.model_runner import ModelRunner
from stallfree.core.model.sampler import Sampler
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.drafts import NgramDrafter, expected_accepted, verified
from stallfree.core.sched.engine import Engine
from stallfree.core.sched.request import Request, SamplingParams
from tests.simkit import request, run_to_completion, step_items

CPU = torch.device("cpu")


def test_the_longest_recent_suffix_proposes_what_followed_it():
    drafter = NgramDrafter()
    #        0  1  2  3  4  5  6  7  8  9 10 11
    req = request("r", [5, 6, 7, 8, 9, 1, 6, 7, 3, 2, 6, 7], max_tokens=4)
    # suffix (6, 7) last occurred at 6..7, followed by 3 2 6 7; (2, 6, 7) never did before
    assert drafter.propose(req, 3, (2, 4)) == (3, 2, 6)
    req.output_token_ids.append(3)  # ... 6 7 3: (6, 7, 3) at 6..8 is the longest match now
    assert drafter.propose(req, 8, (2, 4)) == (2, 6, 7, 3)  # stops at the end of the tokens
    assert drafter.propose(req, 2, (4, 4)) == ()  # no 4-gram repeats
    assert drafter.propose(request("s", [1, 2, 3], max_tokens=4), 4, (2, 4)) == ()


def test_verification_keeps_drafts_while_they_equal_the_draw():
    assert verified((4, 5, 6), (4, 5, 6, 7)) == [4, 5, 6, 7]  # all kept, and the token after them
    assert verified((4, 5, 6), (4, 9, 6, 7)) == [4, 9]  # the draw replaces the first mismatch
    assert verified((4,), (8, 1)) == [8]
    assert verified((), (3,)) == [3]
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)


def test_how_many_to_propose_follows_what_was_kept():
    drafter, req = NgramDrafter(), request("r", 8)
    assert drafter.limit(req, 4) == 4  # not verified yet: the setting's most
    drafter.observe(req, 4, 1)
    assert drafter.limit(req, 4) == 2 and drafter.acceptance(req) < 0.5
    drafter.observe(req, 2, 2)
    assert drafter.limit(req, 8) == 4 and drafter.limit(req, 3) == 3
    drafter.observe(req, 4, 0)
    assert drafter.limit(req, 4) == 1


def echo_prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat spans of themselves, as code edits and quoting summaries do."""
    rng = random.Random(1)
    prompts = []
    for n in (300, 20, 75, 5, 120):
        base = [rng.randrange(3, vocab) for _ in range(9)]
        prompts.append((base * (n // 9 + 1))[:n])
    return prompts


def tiny_run(tiny_model, sampling: SamplingParams, **sched) -> tuple[list[Request], dict[str, list]]:
    """The echo prompts (and a second choice of the first) to the end; the requests
    and each one's logprobs, as the engine reported them token by token."""
    runner = ModelRunner(tiny_model, 512, 16, torch.float32, CPU)
    config = SchedulerConfig(max_num_seqs=8, max_model_len=1024, token_budget=72, **sched)
    engine = Engine(config, CacheConfig(512, 16), runner)
    reqs = [Request(f"r{i}", p, sampling, 0) for i, p in enumerate(echo_prompts(200))]
    reqs.append(Request("r-choice-2", reqs[0].prompt_token_ids, sampling, 0, prefill_after="r0"))  # n > 1
    for r in reqs:
        engine.add_request(r)
    logprobs: dict[str, list] = {r.request_id: [] for r in reqs}
    for out in run_to_completion(engine):
        for o in out.outputs:
            assert o.logprobs is None or len(o.logprobs) == len(o.new_token_ids)
            logprobs[o.request_id] += o.logprobs or []
    assert engine.kv.num_used_blocks == 0
    return reqs, logprobs


def test_greedy_tokens_and_logprobs_are_the_same_with_speculation(tiny_model):
    sampling = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2)
    plain, plain_lps = tiny_run(tiny_model, sampling)
    spec, spec_lps = tiny_run(tiny_model, sampling, speculate="ngram", draft_tokens=5)
    assert sum(r.num_draft_tokens for r in spec) > 20 and sum(r.num_accepted_tokens for r in spec) > 10
    assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in plain]
    assert all(r.num_output_tokens == 40 for r in spec)  # max_tokens holds with drafts in flight
    for r in spec:  # a kept draft's logprobs are its position's, as if decoded one by one
        got, want = spec_lps[r.request_id], plain_lps[r.request_id]
        assert len(got) == len(want) == 40
        assert [lp.top[0][0] for lp in got] == [lp.top[0][0] for lp in want]
        assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want], abs=1e-4)


def test_seeded_sampling_is_the_same_with_speculation(tiny_model):
    """A seeded draw is keyed by the token's index, and each draft position is
    drawn as that token would be: same seed, same output, drafts or not."""
    sampling = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.7, top_k=3, seed=11)
    plain, _ = tiny_run(tiny_model, sampling)
    spec, _ = tiny_run(tiny_model, sampling, speculate="ngram")
    assert sum(r.num_accepted_tokens for r in spec) > 0
    assert sum(r.num_draft_tokens - r.num_accepted_tokens for r in spec) > 0  # some rejected too
    assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in plain]


def test_sampled_tokens_keep_their_distribution():
    """Rejection sampling of a point-mass draft: the first token follows p
    whatever the draft, and the second, after a kept draft, follows q."""
    torch.manual_seed(0)
    p = torch.tensor([0.45, 0.3, 0.15, 0.1, 0, 0, 0, 0])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4, 0, 0, 0, 0])
    n, draft = 6000, 1
    logits = torch.stack([p, q]).clamp_min(1e-12).log().repeat(n, 1)
    reqs = [request(f"r{i}", 4, max_tokens=8, temperature=1.0) for i in range(n)]
    out = Sampler(8, CPU)(logits, reqs, [(draft,)] * n).tokens
    first = torch.tensor([t[0] for t in out])
    assert torch.allclose(torch.bincount(first, minlength=8).float() / n, p, atol=0.02)
    after = torch.tensor([t[1] for t in out if t[0] == draft])  # the draft was kept: one more token
    assert all(len(t) == (2 if t[0] == draft else 1) for t in out)
    assert torch.allclose(torch.bincount(after, minlength=8).float() / len(after), q, atol=0.04)


def test_grammar_constrained_output_stays_valid_and_greedy_with_drafts(tiny_model):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    prompt = tiny_model.tokenizer.encode('{"ok": true, "n": 3} {"ok": false, "n": 5} ' * 6 + '{"ok": tr')

    def run(**sched) -> tuple[list[int], int]:
        runner = ModelRunner(tiny_model, 256, 16, torch.float32, CPU)
        engine = Engine(SchedulerConfig(max_num_seqs=4, max_model_len=1024, **sched), CacheConfig(256, 16), runner)
        req = Request("g", prompt, SamplingParams(max_tokens=60, grammar=grammar), 0)
        engine.add_request(req)
        run_to_completion(engine)
        return req.output_token_ids, req.num_draft_tokens

    plain, _ = run()
    spec, drafts = run(speculate="ngram")
    assert drafts > 0
    assert spec == plain
    # the random model wanders in whitespace the schema allows: every token still obeys it
    tok = llguidance.LLTokenizer(tiny_model.tokenizer.to_hf_json(), n_vocab=tiny_model.config.vocab_size)
    assert llguidance.LLMatcher(tok, grammar).validate_tokens(spec) == len(spec) == 60


def sim_with(cost: CostModel, streams: int, acceptance: float) -> Engine:
    """``streams`` decodes that always propose drafts on a simulated model that keeps each with ``acceptance``."""
    from stallfree.core.analysis.sim_runner import SimDrafter

    clock = VirtualClock()
    runner = SimRunner(cost, 16, clock, acceptance=acceptance)
    config = SchedulerConfig(token_budget=4096, max_num_seqs=64, speculate="ngram")
    engine = Engine(config, CacheConfig(4096, 16), runner, clock, cost, SimDrafter())
    for i in range(streams):
        engine.add_request(request(f"r{i}", 64, max_tokens=48, ignore_eos=True))
    return engine


# A CPU's shape: extra rows cost nearly what their tokens' FLOPs do (no weight-read hiding).
CPU_LIKE = CostModel(LLAMA3_8B, HardwareSpec("cpu", flops=2e12, mem_bw=100e9, overlap=False, overhead_s=0.002))


@pytest.mark.parametrize(("streams", "speculates"), [(1, True), (32, False)])
def test_the_cost_rule_turns_speculation_off_when_rows_cost_what_they_save(streams, speculates):
    engine = sim_with(CPU_LIKE, streams, acceptance=0.6)
    outs = run_to_completion(engine)
    its = [o.iteration for o in outs if o.iteration is not None and o.iteration.prefill_tokens == 0]
    drafts = sum(it.draft_tokens for it in its)
    declined = sum(it.drafts_declined for it in its)
    if speculates:
        assert drafts > 0 and sum(it.accepted_tokens for it in its) > 0
    else:
        assert drafts == 0 and declined > 0
    assert engine.kv.num_used_blocks == 0


def test_drafts_pay_on_the_articles_gpu_at_32_streams():
    """Memory-bound decodes: verifying drafts is nearly free, so the same rule keeps them."""
    engine = sim_with(CostModel(), 32, acceptance=0.6)
    outs = run_to_completion(engine)
    assert sum(o.iteration.draft_tokens for o in outs if o.iteration is not None) > 0


def test_drafts_take_only_what_decodes_and_chunks_leave():
    """A long prompt's chunk keeps its size when drafts are on; the decodes keep their token."""
    from stallfree.core.analysis.sim_runner import SimDrafter

    def first_mixed(speculate: str) -> tuple[int, int, int]:
        clock = VirtualClock()
        cost = CostModel()
        runner = SimRunner(cost, 16, clock, acceptance=1.0)
        config = SchedulerConfig(token_budget=64, max_num_seqs=8, speculate=speculate, draft_tokens=8)
        engine = Engine(config, CacheConfig(1024, 16), runner, clock, cost, SimDrafter())
        for i in range(4):
            engine.add_request(request(f"d{i}", 8, max_tokens=40, ignore_eos=True))
        for _ in range(3):
            engine.step()
        engine.add_request(request("long", 600, max_tokens=4))
        out = engine.step()
        it = out.iteration
        return it.prefill_tokens, it.decode_tokens - it.draft_tokens, it.draft_tokens

    plain_prefill, plain_decodes, _ = first_mixed("off")
    prefill, decodes, drafts = first_mixed("ngram")
    assert (prefill, decodes) == (plain_prefill, plain_decodes) == (60, 4)
    assert drafts == 0  # the chunk took what the decodes left


def test_an_opted_out_or_penalized_request_never_gets_drafts():
    from stallfree.core.analysis.sim_runner import SimDrafter

    clock = VirtualClock()
    runner = SimRunner(CostModel(), 16, clock, acceptance=1.0)
    config = SchedulerConfig(token_budget=256, max_num_seqs=8, speculate="ngram")
    engine = Engine(config, CacheConfig(256, 16), runner, clock, None, SimDrafter())
    out_req = request("out", 8, max_tokens=20, ignore_eos=True, speculate=False)
    pen = request("pen", 8, max_tokens=20, ignore_eos=True, presence_penalty=0.5)
    on = request("on", 8, max_tokens=20, ignore_eos=True)
    for r in (out_req, pen, on):
        engine.add_request(r)
    run_to_completion(engine)
    assert out_req.num_draft_tokens == pen.num_draft_tokens == 0 < on.num_draft_tokens


def test_usage_metrics_and_the_opt_out_over_both_protocols():
    import httpx
    from websockets.sync.client import connect

    from tests.server import tiny_server

    srv = tiny_server(speculate="ngram")
    try:
        body = {"prompt": "the cat sat on the mat. " * 20, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        on = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        off = httpx.post(srv.url + "/v1/completions", json={**body, "speculate": False}, timeout=60).json()
        assert on["choices"][0]["text"] == off["choices"][0]["text"]
        assert on["usage"]["completion_tokens"] == 40
        assert on["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
        assert off["usage"]["completion_tokens_details"] == {
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        }
        text = off["choices"][0]["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 3]  # a stop string inside a run of kept drafts, likely
        cut = [
            httpx.post(srv.url + "/v1/completions", json={**body, "stop": [stop], "speculate": s}, timeout=60).json()
            for s in (True, False)
        ]
        assert cut[0]["choices"][0]["text"] == cut[1]["choices"][0]["text"] == text[: text.index(stop)]
        assert cut[0]["choices"][0]["finish_reason"] == "stop"
        with connect(srv.ws_url) as ws:
            ws.send(json.dumps({"type": "generate", "id": "g", **body}))
            frames = []
            while not frames or frames[-1]["type"] not in ("done", "error"):
                frames.append(json.loads(ws.recv()))
        usage = frames[-1]["usage"]
        assert usage["accepted_draft_tokens"] > 0 and usage["draft_tokens"] >= usage["accepted_draft_tokens"]
        assert "".join(f["text"] for f in frames if f["type"] == "token") == on["choices"][0]["text"]
        metrics = httpx.get(srv.url + "/metrics").text
        name = 'stallfree_draft_tokens_total{outcome="accepted"}'
        kept = next(ln for ln in metrics.splitlines() if ln.startswith(name))
        assert float(kept.split()[-1]) >= usage["accepted_draft_tokens"]
        assert srv.wait_kv_baseline() == 0
    finally:
        srv.stop()


def test_simulate_models_an_acceptance_rate(capsys):
    from stallfree.cli import main

    assert main(["simulate", "--scenario", "burst", "--json"]) == 0
    off = json.loads(capsys.readouterr().out)["summary"]
    assert main(["simulate", "--scenario", "burst", "--speculate", "ngram", "--draft-acceptance", "0.7", "--json"]) == 0
    on = json.loads(capsys.readouterr().out)["summary"]
    assert off["draft_tokens"] == 0 and off["tokens_per_decode_step"] == 1.0
    assert on["draft_tokens"] > 0 and 0.3 < on["acceptance"] < 0.7  # kept of verified: a rejection drops the rest
    assert on["tokens_per_decode_step"] > 1.2 and on["duration_ms"] < off["duration_ms"]
    assert main(["simulate", "--scenario", "burst", "--speculate", "ngram"]) == 2
    assert "--draft-acceptance" in capsys.readouterr().err


def test_a_stop_token_among_kept_drafts_ends_the_request_there():
    from stallfree.core.analysis.sim_runner import DRAFT_TOKEN, SimDrafter
    from stallfree.core.sched.request import FinishReason

    clock = VirtualClock()
    runner = SimRunner(CostModel(), 16, clock, acceptance=1.0)  # every draft kept
    config = SchedulerConfig(token_budget=256, max_num_seqs=8, speculate="ngram")
    engine = Engine(config, CacheConfig(256, 16), runner, clock, None, SimDrafter())
    req = request("r", 30, max_tokens=20, stop_token_ids=(DRAFT_TOKEN,))
    engine.add_request(req)
    engine.step()  # the prompt, and its first token
    assert req.output_token_ids[-1] != DRAFT_TOKEN
    out = engine.step()  # four drafts, all kept: the first is the stop token
    assert out.outputs[0].new_token_ids == [DRAFT_TOKEN] and req.finish_reason == FinishReason.STOP
    assert req.num_draft_tokens == 4 and req.num_computed_tokens == req.num_tokens - 1
    assert engine.kv.num_used_blocks == 0


def test_one_token_decodes_lead_the_batch_and_speculating_ones_end_it():
    """The model runner reads the first ``num_decodes`` sequences (its count of
    one-token decodes) as one query row each. A decode given drafts in place,
    ahead of a plain one, would be read as a single row: its drafts' KV, which
    update counts as computed once kept, would be wrong, and so would every
    sequence after it."""
    from stallfree.core.analysis.sim_runner import SimDrafter

    clock = VirtualClock()
    cost = CostModel()
    runner = SimRunner(cost, 16, clock, acceptance=1.0)
    config = SchedulerConfig(token_budget=256, max_num_seqs=8, speculate="ngram", draft_tokens=4)
    engine = Engine(config, CacheConfig(1024, 16), runner, clock, cost, SimDrafter())
    for rid in ("s0", "s1"):
        engine.add_request(request(rid, 8, max_tokens=40, ignore_eos=True))
    engine.add_request(request("plain", 8, max_tokens=40, ignore_eos=True, speculate=False))
    for _ in range(3):
        engine.step()
    engine.add_request(request("prompt", 100, max_tokens=4))
    items, _ = step_items(engine)
    kinds = [2 if n > 1 and not prefill else int(prefill) for _, n, prefill in items]  # decode, chunk, drafts
    assert kinds == sorted(kinds) and set(kinds) == {0, 1, 2}
    assert [rid for rid, _, _ in items] == ["plain", "prompt", "s0", "s1"]
