"""Starting and stopping servers for the benchmarks (each in its own process)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results"
VLLM = ROOT / "bench" / "peers" / "vllm"  # install.sh, convert.sh and start.sh for the peer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def start_stallfree(*serve_args: str, log: Path | None = None, checkout: Path = ROOT) -> tuple[subprocess.Popen, int]:
    """`stallfree serve` on a free port with these options, once it is ready;
    checkout: the source tree to run it from (another one: a before/after comparison)."""
    port = free_port()
    cmd = [sys.executable, "-m", "cli", "--log-level", "warning", "serve", "--port", str(port), *serve_args]
    out = log.open("w") if log else None
    proc = subprocess.Popen(
        cmd,
        cwd=checkout,
        stdout=out,
        stderr=subprocess.STDOUT if out else None,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    wait_ready(f"http://127.0.0.1:{port}/readyz", proc)
    return proc, port


def start_vllm(port: int, log: Path, *flags: str) -> subprocess.Popen:
    """vLLM's OpenAI server (bench/peers/vllm/start.sh: its defaults, then ``flags``), once it is ready."""
    proc = subprocess.Popen(
        ["bash", str(VLLM / "start.sh"), str(port), *flags],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
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
