"""64 prompts of about 7,900 tokens at once beside one decoding user, with and without a TBT target.

    .venv/bin/python -m bench.gateway.long_prompt_burst [--sim] [--seconds 60] [--tbt-slo-ms 200]

Issue 36 saw, on ``stallfree serve --sim`` with default settings, a decoding
user's median gap at 1.1 s and its worst at 21 s while such a burst
prefilled. The token budget caps an iteration's tokens, not its time, and a
chunk's attention grows with its prefix; this records the user's gaps (p50,
p99, worst, and each iteration's predicted time from the server's metrics)
under both configurations, one after the other on the same machine, and how
many of the burst's requests finished. Writes bench/results/long_prompt_burst-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import httpx

from bench.gateway.users import stream_user
from bench.record import dated, describe, machine, table
from bench.servers import StallfreeServer
from stallfree.core.sched.timings import percentile

BURST = 64


async def burst(url: str, finished: list[int]) -> None:
    limits = httpx.Limits(max_connections=BURST)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:

        async def one(i: int) -> None:
            body = {"prompt": f"{i} " + "lorem ipsum " * 1575, "max_tokens": 16}  # distinct: no prefix hits
            r = await http.post("/v1/completions", json=body)
            finished.append(r.status_code)

        await asyncio.gather(*(one(i) for i in range(BURST)))


async def measure(server: StallfreeServer, seconds: float) -> dict[str, Any]:
    gaps: list[float] = []
    finished: list[int] = []
    stop_at = time.perf_counter() + seconds
    flood = asyncio.create_task(burst(server.url, finished))
    await asyncio.sleep(0.5)  # the burst is in before the user starts
    await stream_user(server.ws_url, stop_at, gaps, prompt="hi", cut_at_stop=True)
    flood.cancel()
    return {
        "gaps": len(gaps),
        "gap_p50_ms": round(percentile(gaps, 50), 1),
        "gap_p99_ms": round(percentile(gaps, 99), 1),
        "gap_max_ms": round(max(gaps), 1),
        "burst_finished": len(finished),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sim", action="store_true", help="the simulated runner instead of the embedded model")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--tbt-slo-ms", type=float, default=200.0, help="the target of the second configuration")
    args = ap.parse_args()
    base = ["--sim"] if args.sim else ["--threads", "1"]
    runs = []
    for target in (0.0, args.tbt_slo_ms):
        server = StallfreeServer(*base, "--tbt-slo-ms", f"{target:g}", "--ttft-slo-ms", "0")
        try:
            result = {"tbt_slo_ms": target, **asyncio.run(measure(server, args.seconds))}
        finally:
            server.stop()
        print(json.dumps(result))
        runs.append(result)
    write(args, runs)


def write(args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    m = machine()
    path = dated("long_prompt_burst")
    command = "python -m bench.gateway.long_prompt_burst" + (" --sim" if args.sim else "")
    command += f" --seconds {args.seconds:g} --tbt-slo-ms {args.tbt_slo_ms:g}"
    path.with_suffix(".json").write_text(json.dumps({"command": command, "machine": m, "runs": runs}, indent=1))
    lines = [
        f"# {BURST} prompts of about 7,900 tokens at once beside one decoding user",
        "",
        f"`{command}` on {describe(m)}, {time.strftime('%Y-%m-%d')}; "
        f"{'simulated runner (CPU-like cost model)' if args.sim else 'the embedded model, 1 thread'}, "
        "default token budget (512); one configuration after the other.",
        "",
    ]
    header = ["TBT target", "user's gaps", "p50 ms", "p99 ms", "worst ms", f"of the {BURST} finished"]
    keys = ("gaps", "gap_p50_ms", "gap_p99_ms", "gap_max_ms", "burst_finished")
    cells = [[f"{r['tbt_slo_ms']:g} ms" if r["tbt_slo_ms"] else "none (default)", *(r[k] for k in keys)] for r in runs]
    lines += table(header, cells, "lrrrrr")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
