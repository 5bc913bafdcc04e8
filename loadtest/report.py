"""``stallfree bench``: run a workload against a server and report TTFT,
scheduling delay, every inter-token gap, max gap, throughput, goodput and
prefix hits; replay a production trace; sweep the token budget or the TBT
target (the article's tuning procedure, on replayed traffic) and plot TTFT
and TBT percentiles against it."""

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
from tqdm import tqdm

from stallfree.core.analysis.traces import read_trace, replay
from stallfree.core.model.embedded import load_tokenizer
from stallfree.core.model.tokenizer import Tokenizer
from stallfree.loadtest.clients import OpenAITarget, Result, StallfreeTarget, Target
from stallfree.loadtest.runner import SchedulingDelayProbe, run_jobs
from stallfree.loadtest.stats import summarize
from stallfree.loadtest.workloads import (
    Arrival,
    PromptMaker,
    WordPrompts,
    arrivals,
    interference_jobs,
    prompt_lengths,
    trace_jobs,
)


def workload(args: argparse.Namespace) -> str:
    return args.workload or ("trace" if args.trace else "interference")


def make_jobs(args: argparse.Namespace, tokenizer: Tokenizer, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    kind = workload(args)
    if kind == "trace":
        if args.trace is None:
            raise ValueError("--workload trace needs --trace FILE")
        return trace_jobs(replay(read_trace(args.trace), args.replay), WordPrompts(tokenizer, seed))
    make = PromptMaker(tokenizer, seed)
    if kind == "interference":
        return interference_jobs(
            make, args.streams, args.long_prompts, args.long_tokens, args.long_delay_s, args.decode_tokens
        )
    times = arrivals(kind, args.requests, args.rate or 2.0, rng)
    lengths = prompt_lengths(args.prompt, args.requests, rng)
    return [Arrival(t, make(n), args.output_tokens) for t, n in zip(times, lengths, strict=True)]


def target_for(args: argparse.Namespace) -> Target:
    scheme = urlsplit(args.target).scheme
    if scheme in ("ws", "wss"):
        return StallfreeTarget(args.target, args.api_key)
    if scheme in ("http", "https"):
        return OpenAITarget(args.target, args.model, args.api_key)
    raise ValueError(f"--target must be ws://... or http://..., not {args.target!r}")


def metrics_url(target: str) -> str:
    parts = urlsplit(target)
    return f"{'https' if parts.scheme in ('https', 'wss') else 'http'}://{parts.netloc}/metrics"


def replay_jobs(
    target: Target, jobs: list[Arrival], url: str | None = None, deadline_s: float | None = None
) -> tuple[list[Result], float | None]:
    """Run the jobs (a progress bar on stderr; those not done ``deadline_s`` after
    the start are cancelled); with ``url``, the median queue wait the server's
    /metrics histogram counted meanwhile (for servers whose responses do not carry it)."""
    probe = SchedulingDelayProbe(url) if url else None
    with tqdm(total=len(jobs), unit="req", file=sys.stderr, leave=False) as bar:
        results = asyncio.run(run_jobs(target, jobs, lambda done, total: bar.update(1), deadline_s))
    return results, probe.median_ms() if probe is not None else None


def run_summary(
    results: list[Result],
    kind: str,
    tbt_slo_ms: float | None = None,
    scheduling_delay_ms: float | None = None,
    ttft_slo_ms: float | None = None,
) -> dict[str, Any]:
    out = {
        "all": summarize(
            results, tbt_slo_ms=tbt_slo_ms, scheduling_delay_ms=scheduling_delay_ms, ttft_slo_ms=ttft_slo_ms
        )
    }
    if kind == "interference":
        out["decoders"] = summarize(results, "decoder", tbt_slo_ms, ttft_slo_ms=ttft_slo_ms)
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
    tokenizer = load_tokenizer()
    target = target_for(args)
    kind = workload(args)
    runs: list[dict[str, Any]] = []
    sweep: list[tuple[str, Any]] = [("", None)]
    if args.sweep:
        if not isinstance(target, StallfreeTarget):
            raise ValueError("--sweep reconfigures this server through /api/config; use a ws:// target")
        name, _, values = args.sweep.partition("=")
        sweep = [(name, _number(v)) for v in values.split(",")]
    url = metrics_url(args.target) if isinstance(target, OpenAITarget) else None
    for name, value in sweep:
        config = set_config(args.target, args.api_key, {name: value}) if name else None
        if name:
            print(f"{name} = {value}", file=sys.stderr)
        jobs = make_jobs(args, tokenizer, args.seed + len(runs))
        results, scheduling_delay_ms = replay_jobs(target, jobs, url)
        runs.append(
            {
                "setting": {name: value} if name else {},
                "config": config,
                **run_summary(results, kind, args.tbt_slo_ms, scheduling_delay_ms, args.ttft_slo_ms),
                "streams": [[round(t, 4) for t in r.token_s] for r in results if r.job.group != "long"],
            }
        )
    report: dict[str, Any] = {
        "target": args.target,
        "workload": kind,
        "command": "stallfree bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None,
    }
    if kind == "trace":
        report["trace"] = {"file": str(args.trace), "replay": args.replay.describe(), "seed": args.seed}
    report["runs"] = runs
    if args.sweep:
        report["slo"] = choose_from_sweep(runs, args.tbt_slo_ms)
    return report


def _number(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def choose_from_sweep(runs: list[dict[str, Any]], slo_ms: float) -> dict[str, Any]:
    """The largest swept value whose p99 inter-token gap meets the TBT SLO."""
    key = "decoders" if "decoders" in runs[0] else "all"
    ok = [r for r in runs if r[key]["itl_p99_ms"] <= slo_ms]
    best = max(ok, key=lambda r: next(iter(r["setting"].values()))) if ok else None
    return {"tbt_slo_ms": slo_ms, "metric": f"{key} itl_p99_ms", "best": best["setting"] if best else None}


def _rows(report: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(setting, group, summary) for every run and group of a report."""
    rows = []
    for run in report["runs"]:
        setting = ", ".join(f"{k}={v}" for k, v in run["setting"].items()) or "-"
        rows += [(setting, group, run[group]) for group in ("all", "decoders", "long") if group in run]
    return rows


def _extras(s: dict[str, Any]) -> list[str]:
    """What a summary holds beyond the latency columns, as short phrases."""
    out = []
    if "server_queue_wait_ms_p50" in s:
        out.append(
            f"server split p50: queue {s['server_queue_wait_ms_p50']:.0f}, prefill {s['server_prefill_ms_p50']:.0f}, "
            f"decode {s['server_decode_ms_p50']:.0f} ms"
        )
    elif "scheduling_delay_p50_ms" in s:
        out.append(f"scheduling delay p50 {s['scheduling_delay_p50_ms']:.0f} ms (server's histogram)")
    if "goodput_req_per_s" in s:
        out.append(f"goodput {s['goodput_req_per_s']:.3g} req/s: {_good(s)}")
    if s.get("refused"):
        line = (
            f"{s['refused']} refused (429) in {s['refusal_p50_ms']:.0f} ms p50, {s['refusal_p99_ms']:.0f} p99, "
            f"{s['refusal_max_ms']:.0f} max"
        )
        if "admitted_good_share" in s:
            line += f"; {s['admitted_good_share']:.1%} of those admitted good"
        out.append(line)
    if s.get("best_effort_requests"):
        out.append(f"{s['best_effort_requests']} admitted best-effort, {s['best_effort_good']} of them good")
    if "ttft_over_predicted_p50" in s:
        out.append(f"TTFT / admission's prediction: {s['ttft_over_predicted_p50']:.2f} (median)")
    if "prefix_hit_rate" in s:
        out.append(f"prefix hits {s['prefix_hit_rate']:.1%} of prompt tokens")
    if s.get("prompt_length_mismatches"):
        out.append(f"{s['prompt_length_mismatches']} prompts not of their traced length")
    if s.get("errors"):
        out.append(f"{s['errors']} errors, first: {s.get('first_error')}")
    return out


def _good(s: dict[str, Any]) -> str:
    """Who was good, by which targets, and each target's attainment."""
    targets = []
    if s.get("ttft_slo_ms"):
        targets.append(f"TTFT <= {s['ttft_slo_ms']:g} ms ({s['ttft_attainment']:.1%} met it)")
    if s.get("tbt_slo_ms"):
        targets.append(f"own P99 gap <= {s['tbt_slo_ms']:g} ms ({s['tbt_attainment']:.1%} met it)")
    met = ", ".join(targets) or "no target"
    return f"{s['good_requests']} of {s['requests']} good ({s['good_share']:.1%}): completed, {met}"


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{report['workload']} against {report['target']}"]
    if "trace" in report:
        t = report["trace"]
        lines.append(f"trace {t['file']}: {t['replay']}, seed {t['seed']}")
    head = (
        f"  {'setting':<22} {'group':<9} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'ITL p50':>8} {'p90':>7} "
        f"{'p99':>7} {'max gap':>8} {'tok/s':>7}"
    )
    lines += ["", head + "   (ms)"]
    for setting, group, s in _rows(report):
        lines.append(
            f"  {setting:<22} {group:<9} {s['ttft_p50_ms']:>9.0f} {s['ttft_p90_ms']:>8.0f} {s['ttft_p99_ms']:>8.0f}"
            f" {s['itl_p50_ms']:>8.1f} {s['itl_p90_ms']:>7.1f} {s['itl_p99_ms']:>7.1f} {s['max_gap_ms']:>8.0f}"
            f" {s['throughput_tokens_per_s']:>7.0f}"
        )
        if group != "decoders":
            lines += [f"  {'':<22} {'':<9} {extra}" for extra in _extras(s)]
    if "slo" in report:
        slo = report["slo"]
        lines += ["", f"  largest setting meeting {slo['metric']} <= {slo['tbt_slo_ms']:g} ms: {slo['best']}"]
    return "\n".join(lines)


def markdown_report(report: dict[str, Any]) -> str:
    """The report as a markdown page: what ran, then one table row per run and group."""
    lines = [f"# `stallfree bench`: {report['workload']} against {report['target']}", ""]
    if report.get("command"):
        lines += [f"`{report['command']}`", ""]
    if "trace" in report:
        t = report["trace"]
        lines += [f"Trace `{t['file']}`: {t['replay']}, seed {t['seed']}.", ""]
    lines += [
        "| setting | group | TTFT p50 | p99 | TBT p50 | p99 | max gap | sched. delay p50 | tok/s | goodput req/s | "
        "good | refused | prefix hits |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for setting, group, s in _rows(report):
        delay = f"{s['scheduling_delay_p50_ms']:.0f}" if "scheduling_delay_p50_ms" in s else "–"
        good = f"{s['goodput_req_per_s']:.3g} | {s['good_share']:.1%}" if "goodput_req_per_s" in s else "– | –"
        hits = f"{s['prefix_hit_rate']:.1%}" if "prefix_hit_rate" in s else "–"
        lines.append(
            f"| {setting} | {group} | {s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} | {s['itl_p50_ms']:.1f} "
            f"| {s['itl_p99_ms']:.1f} | {s['max_gap_ms']:.0f} | {delay} | {s['throughput_tokens_per_s']:.0f} "
            f"| {good} | {s.get('refused', 0)} | {hits} |"
        )
    lines += [
        "",
        "Times in ms. TBT: every inter-token gap of every request, pooled. Good: a request that completed "
        "within the TTFT target and whose own P99 gap met the TBT target (refused ones are not good); "
        "good: their share of every request.",
    ]
    if "slo" in report:
        slo = report["slo"]
        lines.append(f"Largest setting meeting {slo['metric']} <= {slo['tbt_slo_ms']:g} ms: {slo['best']}.")
    return "\n".join(lines) + "\n"


def plot_report(report: dict[str, Any], out: Path) -> list[Path]:
    """Every gap against time (each run); for a sweep, TTFT and TBT percentiles against the setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, run in enumerate(report["runs"]):
        fig, ax = plt.subplots(figsize=(9, 3.6))
        for stream in run["streams"]:
            if len(stream) > 1:
                gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(stream)]
                ax.plot(stream[1:], gaps, lw=0.6, marker=".", ms=2)
        label = ", ".join(f"{k}={v}" for k, v in run["setting"].items()) or report["workload"]
        ax.set(xlabel="seconds since start", ylabel="inter-token gap (ms)", title=f"every gap, per request: {label}")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        path = out / f"itl-{i}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    if "slo" in report:
        paths.append(plot_sweep(report, out / "frontier.png"))
    return paths


def plot_sweep(report: dict[str, Any], path: Path) -> Path:
    """TTFT and TBT percentiles (and the worst gap) against the swept setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    key = "decoders" if "decoders" in runs[0] else "all"
    ttft_key = "long" if "long" in runs[0] else "all"
    name = next(iter(runs[0]["setting"]))
    xs = [next(iter(r["setting"].values())) for r in runs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for pct in ("p50", "p99"):
        a1.plot(xs, [r[ttft_key][f"ttft_{pct}_ms"] for r in runs], marker="o", label=f"TTFT {pct}")
        a2.plot(xs, [r[key][f"itl_{pct}_ms"] for r in runs], marker="o", label=f"TBT {pct}")
    a2.plot(xs, [r[key]["max_gap_ms"] for r in runs], marker="x", ls=":", label="max gap")
    a2.axhline(report["slo"]["tbt_slo_ms"], color="red", ls="--", label="TBT SLO")
    if name == "tbt_slo_ms":
        a2.plot(xs, xs, color="gray", lw=0.8, label="the target")
    best = report["slo"]["best"]
    if best:
        for ax in (a1, a2):
            ax.axvline(next(iter(best.values())), color="green", ls=":", label="chosen")
    for ax, title in ((a1, f"TTFT ({ttft_key})"), (a2, f"inter-token gaps ({key})")):
        ax.set(xlabel=name, ylabel="ms", title=title)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
