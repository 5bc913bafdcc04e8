"""`stallfree plan --disaggregate`: the arithmetic against hand-computed values."""

from __future__ import annotations

import math
import subprocess
import sys

import orjson
import pytest

from stallfree.core.analysis.cost_model import CostModel
from stallfree.core.analysis.disagg_plan import Link, colocated, compare, disaggregated, md1_wait_s

COST = CostModel()  # the article's 8B model (131,072 KV bytes a token) on its 400 TFLOP/s, 3 TB/s GPU
IDLE = 1e-9  # prompts/s: no queueing


def test_kv_bytes_and_transfer_time_by_hand():
    d = disaggregated(COST, 1, 1, Link(100, 0.001), 8192, IDLE, 64)
    assert d["kv_bytes"] == 8192 * 131072 == 2**30
    assert d["transfer_ms"] == pytest.approx(1 + 2**30 * 8 / 100e9 * 1e3)  # 86.90 ms
    assert d["prefill_ms"] == pytest.approx(2 * 8e9 * 8192 / 400e12 * 1e3)  # 327.68 ms, compute-bound
    assert d["max_gap_ms"] == d["itl_ms"] == pytest.approx(16e9 / 3e12 * 1e3)  # 5.33 ms: weight reads
    assert d["ttft_ms"] == pytest.approx(327.68 + 86.899 + 5.333, abs=0.01)


def test_queueing_at_the_prefill_worker_and_on_the_link_is_md1():
    d = disaggregated(COST, 1, 1, Link(100), 8192, 1.0, 64)
    service, xfer = 0.32768, 2**30 * 8 / 100e9
    wait = service * service / (2 * (1 - service)) + xfer * xfer / (2 * (1 - xfer))  # util = rate x service
    assert d["prefill_utilization"] == pytest.approx(service)
    assert d["ttft_ms"] == pytest.approx((wait + service + xfer + 16e9 / 3e12) * 1e3)
    assert math.isinf(md1_wait_s(1.0, 1.0))
    assert math.isinf(disaggregated(COST, 1, 1, Link(100), 8192, 4.0, 64)["ttft_ms"])  # 4 x 0.33 s > 1


def test_chunked_on_the_same_workers_by_hand():
    c = colocated(COST, 2, 8192, IDLE, 64, 576)
    # 32 decoders a worker leave 544 tokens of the budget: 8,192 needs 16 such iterations,
    # the scheduler's even chunks of 512, each beside the 32 decodes: 544 tokens, 21.76 ms
    assert c["decoders_per_worker"] == 32 and c["chunks"] == 16
    assert c["max_gap_ms"] == pytest.approx(2 * 8e9 * 544 / 400e12 * 1e3)
    assert c["ttft_ms"] == pytest.approx(16 * 21.76, abs=0.01)
    assert c["itl_p99_ms"] == pytest.approx(16e9 / 3e12 * 1e3)  # no prompts arriving: plain decode steps
    busy = colocated(COST, 2, 8192, 2.0, 64, 576)
    assert busy["itl_p99_ms"] == pytest.approx(21.76) and busy["itl_ms"] > c["itl_ms"]


def test_the_table_says_who_wins_where():
    doc = compare(COST, 1, 3, Link(400), (1024, 32768), (0.5, 4.0))
    rows = {(r["prompt_tokens"], r["rate_per_s"]): r for r in doc["rows"]}
    assert all(r["max_gap_winner"] == "disaggregated" for r in rows.values())  # no prefill beside its decodes
    assert rows[(1024, 0.5)]["ttft_winner"] == "chunked"  # four workers prefill, not one, and no transfer
    assert rows[(32768, 4.0)]["ttft_winner"] == "neither"  # 4/s x 1.4 s of prefill saturates both sides
    with pytest.raises(ValueError, match="at least one prefill"):
        compare(COST, 0, 1, Link(100), (1024,), (1.0,))


def test_plan_disaggregate_command_json_and_errors():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "stallfree.cli",
            "plan",
            "--disaggregate",
            "2:2",
            "--link-gbps",
            "200",
            "--prompts",
            "4096",
            "--rates",
            "1",
            "--json",
        ],
        check=True,
        capture_output=True,
    ).stdout
    doc = orjson.loads(out)
    assert (doc["prefill_workers"], doc["decode_workers"], doc["link_gbps"]) == (2, 2, 200)
    assert doc["rows"][0]["disaggregated"]["transfer_ms"] == pytest.approx(4096 * 131072 * 8 / 200e9 * 1e3)
    bad = subprocess.run(
        [sys.executable, "-m", "stallfree.cli", "plan", "--disaggregate", "0:2"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "P and D must be >= 1" in bad.stderr
