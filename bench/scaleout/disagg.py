"""Disaggregated prefill/decode against chunked and unchunked prefill on the
same two engines, on the real model, with the simulator's prediction beside.

    .venv/bin/stallfree profile --threads 1 --save profile.json   # this machine's cost model
    .venv/bin/python -m bench.scaleout.disagg --profile profile.json [--repeats 2]

Three `stallfree serve` set-ups, each two engines of 1 torch thread on Ray
Serve, started in turn and alternated: ``--disaggregate 1:1`` (a prefill
and a decode replica, prompts' KV through Ray's object store); ``--replicas
2`` with chunked prefill (token budget 256); ``--replicas 2`` unchunked. The
colocated pairs route ``least_loaded``: the streams spread over both
replicas, as a balanced load would, and each long prompt lands beside two of
them. (The cost router may instead keep the streams on one replica and send
the long prompts to the other, which is disaggregation by accident.)
The workload: 4 streams decoding while long prompts arrive one by one. For
the running streams: their ITL p99 and max gap; for the long prompts: TTFT,
which when disaggregated includes the KV transfer.

The prediction replays the same arrivals through ``simulate_disaggregated``
and ``simulate_colocated`` with the profile's cost model and a KV link as
fast as a probe measured: one Ray actor puts a long prompt's KV (the
runner's payload: the bytes of K and V of its blocks), another gets it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.record import dated, describe, machine, table
from bench.servers import StallfreeServer
from stallfree.core.analysis.disagg_plan import Link
from stallfree.core.analysis.disagg_sim import simulate_colocated, simulate_disaggregated
from stallfree.core.analysis.profiler import Profile
from stallfree.core.analysis.simulator import make_arrival
from stallfree.core.model.embedded import load_tokenizer
from stallfree.core.model.tokenizer import Tokenizer
from stallfree.core.sched.config import CacheConfig, Chunking, SchedulerConfig
from stallfree.core.sched.timings import percentile
from stallfree.loadtest.clients import Result, StallfreeTarget
from stallfree.loadtest.runner import run_jobs
from stallfree.loadtest.workloads import Arrival, PromptMaker

BUDGET = 256
COMMON = ("--threads", "1", "--kv-cache-gib", "1", "--max-model-len", "4096", "--token-budget", str(BUDGET))
SETUPS: dict[str, tuple[str, ...]] = {
    "disaggregated 1:1": ("--disaggregate", "1:1"),
    # least_loaded spreads the streams over both replicas, so each long prompt lands beside two of them
    "chunked, 2 colocated": ("--replicas", "2", "--router", "least_loaded"),
    "unchunked, 2 colocated": ("--replicas", "2", "--router", "least_loaded", "--chunking", "none"),
}
DECODERS, DECODER_PROMPT, DECODER_TOKENS = 4, 32, 400


def workload(args: argparse.Namespace) -> list[tuple[float, str, int, int]]:
    """(arrival s, group, prompt tokens, output tokens)."""
    jobs = [(0.0, "decoder", DECODER_PROMPT, DECODER_TOKENS) for _ in range(DECODERS)]
    return jobs + [(2.0 + args.every_s * i, "long", args.long_tokens, 8) for i in range(args.longs)]


def measured(results: list[Result]) -> dict[str, float]:
    dec = [r for r in results if r.job.group == "decoder" and r.error is None]
    longs = [r.ttft_s * 1e3 for r in results if r.job.group == "long" and r.ttft_s is not None]
    gaps = [g * 1e3 for r in dec for g in r.gaps_s]
    return {
        "decoder_itl_p99_ms": percentile(gaps, 99),
        "decoder_max_gap_ms": max(gaps, default=0.0),
        "long_ttft_p50_ms": statistics.median(longs) if longs else 0.0,
        "long_ttft_max_ms": max(longs, default=0.0),
        "errors": sum(1 for r in results if r.error),
    }


def predicted(report: dict[str, Any]) -> dict[str, float]:
    """The simulator's figures for the same groups (ITL p99: the worst decoder's own p99)."""
    reqs = report["requests"]
    dec = [r for rid, r in reqs.items() if rid.startswith("decoder")]
    longs = [r["ttft_ms"] for rid, r in reqs.items() if rid.startswith("long")]
    return {
        "decoder_itl_p99_ms": max(r["itl_p99_ms"] for r in dec),
        "decoder_max_gap_ms": max(r["max_gap_ms"] for r in dec),
        "long_ttft_p50_ms": statistics.median(longs),
        "long_ttft_max_ms": max(longs),
        "transfer_p50_ms": report["summary"]["transfer_p50_ms"],
    }


def probe_link(kv_bytes_per_token: int, tokens: int, repeats: int = 5) -> dict[str, float]:
    """Put a long prompt's KV payload in one Ray actor, get it in another: median time and Gbit/s."""
    import ray

    from stallfree.scaleout.app import start_ray

    start_ray(None, 2, 1, object_store_gib=1.0)

    @ray.remote(num_cpus=0)
    class Sender:
        def send(self, nbytes: int) -> tuple[list[Any], float]:
            import numpy as np

            half = np.zeros(nbytes // 2, dtype=np.uint8)  # K or V, as ModelRunner.export_kv gives them
            start = time.perf_counter()
            ref = ray.put(("bfloat16", half, half.copy()))
            return [ref], time.perf_counter() - start

    @ray.remote(num_cpus=0)
    class Receiver:
        def receive(self, refs: list[Any]) -> float:
            start = time.perf_counter()
            ray.get(refs[0])
            return time.perf_counter() - start

    sender, receiver = Sender.remote(), Receiver.remote()  # type: ignore[attr-defined]
    nbytes = kv_bytes_per_token * tokens
    times = []
    for _ in range(repeats):
        refs, put_s = ray.get(sender.send.remote(nbytes))
        times.append(put_s + ray.get(receiver.receive.remote(refs)))
    ray.shutdown()
    t = statistics.median(times)
    return {"bytes": nbytes, "median_ms": t * 1e3, "min_ms": min(times) * 1e3, "gbps": nbytes * 8 / t / 1e9}


def predict(args: argparse.Namespace, profile: Profile, link: Link) -> dict[str, dict[str, float]]:
    arrivals = [
        make_arrival(at, f"{group}{i}", prompt, out) for i, (at, group, prompt, out) in enumerate(workload(args))
    ]
    config = SchedulerConfig(max_num_seqs=64, max_model_len=4096, token_budget=BUDGET)
    cache, cost = CacheConfig(8192, 16), profile.cost_model
    unchunked = dataclasses.replace(config, chunking=Chunking.NONE)
    return {
        "disaggregated 1:1": predicted(simulate_disaggregated(arrivals, 1, 1, link, config, cache, cost)),
        "chunked, 2 colocated": predicted(simulate_colocated(arrivals, 2, config, cache, cost)),
        "unchunked, 2 colocated": predicted(simulate_colocated(arrivals, 2, unchunked, cache, cost)),
    }


GREEDY_PROMPTS = (40, 300, 1000, 2000)  # tokens: within a block, a chunk, several chunks


def greedy(port: int, prompts: list[str]) -> list[str]:
    """Each prompt's 32 greedy tokens, as text."""
    body = {"model": "x", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    url = f"http://127.0.0.1:{port}/v1/completions"
    return [httpx.post(url, json={**body, "prompt": p}, timeout=300).json()["choices"][0]["text"] for p in prompts]


def run(args: argparse.Namespace, tokenizer: Tokenizer) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """Each set-up's measured rows, and (first round) its greedy texts for GREEDY_PROMPTS."""
    rows, texts = [], {}
    greedy_prompts = [PromptMaker(tokenizer, 7)(n) for n in GREEDY_PROMPTS]
    for rep in range(args.repeats):
        for setup, extra in SETUPS.items():
            server = StallfreeServer(*COMMON, *extra, "--stats-period-s", "0.5")
            port = server.port
            try:
                if rep == 0:
                    texts[setup] = greedy(port, greedy_prompts)
                make = PromptMaker(tokenizer, 100 + rep)
                jobs = [Arrival(at, make(prompt), out, group) for at, group, prompt, out in workload(args)]
                target = StallfreeTarget(f"ws://127.0.0.1:{port}/v1/stream")
                asyncio.run(run_jobs(target, [Arrival(0.0, make(args.long_tokens), 2, "warm-up") for _ in range(2)]))
                results = asyncio.run(run_jobs(target, jobs))
            finally:
                server.stop()
            rows.append({"setup": setup, "repeat": rep, **measured(results)})
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows, texts


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} [{min(values):,.0f}–{max(values):,.0f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", type=Path, required=True, help="`stallfree profile --threads 1` of this machine")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--long-tokens", type=int, default=1500)
    ap.add_argument("--longs", type=int, default=3)
    ap.add_argument("--every-s", type=float, default=3.0, help="between long prompts")
    args = ap.parse_args()
    profile = Profile.load(args.profile)
    spec = profile.cost_model.model
    probe = probe_link(spec.kv_bytes_per_token, args.long_tokens)
    print(json.dumps({"link_probe": probe}), file=sys.stderr)
    prediction = predict(args, profile, Link(probe["gbps"], 0.0))
    tokenizer = load_tokenizer()
    rows, texts = run(args, tokenizer)
    reference = texts["chunked, 2 colocated"]
    agreement = {setup: sum(a == b for a, b in zip(t, reference, strict=True)) for setup, t in texts.items()}

    m = machine()
    command = ("python -m bench.scaleout.disagg " + " ".join(sys.argv[1:])).strip()
    base = dated("disagg")
    record: dict[str, Any] = {"command": command, "machine": m, "args": vars(args), "link_probe": probe}
    record |= {"prediction": prediction, "rows": rows, "greedy_texts": texts, "greedy_agreement": agreement}
    base.with_suffix(".json").write_text(json.dumps(record, indent=2, default=str))
    keys = [
        ("decoder_itl_p99_ms", "streams' ITL p99 ms"),
        ("decoder_max_gap_ms", "streams' max gap ms"),
        ("long_ttft_p50_ms", "long TTFT p50 ms"),
        ("long_ttft_max_ms", "long TTFT max ms"),
    ]
    lines = [
        f"# Disaggregated 1:1 vs chunked and unchunked on 2 colocated replicas: {DECODERS} streams decoding, "
        f"{args.longs} prompts of {args.long_tokens:,} tokens arriving {args.every_s:g} s apart",
        "",
        f"`{command}` on {describe(m)}. Embedded SmolLM2-135M, 1 torch thread per replica, token budget {BUDGET}; "
        f"set-ups alternate, {args.repeats} runs each: median [min–max]. Predicted: the simulator on the same "
        f"arrivals with the cost model of `{args.profile}` (ITL p99 there: the worst stream's own p99).",
        "",
        f"KV link probe (Ray object store, actor to actor, {probe['bytes'] / 2**20:,.1f} MiB): "
        f"{probe['median_ms']:,.1f} ms median, {probe['gbps']:,.2f} Gbit/s; the prediction's link.",
        "",
    ]
    header = [
        "set-up",
        *(f"{title} {kind}" if kind == "measured" else kind for _, title in keys for kind in ("measured", "predicted")),
        "errors",
    ]
    cells = []
    for setup in SETUPS:
        rs = [r for r in rows if r["setup"] == setup]
        pairs = [x for k, _ in keys for x in (cell([r[k] for r in rs]), f"{prediction[setup][k]:,.0f}")]
        cells.append([setup, *pairs, sum(r["errors"] for r in rs)])
    lines += table(header, cells, "l" + "rr" * len(keys) + "r")
    lines += [
        "",
        f"Greedy output (32 tokens for prompts of {', '.join(map(str, GREEDY_PROMPTS))} tokens) equal to chunked "
        "colocated serving's: " + ", ".join(f"{setup} {n}/{len(GREEDY_PROMPTS)}" for setup, n in agreement.items()),
        "",
    ]
    base.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
