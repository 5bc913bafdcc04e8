"""The production traces: both readers on the real files, the replay's window
and scaling, and sharing that reaches the prefix cache (token ids in the
simulator, exact-length text through the real tokenizer)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from stallfree.core.analysis.cost_model import CostModel
from stallfree.core.analysis.simulator import VOCAB, report, simulate, trace_arrivals
from stallfree.core.analysis.traces import Replay, TraceRequest, prompt_ids, read_trace, replay
from stallfree.core.model.embedded import load_tokenizer
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.timings import percentile
from stallfree.loadtest.workloads import WordPrompts, trace_jobs

TRACES = Path(__file__).resolve().parent.parent / "bench" / "traces"
AZURE = TRACES / "azure_llm_2023_conv.csv"
MOONCAKE = TRACES / "mooncake_conversation.jsonl"


def test_azure_conversation_trace():
    rows = read_trace(AZURE)
    assert len(rows) == 19_366
    assert rows[0] == TraceRequest(0.0, 374, 44, (), "a2")
    assert rows[-1].at_s == pytest.approx(3501.72, abs=0.01)  # 58 minutes
    prompts = [r.prompt_tokens for r in rows]
    assert percentile(prompts, 50) == 1020 and max(prompts) == 14_050
    assert all(r.shared == () for r in rows)  # no sharing recorded: every prompt unique
    assert all(b.at_s >= a.at_s for a, b in itertools.pairwise(rows))


def test_mooncake_conversation_trace():
    rows = read_trace(MOONCAKE)
    assert len(rows) == 12_031
    assert rows[-1].at_s == pytest.approx(3536.999)
    prompts = [r.prompt_tokens for r in rows]
    assert percentile(prompts, 50) == pytest.approx(6_909, abs=1) and max(prompts) == 126_195
    first = json.loads(MOONCAKE.open().readline())
    assert rows[0].prompt_tokens == first["input_length"] == sum(n for _, n in rows[0].shared)
    assert [k for k, _ in rows[0].shared] == [f"b{h}" for h in first["hash_ids"]]
    assert {n for _, n in rows[0].shared[:-1]} == {512}  # 512-token blocks, the last one partial


def test_equal_hash_ids_become_equal_token_blocks():
    rows = read_trace(MOONCAKE)[:2]  # both start with hash id 0, then differ
    assert rows[0].shared[0] == rows[1].shared[0] and rows[0].shared[1] != rows[1].shared[1]
    a, b = (prompt_ids(r, "seed", VOCAB) for r in rows)
    assert len(a) == rows[0].prompt_tokens and len(b) == rows[1].prompt_tokens
    assert a[:512] == b[:512] and a[512:1024] != b[512:1024]
    assert prompt_ids(rows[0], "other seed", VOCAB)[:512] != a[:512]  # another run shares nothing with this one


def test_the_simulated_prefix_cache_hits_exactly_what_the_hash_ids_share():
    # 120 rows, lengths / 8, one every 20 s (the trace has bursts of equal
    # timestamps, whose requests cannot hit each other): a request hits the
    # leading blocks that earlier requests' prompts held
    rows = replay(read_trace(MOONCAKE), Replay(count=120, length_scale=1 / 8))
    rows = [dataclasses.replace(r, at_s=20.0 * i) for i, r in enumerate(rows)]
    seen: set[str] = set()
    expected = 0
    for r in rows:
        run = 0
        for key, n in r.shared:
            if key not in seen:
                break
            run += n
        expected += min(run, r.prompt_tokens - 1) // 16 * 16  # full KV blocks, one token left to compute
        seen |= {key for key, _ in r.shared}
    config = SchedulerConfig(token_budget=2048, max_num_seqs=8, max_model_len=32_768)
    result = simulate(trace_arrivals(rows), config, CacheConfig(1 << 16, 16), CostModel())
    assert report(result)["summary"]["prefix_hit_tokens"] == expected > 5_000


def test_replay_window_rate_lengths_and_cap():
    rows = read_trace(AZURE)
    w = replay(rows, Replay(start=100, count=50))
    assert len(w) == 50 and w[0].at_s == 0 and w[0].request_id == rows[100].request_id
    assert w[-1].at_s == pytest.approx(rows[149].at_s - rows[100].at_s)
    fast = replay(rows, Replay(start=100, count=50, rate=10.0))
    assert (len(fast) - 1) / fast[-1].at_s == pytest.approx(10.0)  # the window's mean rate
    assert replay(rows, Replay(start=100, count=50, time_scale=3))[-1].at_s == pytest.approx(3 * w[-1].at_s, rel=1e-6)
    small = replay(rows, Replay(start=100, count=50, length_scale=0.125))
    assert [s.prompt_tokens for s in small] == [max(1, round(r.prompt_tokens / 8)) for r in w]
    capped = replay(rows, Replay(count=2000, max_context=1024))
    assert all(r.prompt_tokens + r.output_tokens <= 1024 and r.output_tokens <= 512 for r in capped)
    assert max(r.prompt_tokens for r in capped) > 900  # long prompts are cut, not dropped
    heavy = replay(rows, Replay(count=300, length_scale=0.5, max_context=1072, max_output=48))
    assert max(r.output_tokens for r in heavy) == 48 and min(r.output_tokens for r in heavy) < 48
    assert [h.prompt_tokens for h in heavy] == [
        min(max(1, round(r.prompt_tokens / 2)), 1072 - h.output_tokens) for r, h in zip(rows[:300], heavy, strict=True)
    ]
    moon = replay(read_trace(MOONCAKE), Replay(count=50, length_scale=0.125, max_context=2048))
    for r in moon:
        assert sum(n for _, n in r.shared) <= r.prompt_tokens <= 2048 - r.output_tokens
        assert all(n == 64 for _, n in r.shared[:-1])  # a hash block is 512 / 8 tokens wherever it occurs
    for bad in (Replay(start=20_000), Replay(count=0), Replay(rate=0), Replay(length_scale=-1), Replay(max_output=0)):
        with pytest.raises(ValueError, match=r"window|must be > 0"):
            replay(rows, bad)


def test_bad_rows_name_their_line(tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        read_trace(trace)
    csv = tmp_path / "bad.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\nnot a time,1,2\n")
    with pytest.raises(ValueError, match=r"bad\.csv:3"):
        read_trace(csv)


def test_text_prompts_have_exact_lengths_and_the_traces_sharing():
    tokenizer = load_tokenizer()
    rows = replay(read_trace(MOONCAKE), Replay(count=6, length_scale=0.25))
    jobs = trace_jobs(rows, WordPrompts(tokenizer, seed=3))
    encoded = [tokenizer.encode(job.prompt) for job in jobs]
    assert [len(ids) for ids in encoded] == [r.prompt_tokens for r in rows] == [j.prompt_tokens for j in jobs]
    block = 128  # Mooncake's 512 tokens, / 4
    assert all(ids[:block] == encoded[0][:block] for ids in encoded)  # hash id 0 in every row
    assert encoded[0][block : 2 * block] != encoded[1][block : 2 * block]
    again = trace_jobs(rows, WordPrompts(tokenizer, seed=3))  # a later run: a cold prefix cache
    assert tokenizer.encode(again[0].prompt)[:block] != encoded[0][:block]


def test_requests_logged_at_one_time_are_spread_to_the_next():
    rows = read_trace(MOONCAKE)[:26]  # 10 at 0 s, 16 at 3 s: the trace's 3 s clock
    assert [r.at_s for r in rows[:10]] == [0.0] * 10 and rows[10].at_s == 3.0
    spread = replay(rows, Replay())
    assert [round(r.at_s, 6) for r in spread[:10]] == [round(0.3 * i, 6) for i in range(10)]
    assert spread[10].at_s == 3.0 and spread[25].at_s == pytest.approx(3.0 + 15 * 3 / 16)
    assert [r.request_id for r in spread] == [r.request_id for r in rows]
    bursts = replay(rows, Replay(spread_ties=False))
    assert [r.at_s for r in bursts] == [r.at_s for r in rows]
