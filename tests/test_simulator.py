"""`stallfree simulate`: the article's figure 3 and burst, traces, the CLI."""

import json
import subprocess
import sys

import pytest

from stallfree.cli import main
from stallfree.core.analysis.cost_model import CostModel
from stallfree.core.analysis.simulator import load_trace, report, scenario, simulate
from stallfree.core.sched.config import CacheConfig, SchedulerConfig


def run_scenario(name, **overrides):
    arrivals, settings = scenario(name)
    result = simulate(arrivals, SchedulerConfig(**{**settings, **overrides}), CacheConfig(8192), CostModel())
    return report(result)


def test_figure3_stall_free():
    rep = run_scenario("seed-figure3")
    a, b = rep["requests"]["A"], rep["requests"]["B"]
    its = [it for it in rep["iterations"] if "A" in it["chunks"]]
    assert len(its) == a["chunks"] == 16
    assert all(it["chunks"]["A"] == 512 and it["decode_tokens"] == 64 for it in its)
    # B gets a token in every one of A's chunk iterations: its gaps never exceed one of them
    assert b["max_gap_ms"] == pytest.approx(23.04, rel=0.01)
    assert b["stalled_gaps"] >= 16
    assert a["prefill_ms"] == pytest.approx(368.6, rel=0.01)
    assert a["queue_wait_ms"] < 6  # it waited at most one decode iteration to start


def test_figure3_unchunked_stalls_b_for_the_whole_prefill():
    rep = run_scenario("seed-figure3", chunking="none")
    b = rep["requests"]["B"]
    assert rep["requests"]["A"]["chunks"] == 1
    assert b["max_gap_ms"] == pytest.approx(327.7 + 5.33, rel=0.01)
    # B sat out A's prefill iteration: the gap spanning it overlapped another request's prefill
    assert b["stalled_gaps"] == 1
    assert rep["summary"]["itl_p50_ms"] == pytest.approx(5.33, rel=0.01)  # the average user sees nothing


def test_figure3_decode_first_delays_a_instead():
    rep = run_scenario("seed-figure3", chunking="decode_first")
    assert rep["requests"]["B"]["max_gap_ms"] < 24
    assert rep["requests"]["A"]["queue_wait_ms"] > 500


def test_burst_last_prompt_waits_about_3_7_s():
    rep = run_scenario("burst")
    last = max(rep["requests"][f"L{i}"]["ttft_ms"] for i in range(10))
    assert last / 1e3 == pytest.approx(3.7, rel=0.05)
    assert rep["requests"]["B"]["max_gap_ms"] == pytest.approx(23.04, rel=0.01)


def test_trace_replay_with_shared_prefix(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [
        {"t": 0.0, "prompt_tokens": 600, "output_tokens": 4, "prefix": "sys", "prefix_tokens": 512, "id": "first"},
        {"t": 0.5, "prompt_tokens": 700, "output_tokens": 4, "prefix": "sys", "prefix_tokens": 512, "id": "second"},
        {"t": 0.5, "prompt_tokens": 300, "output_tokens": 4},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    arrivals = load_trace(trace)
    rep = report(simulate(arrivals, SchedulerConfig(token_budget=256), CacheConfig(1024), CostModel()))
    assert rep["requests"]["second"]["cached_tokens"] == 512
    assert rep["requests"]["first"]["cached_tokens"] == 0
    assert rep["requests"]["r3"]["output_tokens"] == 4
    assert rep["summary"]["prefix_hit_tokens"] == 512


def test_bad_trace_names_the_line(tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"t": 0, "prompt_tokens": 5, "output_tokens": 1}\n{"t": 1, "prompt_tokens": 5}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_trace(trace)


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "stallfree.cli", *args], capture_output=True, text=True, check=False, timeout=120
    )


def test_cli_json_outputs_are_one_document():
    plan = cli("plan", "--json")
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["num_chunks"] == 16
    sim = cli("simulate", "--scenario", "seed-figure3", "--json")
    assert sim.returncode == 0, sim.stderr
    doc = json.loads(sim.stdout)
    assert doc["requests"]["A"]["ttft_ms"] == pytest.approx(372, rel=0.02)
    assert doc["requests"]["B"]["max_gap_ms"] == pytest.approx(23.04, rel=0.01)
    assert {"decode_tokens", "prefill_tokens", "duration_ms"} <= set(doc["iterations"][0])


def test_cli_tables_and_errors(capsys):
    assert main(["plan", "--budget", "576,2112"]) == 0
    out = capsys.readouterr().out
    assert "stall reduction" in out
    assert "2112" in out
    assert main(["simulate", "--chunking", "none"]) == 0
    assert "chunking none" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse: not one of the scenarios
        main(["simulate", "--scenario", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    assert main(["simulate", "--token-budget", "10", "--json"]) == 0
    captured = capsys.readouterr()
    assert "clamped" in captured.err
    assert json.loads(captured.out)["config"]["token_budget"] == 160
