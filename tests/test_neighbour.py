"""The busy neighbour of the capacity bench: it works while its block runs, then is gone."""

import os
import subprocess
import sys
import time

import pytest

from bench.servers import busy_cores, wait_quiet
from bench.serving.neighbour import neighbour


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_the_neighbour_works_its_share_and_stops():
    with neighbour(0.5) as proc:
        assert proc is not None
        deadline = time.monotonic() + 30
        while cpu_s(proc.pid) < 0.2 and time.monotonic() < deadline:  # it starts, imports, then copies
            proc.poll()
            assert proc.returncode is None
            time.sleep(0.05)
        assert cpu_s(proc.pid) >= 0.2
    assert proc.returncode is not None  # terminated and reaped


@pytest.mark.slow  # reads the whole machine's load: not beside another test worker
def test_a_run_waits_for_the_machine_to_go_quiet():
    """A process spinning on a core (as vLLM's engine does for a second after
    its last request) keeps the machine from being quiet; once it is gone, the
    wait ends."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert busy_cores(0.3) > 0.5
        assert not wait_quiet(timeout_s=1.0)
    finally:
        spinner.kill()
        spinner.wait()
    assert wait_quiet(most_cores=0.5, timeout_s=20.0)


def test_no_neighbour_at_zero_and_a_bad_duty_is_refused():
    with neighbour(0.0) as proc:
        assert proc is None
    with pytest.raises(ValueError, match="share of the time"), neighbour(1.5):
        pass


def test_the_contention_bench_keeps_quiet_and_busy_trials_apart(tmp_path):
    """Quiet and beside-the-neighbour searches of one engine alternate on the
    same rates; each capacity is read from its own trials only."""
    from bench.record import machine
    from bench.serving.capacity import alternate
    from bench.serving.contention import SLO, plan, report
    from stallfree.core.analysis.capacity_search import trial_from

    runs = plan("trace", SLO(100.0), [1.0, 0.5], duty=0.25, budget=64, max_trials=8)
    assert [(r.engine, r.neighbour) for r in runs] == [
        ("stallfree-tbt", 0.0),
        ("stallfree-tbt", 0.25),
        ("vllm-64", 0.0),
        ("vllm-64", 0.25),
    ]
    order = []

    def trial(r, rate):  # P99 grows with the rate; the neighbour adds a quarter
        order.append((r.engine, r.neighbour))
        p99 = rate * (10.0 if r.engine == "stallfree-tbt" else 40.0) * (1.25 if r.neighbour else 1.0)
        return trial_from(rate, {"itl_p99_ms": p99, "scheduling_delay_p50_ms": 0.0, "ttft_p50_ms": 0.0})

    doc = {"trials": [], "command": "c", "machine": machine(), "date": "d", "dtype": "bfloat16"}
    doc |= {"trace": "trace", "replay": "r", "slo": "s", "duty": 0.25}
    alternate(runs, trial, doc, tmp_path / "contention")
    assert order[:4] == [(r.engine, r.neighbour) for r in runs]  # one trial each, in turn
    assert all(t.get("neighbour", 0.0) in (0.0, 0.25) for t in doc["trials"])
    report(runs, doc, tmp_path / "contention")
    ratios = {row["engine"]: row["ratio"] for row in doc["contention"]}
    assert ratios["stallfree-tbt"] == pytest.approx(0.8, rel=0.06)  # 10 -> 8 req/s, to the search's 2.5 %
    assert ratios["vllm-64"] == pytest.approx(0.8, rel=0.06)
    quiet = doc["contention"][0]["quiet"]
    assert quiet["runs_at_capacity"].startswith("1/1 met")  # the busy search's trials at that rate not counted
    assert (
        f"stallfree-tbt: beside the neighbour / quiet **{ratios['stallfree-tbt']:.2f}**"
        in (tmp_path / "contention.md").read_text()
    )
