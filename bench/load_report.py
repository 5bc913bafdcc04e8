"""``stallfree bench``: run a workload against a server and report TTFT, every
inter-token gap, max gap and throughput; sweep the token budget (the article's
tuning procedure) and plot the TTFT-TPOT frontier."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.loadgen import (
    Job,
    OpenAITarget,
    PromptMaker,
    Result,
    StallfreeTarget,
    Target,
    arrivals,
    interference_jobs,
    prompt_lengths,
    run_jobs,
    summarize,
    trace_jobs,
)
from core.model.gguf import GGUFFile
from core.model.loader import embedded_model_path
from core.model.tokenizer import Tokenizer


def make_jobs(args: argparse.Namespace, make: PromptMaker) -> list[Job]:
    rng = random.Random(args.seed)
    if args.workload == "interference":
        return interference_jobs(
            make, args.streams, args.long_prompts, args.long_tokens, args.long_delay_s, args.decode_tokens
        )
    if args.workload == "trace":
        if args.trace is None:
            raise ValueError("--workload trace needs --trace FILE")
        return trace_jobs(args.trace, make)
    times = arrivals(args.workload, args.requests, args.rate, rng)
    lengths = prompt_lengths(args.prompt, args.requests, rng)
    return [Job(t, make(n), args.output_tokens) for t, n in zip(times, lengths, strict=True)]


def target_for(args: argparse.Namespace) -> Target:
    scheme = urlsplit(args.target).scheme
    if scheme in ("ws", "wss"):
        return StallfreeTarget(args.target, args.api_key)
    if scheme in ("http", "https"):
        return OpenAITarget(args.target, args.model, args.api_key)
    raise ValueError(f"--target must be ws://... or http://..., not {args.target!r}")


def progress(done: int, total: int) -> None:
    width = 30
    filled = width * done // total
    print(f"\r  [{'#' * filled}{' ' * (width - filled)}] {done}/{total} requests", end="", file=sys.stderr)
    if done == total:
        print(file=sys.stderr)


def run_summary(results: list[Result], workload: str) -> dict[str, Any]:
    out = {"all": summarize(results)}
    if workload == "interference":
        out["decoders"] = summarize(results, "decoder")
        out["long"] = summarize(results, "long")
    return out


def set_config(target: str, api_key: str | None, changes: dict[str, Any]) -> dict[str, Any]:
    parts = urlsplit(target)
    base = f"{'https' if parts.scheme == 'wss' else 'http'}://{parts.netloc}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.put(base + "/api/config", json=changes, headers=headers, timeout=30)
    if r.status_code != 200:
        raise ValueError(f"PUT /api/config failed: {r.status_code} {r.text[:200]}")
    return r.json()["scheduler"]


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(embedded_model_path()).metadata)
    target = target_for(args)
    runs: list[dict[str, Any]] = []
    sweep: list[tuple[str, Any]] = [("", None)]
    if args.sweep:
        if not isinstance(target, StallfreeTarget):
            raise ValueError("--sweep reconfigures this server through /api/config; use a ws:// target")
        name, _, values = args.sweep.partition("=")
        sweep = [(name, int(v) if v.lstrip("-").isdigit() else v) for v in values.split(",")]
    for name, value in sweep:
        config = set_config(args.target, args.api_key, {name: value}) if name else None
        if name:
            print(f"{name} = {value}", file=sys.stderr)
        jobs = make_jobs(args, PromptMaker(tokenizer, args.seed + len(runs)))
        results = asyncio.run(run_jobs(target, jobs, progress))
        runs.append(
            {
                "setting": {name: value} if name else {},
                "config": config,
                **run_summary(results, args.workload),
                "streams": [[round(t, 4) for t in r.token_s] for r in results if r.job.group != "long"],
            }
        )
    report: dict[str, Any] = {"target": args.target, "workload": args.workload, "runs": runs}
    if args.sweep:
        report["slo"] = choose_from_sweep(runs, args.tpot_slo_ms)
    return report


def choose_from_sweep(runs: list[dict[str, Any]], slo_ms: float) -> dict[str, Any]:
    """The largest swept value whose p99 inter-token gap meets the TPOT SLO."""
    key = "decoders" if "decoders" in runs[0] else "all"
    ok = [r for r in runs if r[key]["itl_p99_ms"] <= slo_ms]
    best = max(ok, key=lambda r: next(iter(r["setting"].values()))) if ok else None
    return {"tpot_slo_ms": slo_ms, "metric": f"{key} itl_p99_ms", "best": best["setting"] if best else None}


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{report['workload']} against {report['target']}", ""]
    head = (
        f"  {'setting':<22} {'group':<9} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'ITL p50':>8} {'p90':>7} "
        f"{'p99':>7} {'max gap':>8} {'tok/s':>7}"
    )
    lines.append(head + "   (ms)")
    for run in report["runs"]:
        setting = ", ".join(f"{k}={v}" for k, v in run["setting"].items()) or "-"
        for group in ("all", "decoders", "long"):
            if group not in run:
                continue
            s = run[group]
            lines.append(
                f"  {setting:<22} {group:<9} {s['ttft_p50_ms']:>9.0f} {s['ttft_p90_ms']:>8.0f} {s['ttft_p99_ms']:>8.0f}"
                f" {s['itl_p50_ms']:>8.1f} {s['itl_p90_ms']:>7.1f} {s['itl_p99_ms']:>7.1f} {s['max_gap_ms']:>8.0f}"
                f" {s['throughput_tokens_per_s']:>7.0f}"
            )
            if "server_queue_wait_ms_p50" in s and group != "decoders":
                lines.append(
                    f"  {'':<22} {'':<9} server split p50: queue {s['server_queue_wait_ms_p50']:.0f}, "
                    f"prefill {s['server_prefill_ms_p50']:.0f}, decode {s['server_decode_ms_p50']:.0f}"
                )
            if s.get("errors"):
                lines.append(f"  {'':<22} {'':<9} {s['errors']} errors, first: {s.get('first_error')}")
    if "slo" in report:
        slo = report["slo"]
        lines += ["", f"  largest setting meeting {slo['metric']} <= {slo['tpot_slo_ms']:g} ms: {slo['best']}"]
    return "\n".join(lines)


def plot_report(report: dict[str, Any], out: Path) -> list[Path]:
    """ITL over time per stream (each run); for a sweep, TTFT and TPOT against the setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, run in enumerate(report["runs"]):
        fig, ax = plt.subplots(figsize=(9, 3.6))
        for stream in run["streams"]:
            if len(stream) > 1:
                ax.plot(stream[1:], [(b - a) * 1e3 for a, b in itertools.pairwise(stream)], lw=0.8)
        label = ", ".join(f"{k}={v}" for k, v in run["setting"].items()) or report["workload"]
        ax.set(xlabel="seconds since start", ylabel="inter-token gap (ms)", title=f"ITL per stream: {label}")
        ax.grid(alpha=0.3)
        path = out / f"itl-{i}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    if "slo" in report:
        key = "decoders" if "decoders" in report["runs"][0] else "all"
        ttft_key = "long" if "long" in report["runs"][0] else "all"
        xs = [next(iter(r["setting"].values())) for r in report["runs"]]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
        for pct in ("p50", "p99"):
            a1.plot(xs, [r[ttft_key][f"ttft_{pct}_ms"] for r in report["runs"]], marker="o", label=f"TTFT {pct}")
            a2.plot(xs, [r[key][f"itl_{pct}_ms"] for r in report["runs"]], marker="o", label=f"TPOT/ITL {pct}")
        a2.plot(xs, [r[key]["max_gap_ms"] for r in report["runs"]], marker="x", ls=":", label="max gap")
        a2.axhline(report["slo"]["tpot_slo_ms"], color="red", ls="--", label="TPOT SLO")
        best = report["slo"]["best"]
        if best:
            for ax in (a1, a2):
                ax.axvline(next(iter(best.values())), color="green", ls=":", label="chosen")
        for ax, title in ((a1, f"TTFT ({ttft_key})"), (a2, f"inter-token gaps ({key})")):
            ax.set(xlabel=next(iter(report["runs"][0]["setting"])), ylabel="ms", title=title)
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / "frontier.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
