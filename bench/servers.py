"""Starting and stopping servers for the benchmarks (each in its own process)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")  # the kernel's range for port 0 (Linux)
OUT = ROOT / "bench" / "results"
VLLM = ROOT / "bench" / "peers" / "vllm"  # install.sh, convert.sh and start.sh for the peer
# `stallfree serve` on the model holds TBT and TTFT targets of its own unless told (core.analysis.targets):
# a run of a fixed token budget, or that sets its targets live, starts without
NO_TARGETS = ("--tbt-slo-ms", "0", "--ttft-slo-ms", "0")


def tree_env(checkout: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment to run a checkout's code in: another checkout than this
    one compiles its kernels into a cache of its own, since one cache for two
    source trees was rebuilt at every switch between them (under a server
    that had loaded it, at that). ``env``: added to this process's environment,
    as ``start_vllm`` takes it: a server given only its own variables once
    started without PATH, found no compiler and ran the torch reference."""
    env = {**os.environ, **(env or {})}
    if checkout.resolve() != ROOT:
        env["STALLFREE_KERNEL_CACHE"] = str(Path.home() / ".cache" / "stallfree" / f"kernels-{checkout.resolve().name}")
    return env


def free_port() -> int:
    """A port free now, for a server that binds it a few seconds later. Not one
    the kernel hands out for port 0 (its ephemeral range), nor Ray's worker
    ports (10002-19999): a server started beside Ray lost its port to one
    while connecting to the cluster ("address already in use", test_scaleout)."""
    low = int(EPHEMERAL_PORTS.read_text().split()[0]) if EPHEMERAL_PORTS.exists() else 0
    for _ in range(100):
        port = random.randrange(20000, low) if low > 20000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port found")


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see its log")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


class StallfreeServer:
    """``stallfree serve`` in its own process (and process group) on a free port,
    ready once constructed: the one launcher of the benchmarks and the tests.
    checkout: the source tree to run (another one: a before/after comparison);
    env: added to this process's environment;
    log: where its output goes (default: this process's)."""

    def __init__(
        self,
        *serve_args: str,
        log: Path | None = None,
        checkout: Path = ROOT,
        env: dict[str, str] | None = None,
        log_level: str = "warning",
        ready_timeout_s: float = 600,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/stream"
        cmd = [
            sys.executable,
            "-m",
            "stallfree.cli",
            "--log-level",
            log_level,
            "serve",
            "--port",
            str(self.port),
            *serve_args,
        ]
        out = log.open("w") if log else None
        self.proc = subprocess.Popen(
            cmd,
            cwd=checkout,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            env={**tree_env(checkout, env), "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        wait_ready(self.url + "/readyz", self.proc, ready_timeout_s)

    def kv_used(self) -> int:
        return int(httpx.get(self.url + "/api/config", timeout=10).json()["kv_cache"]["used_blocks"])

    def wait_kv_baseline(self, timeout: float = 10.0) -> int:
        """KV blocks in use once back to 0 (or as they stood at the deadline)."""
        deadline = time.monotonic() + timeout
        while (used := self.kv_used()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return used

    def stop(self) -> int | None:
        """Stop it and everything it started; its exit status."""
        stop(self.proc)
        return self.proc.returncode


def start_vllm(port: int, log: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """vLLM's OpenAI server (bench/peers/vllm/start.sh: its defaults, then ``flags``), once it is ready;
    ``env``: added to this process's environment."""
    proc = subprocess.Popen(
        ["bash", str(VLLM / "start.sh"), str(port), *flags],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    wait_ready(f"http://127.0.0.1:{port}/v1/models", proc)
    return proc


def stop(proc: subprocess.Popen) -> None:
    """Stop a server and everything it started (its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def busy_cores(window_s: float) -> float:
    """Cores the whole machine kept busy over the next ``window_s`` seconds
    (/proc/stat: user, nice, system, irq and softirq time; not the hypervisor's steal)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
        busy = user + nice + system + irq + softirq
        return busy, busy + idle + iowait + steal

    before = sample()
    time.sleep(window_s)
    after = sample()
    total = after[1] - before[1]
    return (after[0] - before[0]) / total * (os.cpu_count() or 1) if total else 0.0


def wait_quiet(most_cores: float = 0.2, window_s: float = 0.5, timeout_s: float = 20.0) -> bool:
    """Until the machine keeps fewer than ``most_cores`` busy over a window (True),
    or ``timeout_s`` passes (False, said on stderr). vLLM's engine keeps a core
    busy for about a second after its last request ends (0.96-1.02 cores over
    two half-seconds, 2-core Zen 4, 2 threads), and a run started then shared
    the machine with it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if busy_cores(window_s) < most_cores:
            return True
    print(f"the machine did not go quiet in {timeout_s:g} s: something else is running", file=sys.stderr)
    return False
