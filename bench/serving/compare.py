"""stallfree and vLLM side by side on this machine, same weights, same CPU split.

    bash bench/peers/vllm/install.sh && bash bench/peers/vllm/convert.sh
    .venv/bin/python -m bench.serving.compare [--repeats 3] [--dtype auto] [--threads 1]

Both engines serve bench/peers/vllm/smollm2-hf (the embedded SmolLM2 GGUF
converted by `stallfree export`) in one dtype (``auto``: what stallfree picks
on this CPU, bf16 with AMX / AVX-512 BF16, else fp32) and compute on
``--threads`` threads: at 1, vLLM's default on 2 cores (its OpenMP thread
pinned to core 0, core 1 kept for its API server) against stallfree's
``--threads 1``, its event loop beside it; at N > 1, vLLM's threads bound to
cores 0..N-1 (``VLLM_CPU_OMP_THREADS_BIND``) against ``--threads N``. The
load generator (this process) shares the machine with both.

Phase budget512 (chunked prefill, 64 sequences): 8 and 32 streams of 128
tokens started together (their throughput over the run, the prompts' prefill
included, and their decode rate while all of them decode), and 8 running
streams while one 2,000-token prompt arrives (at 1 s: the faster engine's
streams must still be decoding when its last chunk runs; a run where one
ended before the prompt's first token is named in the record).
Phases budget256 and unchunked: the same interference run, stallfree
switched live through /api/config, vLLM restarted with the matching flags.
Phase targeted: the same run against each engine as started out of the box
at budget 512: stallfree restarted without ``NO_TARGETS``, so it holds the
TBT and TTFT targets ``stallfree serve`` derives at start (recorded), and
vLLM at budget 512 (``start.sh``'s), which has no target to hold.
The engines alternate run by run (A B A B ...); each row's ratio is taken per
repeat (stallfree run i / vLLM run i) and reported as median [min–max].
Writes a new bench/results/compare-<date>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
from pathlib import Path

import httpx
import torch

from bench.record import OUT, dated, describe, machine, table
from bench.servers import NO_TARGETS, VLLM, StallfreeServer, free_port, start_vllm, stop, wait_quiet
from stallfree.core.model.embedded import load_tokenizer
from stallfree.core.model.model_runner import resolve_dtype
from stallfree.loadtest.clients import OpenAITarget, StallfreeTarget
from stallfree.loadtest.runner import run_jobs
from stallfree.loadtest.stats import outlived, summarize
from stallfree.loadtest.workloads import Arrival, PromptMaker, interference_jobs

MODEL_DIR = VLLM / "smollm2-hf"


def start_engine_stallfree(
    log: Path, dtype: str, compute: str = "float", kv_dtype: str = "auto", threads: int = 1, targets: bool = False
) -> StallfreeServer:
    """The server at budget 512; ``targets``: with the targets serve derives, else none."""
    return StallfreeServer(
        "--model",
        str(MODEL_DIR),
        "--dtype",
        dtype,
        "--compute",
        compute,
        "--kv-dtype",
        kv_dtype,
        "--threads",
        str(threads),
        "--token-budget",
        "512",
        "--max-num-seqs",
        "64",
        "--max-model-len",
        "4096",
        *(() if targets else NO_TARGETS),
        log=log,
    )


def decode_jobs(make: PromptMaker, streams: int) -> list[Arrival]:
    return [Arrival(0.0, make(64), 128, "decoder") for _ in range(streams)]


def run(target, jobs) -> tuple[dict, list]:
    """One run once the machine is quiet: vLLM busy-waits a second after its
    last request, which the other engine's next run would otherwise share."""
    wait_quiet()
    results = asyncio.run(run_jobs(target, jobs))
    return {
        "all": summarize(results),
        "decoders": summarize(results, "decoder"),
        "long": summarize(results, "long"),
    }, results


LONG_AT_S = 1.0  # the 2,000-token prompt's arrival in the interference runs

# phase -> (stallfree /api/config, vLLM flags after start.sh's defaults)
PHASES = {
    "budget512": ({"chunking": "stall_free", "token_budget": 512}, ["--max-num-batched-tokens", "512"]),
    "budget256": ({"chunking": "stall_free", "token_budget": 256}, ["--max-num-batched-tokens", "256"]),
    "unchunked": ({"chunking": "none"}, ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096"]),
    "targeted": ({"chunking": "stall_free", "token_budget": 512}, []),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="both engines; auto: stallfree's choice on this CPU")
    ap.add_argument("--compute", default="float", choices=["float", "int8"], help="stallfree's --compute")
    ap.add_argument("--kv-dtype", default="auto", help="stallfree's --kv-dtype (vLLM's cache stays in --dtype)")
    ap.add_argument("--threads", type=int, default=1, help="each engine's compute threads")
    ap.add_argument("--phases", default=",".join(PHASES), help="which of " + ", ".join(PHASES) + ", in order")
    args = ap.parse_args()
    phases = {p: PHASES[p] for p in args.phases.split(",")}
    if not (VLLM / ".venv" / "bin" / "python").exists() or not MODEL_DIR.exists():
        sys.exit("run bench/peers/vllm/install.sh and bench/peers/vllm/convert.sh first")
    dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    tokenizer = load_tokenizer()
    seed = 0
    rows: list[dict] = []
    streams_kept: dict[str, list] = {}
    logs = OUT / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    def record(phase: str, scenario: str, engine: str, rep: int, summary: dict, results: list) -> None:
        rows.append({"phase": phase, "scenario": scenario, "engine": engine, "repeat": rep, **summary})
        if scenario == "interference" and rep == 0:
            streams_kept[f"{phase}/{engine}"] = [r.token_s for r in results if r.job.group == "decoder"]
        s = summary["decoders"] if scenario == "interference" else summary["all"]
        print(
            f"{phase:>9} {scenario:>12} {engine:>9} #{rep}: {s['throughput_tokens_per_s']:6.0f} tok/s "
            f"(all decoding {s['decode_tokens_per_s']:4.0f}), "
            f"ITL p50 {s['itl_p50_ms']:6.1f} p99 {s['itl_p99_ms']:6.1f} max {s['max_gap_ms']:6.0f} ms, "
            f"long TTFT {summary['long']['ttft_p50_ms']:6.0f} ms",
            file=sys.stderr,
            flush=True,
        )

    vl_port = free_port()
    sf = start_engine_stallfree(logs / "stallfree.log", dtype, args.compute, args.kv_dtype, args.threads)
    vllm_env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"} if args.threads > 1 else None
    sf_port = sf.port
    vl = None
    targeted = False
    derived: dict[str, float] = {}  # the targets the targeted server derived
    targets = {
        "stallfree": StallfreeTarget(f"ws://127.0.0.1:{sf_port}/v1/stream"),
        "vllm": OpenAITarget(f"http://127.0.0.1:{vl_port}/v1", "smollm2"),
    }
    try:
        for phase, (config, vllm_flags) in phases.items():
            if (phase == "targeted") != targeted:  # the other kind of stallfree server
                sf.stop()
                targeted = phase == "targeted"
                sf = start_engine_stallfree(
                    logs / f"stallfree-{phase}.log", dtype, args.compute, args.kv_dtype, args.threads, targeted
                )
                sf_port = sf.port
                targets["stallfree"] = StallfreeTarget(f"ws://127.0.0.1:{sf_port}/v1/stream")
                if targeted:
                    scheduler = httpx.get(f"http://127.0.0.1:{sf_port}/api/config", timeout=30).json()["scheduler"]
                    derived = {k: scheduler[k] for k in ("tbt_slo_ms", "ttft_slo_ms", "tbt_stretch")}
            httpx.put(f"http://127.0.0.1:{sf_port}/api/config", json=config, timeout=30).raise_for_status()
            vl = start_vllm(vl_port, logs / f"vllm-{phase}.log", "--dtype", dtype, *vllm_flags, env=vllm_env)
            for rep in range(args.repeats):
                for engine, target in targets.items():
                    if phase == "budget512":
                        for streams in (8, 32):
                            seed += 1
                            summary, res = run(target, decode_jobs(PromptMaker(tokenizer, seed), streams))
                            record(phase, f"decode{streams}", engine, rep, summary, res)
                    seed += 1
                    jobs = interference_jobs(PromptMaker(tokenizer, seed), 8, 1, 2000, LONG_AT_S, 160)
                    summary, res = run(target, jobs)
                    record(phase, "interference", engine, rep, summary | {"outlived": outlived(res)}, res)
            stop(vl)
            vl = None
    finally:
        if vl is not None:
            stop(vl)
        sf.stop()
    write(rows, streams_kept, args, dtype, derived)


METRICS = [  # (phase, scenario, group, key, label, higher is better)
    *(
        ("budget512", f"decode{n}", "all", key, label.format(n=n), True)
        for n in (8, 32)
        for key, label in (
            ("throughput_tokens_per_s", "{n} streams x 128 tokens, prefill included (tok/s)"),
            ("decode_tokens_per_s", "decode, {n} streams all decoding (tok/s)"),
        )
    ),
    *(
        row
        for b in ("budget512", "budget256")
        for row in (
            (b, "interference", "decoders", "itl_p50_ms", f"budget {b[6:]}: 8 streams' ITL p50 (ms)", False),
            (b, "interference", "decoders", "itl_p99_ms", f"budget {b[6:]}: 8 streams' ITL p99 (ms)", False),
            (b, "interference", "decoders", "max_gap_ms", f"budget {b[6:]}: 8 streams' max gap (ms)", False),
            (b, "interference", "long", "ttft_p50_ms", f"budget {b[6:]}: 2,000-token prompt TTFT (ms)", False),
        )
    ),
    ("unchunked", "interference", "decoders", "itl_p99_ms", "chunking off: 8 streams' ITL p99 (ms)", False),
    ("unchunked", "interference", "decoders", "max_gap_ms", "chunking off: 8 streams' max gap (ms)", False),
    ("unchunked", "interference", "long", "ttft_p50_ms", "chunking off: 2,000-token prompt TTFT (ms)", False),
    *(
        ("targeted", "interference", group, key, f"out of the box: {label}", False)
        for group, key, label in (
            ("decoders", "itl_p50_ms", "8 streams' ITL p50 (ms)"),
            ("decoders", "itl_p99_ms", "8 streams' ITL p99 (ms)"),
            ("decoders", "max_gap_ms", "8 streams' max gap (ms)"),
            ("long", "ttft_p50_ms", "2,000-token prompt TTFT (ms)"),
        )
    ),
]


def write(
    rows: list[dict], streams: dict[str, list], args: argparse.Namespace, dtype: str, derived: dict[str, float]
) -> None:
    metrics = []
    done = {r["phase"] for r in rows}
    for phase, scenario, group, key, label, higher in METRICS:
        if phase not in done:
            continue
        vals, runs = {}, {}
        for engine in ("stallfree", "vllm"):
            mine = [r for r in rows if (r["phase"], r["scenario"], r["engine"]) == (phase, scenario, engine)]
            runs[engine] = {r["repeat"]: r[group][key] for r in mine}
            xs = list(runs[engine].values())
            vals[engine] = (statistics.median(xs), min(xs), max(xs))
        ratios = [runs["stallfree"][i] / runs["vllm"][i] for i in runs["stallfree"] if runs["vllm"].get(i)]
        ratio = (statistics.median(ratios), min(ratios), max(ratios)) if ratios else (float("nan"),) * 3
        better = ratio[0] > 1 if higher else ratio[0] < 1
        metrics.append(
            {
                "metric": label,
                "stallfree": vals["stallfree"],
                "vllm": vals["vllm"],
                "ratio": ratio,
                "stallfree_better": better,
            }
        )
    command = ("python -m bench.serving.compare " + " ".join(sys.argv[1:])).strip()
    m = machine()
    base = dated("compare")
    base.with_suffix(".json").write_text(
        json.dumps(
            {
                "command": command,
                "machine": m,
                "dtype": dtype,
                "compute": args.compute,
                "kv_dtype": args.kv_dtype,
                "repeats": args.repeats,
                "threads": args.threads,
                "targeted_stallfree_targets": derived,
                "table": metrics,
                "runs": rows,
            },
            indent=2,
        )
    )
    lines = [
        f"# stallfree vs vLLM 0.32 (vllm-cpu), same SmolLM2-135M weights ({dtype}"
        + (", stallfree's prefill GEMMs in int8" if args.compute == "int8" else "")
        + (f", stallfree's KV cache and attention in {args.kv_dtype}" if args.kv_dtype != "auto" else "")
        + f"), {args.threads} compute thread{'s' if args.threads > 1 else ''} each",
        "",
        f"`{command}` on {describe(m)} — medians of {args.repeats} alternating runs per engine "
        "(min–max in brackets); ratio = stallfree / vLLM per repeat, median [min–max].",
        "",
    ]
    cells = []
    for t in metrics:
        s, v, r = t["stallfree"], t["vllm"], t["ratio"]
        cells.append(
            [
                t["metric"],
                f"{s[0]:.0f} [{s[1]:.0f}–{s[2]:.0f}]",
                f"{v[0]:.0f} [{v[1]:.0f}–{v[2]:.0f}]",
                f"{r[0]:.2f} [{r[1]:.2f}–{r[2]:.2f}]",
                "stallfree" if t["stallfree_better"] else "vLLM",
            ]
        )
    lines += table(["metric", "stallfree", "vLLM", "ratio", "better"], cells, "lrrrc")
    if derived:
        lines += [
            "",
            f"Out of the box: stallfree held the targets serve derived at start (TBT {derived['tbt_slo_ms']:.1f} ms,"
            f" up to {derived.get('tbt_stretch', 1.0):g}x while TTFT targets press; TTFT {derived['ttft_slo_ms']:.0f}"
            " ms) at budget 512; vLLM ran at budget 512 with no target.",
        ]
    short = [f"{r['phase']}/{r['engine']} #{r['repeat']}" for r in rows if r.get("outlived") is False]
    lines += [
        "",
        "Interference runs whose streams ended before the 2,000-token prompt's first token (their gaps miss "
        f"its last chunks): {', '.join(short)}."
        if short
        else "In every interference run the 8 streams decoded until after the 2,000-token prompt's first token.",
    ]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(streams, base.with_suffix(".png"))
    print("\n".join(lines))


def plot(streams: dict[str, list], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [
        f"{phase}/{engine}" for phase in PHASES for engine in ("stallfree", "vllm") if f"{phase}/{engine}" in streams
    ]
    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 2.4 * len(keys)), sharex=True)
    for ax, key in zip(axes, keys, strict=True):
        for s in streams[key]:
            if len(s) > 1:
                ax.plot(s[1:], [(b - a) * 1e3 for a, b in itertools.pairwise(s)], lw=0.8)
        title = f"{key}: inter-token gaps of 8 streams; a 2,000-token prompt arrives at {LONG_AT_S:g} s"
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("gap ms")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds since start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
