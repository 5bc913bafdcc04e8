"""Goodput on the client's side: refusals, each request judged against both
targets, and the goodput capacity's search (no servers)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from stallfree.core.analysis.capacity_search import SLO, Goodput, Search, Trial, search, trial_from
from stallfree.loadtest.clients import OpenAITarget, Result
from stallfree.loadtest.report import _extras
from stallfree.loadtest.stats import summarize
from stallfree.loadtest.workloads import Arrival


def result(sent_s: float, first_s: float, gaps_ms: list[float], **kw: Any) -> Result:
    """A request sent at ``sent_s`` whose tokens came from ``first_s`` on, ``gaps_ms`` apart."""
    tokens = [first_s]
    for gap in gaps_ms:
        tokens.append(tokens[-1] + gap / 1e3)
    return Result(Arrival(sent_s, "p", len(tokens)), sent_s, tokens, **kw)


def test_each_request_is_judged_by_its_ttft_and_its_own_p99_gap():
    steady = [100.0] * 99
    results = [
        result(0.0, 0.5, steady),  # good
        result(0.1, 0.6, steady),  # good
        result(0.2, 0.8, [*steady[:98], 900.0]),  # good: one slow gap of 99 is under its P99
        result(0.3, 2.6, steady),  # late: TTFT 2,300 ms
        result(0.4, 0.9, [100.0] * 90 + [400.0] * 9),  # its P99 gap 400 ms
        Result(Arrival(0.5, "p", 100), 0.5, refused_s=0.012, retry_after_s=2.0),  # shed
        Result(Arrival(0.6, "p", 100), 0.6, error="HTTP 500"),  # failed
    ]
    s = summarize(results, tbt_slo_ms=250.0, ttft_slo_ms=2000.0)
    assert s["requests"] == 7 and s["refused"] == 1 and s["errors"] == 1  # a refusal is not an error
    assert s["error_kinds"] == {"HTTP 500": 1}
    assert s["good_requests"] == 3
    assert s["good_share"] == 3 / 7  # the refused and the failed count as not good
    assert s["admitted_good_share"] == 3 / 6
    assert s["ttft_attainment"] == 4 / 7 and s["tbt_attainment"] == 4 / 7
    assert s["refusal_p50_ms"] == s["refusal_max_ms"] == 12.0 and s["retry_after_p50_s"] == 2.0
    no_ttft = summarize(results, tbt_slo_ms=250.0)
    assert no_ttft["good_requests"] == 4 and "ttft_attainment" not in no_ttft
    shown = " ".join(_extras(s))
    assert "3 of 7 good (42.9%)" in shown and "1 refused (429) in 12 ms" in shown


def test_best_effort_admissions_and_the_ttft_forecast_are_reported():
    late = result(0.0, 3.0, [50.0], predicted_ttft_ms=2500.0, best_effort=True)
    on_time = result(0.0, 0.5, [50.0], predicted_ttft_ms=500.0)
    s = summarize([late, on_time], tbt_slo_ms=250.0, ttft_slo_ms=2000.0)
    assert s["best_effort_requests"] == 1 and s["best_effort_good"] == 0
    assert s["ttft_over_predicted_p50"] == (3000 / 2500 + 1.0) / 2


def test_a_429_is_a_refusal_with_its_latency_and_retry_after():
    def reply(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, headers={"Retry-After": "3"}, json={"error": {"code": "overloaded"}})

    async def run() -> Result:
        target = OpenAITarget("http://stallfree.test/v1", "m")
        loop = id(asyncio.get_running_loop())
        target._clients = {loop: httpx.AsyncClient(base_url=target.base_url, transport=httpx.MockTransport(reply))}
        return await target.run(Arrival(0.0, "hello", 8), 0.0)

    res = asyncio.run(run())
    assert res.refused and res.error is None and res.retry_after_s == 3.0
    assert res.refused_s is not None and 0 <= res.refused_s < 5.0
    assert not res.judge(None, 250.0).good


def test_a_refused_request_still_fails_a_capacity_trial():
    summary = {"itl_p99_ms": 10.0, "scheduling_delay_p50_ms": 10.0, "ttft_p50_ms": 50.0, "errors": 0, "refused": 1}
    summary["good_share"] = 0.95
    trial = trial_from(1.0, summary)
    assert not trial.meets(SLO(100.0))  # capacity serves every request
    assert trial.meets(Goodput(0.9))  # goodput reads the good share alone


def test_the_goodput_search_finds_the_highest_rate_with_enough_good_requests():
    ran = []

    def run(rate: float) -> Trial:  # the good share falls with the rate: 100 % up to 4 req/s, then 5 % per req/s
        ran.append(rate)
        share = min(1.0, 1.0 - 0.05 * (rate - 4.0))
        return Trial(rate, tbt_p99_ms=1e9, scheduling_delay_p50_ms=1e9, errors=3, good_share=share)

    found = search(run, Goodput(0.9), first=1.0)
    assert 6.0 / 1.025 <= found.rate <= 6.0  # 90 % good at 6 req/s
    assert ran[:4] == [1.0, 2.0, 4.0, 8.0]
    assert found.at_capacity is not None and found.at_capacity.good_share >= 0.9
    bounded = Search(Goodput(0.9), first=1.0, max_trials=3)
    while (rate := bounded.next_rate()) is not None:
        bounded.record(run(rate))
    assert len(bounded.trials) == 3 and bounded.result.rate == 4.0  # --max-trials bounds a search


def test_the_simulators_requests_are_judged_by_the_benchmarks_targets():
    from bench.serving.goodput import TTFT_SLO_MS, simulated_good

    def row(ttft_ms: float, p99_ms: float, finish: str = "length") -> dict[str, object]:
        timings = {
            "queue_wait_ms": 0.0,
            "scheduling_delay_ms": 0.0,
            "prefill_ms": ttft_ms,
            "decode_ms": 1000.0,
            "ttft_ms": ttft_ms,
        }
        timings |= {"e2e_ms": ttft_ms + 1000, "itl_p50_ms": 50.0, "itl_p99_ms": p99_ms, "max_gap_ms": p99_ms}
        return {**timings, "stalled_gaps": 0, "finish_reason": finish, "good": True}

    rep = {
        "requests": {
            "a": row(500.0, 100.0),
            "b": row(TTFT_SLO_MS + 1, 100.0),  # late, whatever target the simulated server ran with
            "c": row(500.0, 300.0),
            "d": row(500.0, 100.0, "abort"),
        }
    }
    assert simulated_good(rep, 250.0) == 1


def test_the_benchmark_searches_alternate_and_write_the_tables_and_the_curves(tmp_path):
    from bench.serving import goodput

    settings = goodput.configs(230.0, 64, {"tbt_slo_ms": 150.0, "ttft_slo_ms": 2000.0, "tbt_stretch": 2.0})
    assert settings["stallfree-default"]["tbt_slo_ms"] == 150.0  # serve's own target, not the SLO
    assert settings["stallfree-default"]["tbt_stretch"] == 2.0 and settings["stallfree-unstretched"]["tbt_stretch"] == 1
    assert settings["stallfree-both"]["tbt_stretch"] == 1.0  # live settings carry over: the SLO holds
    simulated = {"Azure": {e: {"capacity_req_per_s": 4.0, "trials": []} for e in settings}}
    runs = [goodput.Run(e, "Azure", Search(Goodput(0.9), 4.0, max_trials=6), c) for e, c in settings.items()]
    edge = {"stallfree-default": 7.0, "stallfree-both": 8.0, "stallfree-shed": 9.0, "stallfree-tbt": 6.0}
    edge["stallfree-unstretched"] = 6.5
    edge["vllm-64"] = 5.0
    order = []

    def trial(r: goodput.Run, rate: float) -> Trial:  # 95 % good up to the configuration's edge, 50 % above
        order.append(r.engine)
        share = 0.95 if rate <= edge[r.engine] else 0.5
        refusals = [3.0, 4.0] if r.config and r.config["shed_load"] else []
        figures = {"good_share": share, "admitted_good_share": 0.96, "ttft_attainment": share}
        figures |= {"tbt_attainment": 1.0, "refused": len(refusals), "refusals_ms": refusals}
        figures |= {"ttft_p50_ms": 500.0, "ttft_p99_ms": 1900.0, "itl_p99_ms": 200.0}
        return Trial(rate, 200.0, 100.0, figures=figures, good_share=share)

    doc = {"command": "python -m bench.serving.goodput", "machine": goodput.machine(), "date": "2026-12-04"}
    doc |= {"dtype": "bfloat16", "profile": "p.json", "ttft_slo_ms": 2000.0, "criterion": Goodput(0.9).describe()}
    doc |= {"max_trials": 6, "tbt_slo_ms": 230.0, "slo_basis": "strict", "trials": []}
    doc["traces"] = {"Azure": {"file": "azure.csv", "replay": "the first 100"}}
    base = tmp_path / "goodput-2026-12-04"
    goodput.alternate(runs, trial, doc, base)
    assert order[:6] == list(settings)  # one trial of each configuration in turn
    assert all(len(r.search.trials) <= 6 for r in runs)
    found = {r.engine: r.search.result.rate for r in runs}
    assert 8.0 / 1.05 <= found["stallfree-both"] <= 8.0 and 7.0 / 1.05 <= found["stallfree-default"] <= 7.0
    goodput.shed_check(runs, trial, doc, base, {})
    check = doc["shed_check"][0]
    assert check["rate"] == 1.5 * found["vllm-64"] and check["passed"]
    goodput.more_rates(runs, trial, [2.0], doc, base)
    assert sum(t.get("more_rates", False) for t in doc["trials"]) == 6
    doc["table"] = goodput.goodput_table(runs, simulated)
    goodput.write(base, doc)
    md = base.with_suffix(".md").read_text()
    assert "| Azure | stallfree-both |" in md and ": done" in md
    vllm = found["vllm-64"]
    ratios = f"| {found['stallfree-default'] / vllm:.2f} | {found['stallfree-both'] / vllm:.2f} |"
    assert "default / vLLM" in md and ratios in md
    assert base.with_suffix(".png").stat().st_size > 0


def test_a_first_rate_given_starts_every_goodput_search_there():
    """``--first``: every configuration's search starts at that rate, else at the
    simulator's goodput capacity for it (never below 0.05 req/s)."""
    from bench.serving.capacity import TRACE_SPECS
    from bench.serving.goodput import plan

    trace = TRACE_SPECS["azure"]
    settings = {"stallfree-both": {"tbt_slo_ms": 150.0}, "vllm-64": None}
    simulated = {trace.name: {"stallfree-both": {"capacity_req_per_s": 3.0}, "vllm-64": {"capacity_req_per_s": 0.0}}}
    assert [r.search.next_rate() for r in plan([trace], settings, simulated, 5, 6.0)] == [6.0, 6.0]
    assert [r.search.next_rate() for r in plan([trace], settings, simulated, 5)] == [3.0, 0.05]
