"""`stallfree bench` against a real (simulated-runner) server, over both protocols."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stallfree.kernels import cpu_build
from tests.server import sim_server

pytestmark = pytest.mark.slow  # load runs against live servers


@pytest.fixture(scope="module")
def server():
    s = sim_server(time_scale=0.3, token_budget=256, max_num_seqs=64)
    yield s
    s.stop()


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stallfree.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_interference_sweep_over_websocket_with_plots(server, tmp_path):
    out = bench(
        "--target",
        server.ws_url,
        "--workload",
        "interference",
        "--streams",
        "3",
        "--decode-tokens",
        "30",
        "--long-tokens",
        "600",
        "--long-delay-s",
        "0.3",
        "--sweep",
        "token_budget=96,384",
        "--tbt-slo-ms",
        "1000",
        "--out",
        str(tmp_path),
        "--json",
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [r["setting"] for r in report["runs"]] == [{"token_budget": 96}, {"token_budget": 384}]
    for run in report["runs"]:
        assert run["decoders"]["requests"] == 3 and run["decoders"]["errors"] == 0
        assert run["long"]["ttft_p50_ms"] > 0
        assert run["decoders"]["max_gap_ms"] >= run["decoders"]["itl_p99_ms"] > 0
        assert run["all"]["server_prefill_ms_p50"] > 0
    # a bigger budget lets the long prompt's chunks stall the decoders for longer
    assert report["runs"][1]["decoders"]["max_gap_ms"] > report["runs"][0]["decoders"]["max_gap_ms"]
    assert report["slo"]["best"] == {"token_budget": 384}
    assert {p.name for p in tmp_path.iterdir()} >= {"report.json", "itl-0.png", "itl-1.png", "frontier.png"}


TRACES = Path(__file__).resolve().parent.parent / "bench" / "traces"


@pytest.mark.parametrize("protocol", ["ws", "openai"])
def test_trace_replay_of_exact_lengths_with_the_traces_sharing(server, tmp_path, protocol):
    target = server.ws_url if protocol == "ws" else server.url + "/v1"
    out = bench(
        "--target",
        target,
        "--trace",
        str(TRACES / "mooncake_conversation.jsonl"),
        "--window",
        "0:12",
        "--rate",
        "8",
        "--length-scale",
        "0.0625",
        "--tbt-slo-ms",
        "5000",
        "--out",
        str(tmp_path),
        "--json",
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["workload"] == "trace" and "rows 0-12, 8 req/s" in report["trace"]["replay"]
    s = report["runs"][0]["all"]
    assert s["requests"] == 12 and s["errors"] == 0
    assert s["prompt_length_mismatches"] == 0  # every prompt is its traced length / 16, to the token
    # the first rows share only their first hash-id block (32 tokens at this scale): the
    # later ones hit it once it is computed (those arriving with the first cannot)
    assert 0 < s["prefix_hit_rate"] <= 11 * 32 / s["prompt_tokens"]
    assert 0 <= s["scheduling_delay_p50_ms"] <= s["ttft_p50_ms"]  # waiting is part of the first token's time
    assert s["good_requests"] == 12 and s["goodput_req_per_s"] > 0
    assert s["max_gap_ms"] >= s["itl_p99_ms"] >= s["itl_p50_ms"] > 0
    md = (tmp_path / "report.md").read_text()
    assert "| - | all |" in md and "mooncake_conversation.jsonl" in md
    assert (tmp_path / "itl-0.png").stat().st_size > 0


def test_poisson_over_the_openai_api(server):
    out = bench(
        "--target",
        server.url + "/v1",
        "--workload",
        "poisson",
        "--requests",
        "6",
        "--rate",
        "20",
        "--prompt",
        "uniform:20-60",
        "--output-tokens",
        "12",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)["runs"][0]["all"]
    assert s["requests"] == 6 and s["errors"] == 0
    assert s["output_tokens"] >= 6 * 11  # one SSE event per token (the first may merge)
    assert s["throughput_tokens_per_s"] > 0


def test_unreachable_target_is_a_clear_error():
    out = bench("--target", "ws://127.0.0.1:9/v1/stream", "--sweep", "token_budget=128")
    assert out.returncode == 2
    assert "stallfree bench: error" in out.stderr


def test_prompts_are_unique_across_runs_with_the_same_seed():
    from stallfree.core.model.embedded import load_tokenizer
    from stallfree.loadtest.workloads import PromptMaker

    tok = load_tokenizer()
    a, b = PromptMaker(tok, seed=0), PromptMaker(tok, seed=0)
    pa, pb = a(200), b(200)
    assert tok.encode(pa)[:16] != tok.encode(pb)[:16]  # no shared first KV block
    assert abs(len(tok.encode(pa)) - 200) <= 3


def test_results_go_to_new_dated_files(tmp_path, monkeypatch):
    """A benchmark never overwrites a recorded result: each run takes the next free dated name."""
    from bench import record

    monkeypatch.setattr(record, "OUT", tmp_path)
    first = record.dated("compare")
    assert record.dated("compare") == first  # nothing written yet
    first.with_suffix(".json").write_text("{}")
    second = record.dated("compare")
    assert second.name == f"{first.name}-2"
    second.with_suffix(".md").write_text("")
    assert record.dated("compare").name == f"{first.name}-3"
    m = record.machine()
    assert m["isa"] in cpu_build.ISAS and m["kind"] in (*cpu_build.ISAS, "amx")
    assert f"kind {m['kind']}" in record.describe(m)


def test_jobs_past_the_deadline_are_cancelled_and_count_as_errors():
    import asyncio

    from stallfree.loadtest.clients import Result
    from stallfree.loadtest.runner import run_jobs
    from stallfree.loadtest.stats import summarize
    from stallfree.loadtest.workloads import Arrival

    class Slow:
        async def run(self, job, t0):
            await asyncio.sleep(job.max_tokens)
            return Result(job, 0.0, token_s=[0.01, 0.02])

    jobs = [Arrival(0.0, "a", 0), Arrival(0.0, "b", 30)]
    results = asyncio.run(run_jobs(Slow(), jobs, deadline_s=0.2))
    assert results[0].error is None and results[1].error.startswith("not done 0.2 s")
    assert summarize(results)["errors"] == 1
