"""The busy neighbour of the capacity bench: it works while its block runs, then is gone."""

import os
import time

import pytest

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


def test_no_neighbour_at_zero_and_a_bad_duty_is_refused():
    with neighbour(0.0) as proc:
        assert proc is None
    with pytest.raises(ValueError, match="share of the time"), neighbour(1.5):
        pass
