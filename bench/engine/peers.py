"""stallfree's engine and OpenVINO GenAI's, each alone in its process, side by
side at each thread setting: no server, no HTTP, the same prompts' token ids.

    bash bench/peers/openvino/install.sh && bash bench/peers/openvino/export.sh
    .venv/bin/python -m bench.engine.peers [--repeats 3] [--settings ...]

Each run is a fresh process of one engine at one setting (``ENGINE:THREADS``;
``command`` says what ``@CPUS`` and ``/noamx`` add), alone on the machine while
this process waits; it plays every scenario on a fresh engine (model load,
compile and a warm-up request untimed), adding each job once its own clock
passes the job's arrival, stepping until all are done and stamping each new
token after the step that made it:

- ``decode8`` / ``decode32``: 8 or 32 prompts of 64 tokens at once, 128
  tokens each (budget 512): their throughput over the run (the prompts'
  prefill included) and their decode rate while all of them decode;
- ``interference``: 8 streams decoding 160 tokens, then a 2,000-token prompt
  at 1 s wanting 8 (budget 256, the case of issue 49's figures); a run whose
  streams ended before that prompt's first token (so their worst gap leaves
  out its last chunks) is named in the record.

stallfree runs ``--dtype auto`` (bf16 where the CPU has bf16 instructions,
else float32) with its kernels on ``torch.set_num_threads``; OpenVINO GenAI
(bench/peers/openvino/engine.py) runs the same precision, bf16 KV cache,
``INFERENCE_NUM_THREADS`` and ``sampler_num_threads``. Settings alternate
run by run within each repeat; medians, min–max and each setting's ratio to
the first are reported. A setting whose process fails is recorded with its
exit status, not dropped. Writes a new bench/results/engine_peers-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.record import dated, describe, machine, table
from bench.servers import ROOT
from stallfree.core.model.model_runner import resolve_dtype
from stallfree.loadtest.clients import Result
from stallfree.loadtest.stats import outlived, summarize
from stallfree.loadtest.workloads import Arrival, PromptMaker

OPENVINO = ROOT / "bench" / "peers" / "openvino"
SCENARIOS = ("decode8", "decode32", "interference")


def workload(seed: int) -> dict:
    """The scenarios' jobs as token ids (so both engines see the same prompts)."""
    from stallfree.core.model.embedded import load_tokenizer

    tok = load_tokenizer()
    make = PromptMaker(tok, seed)

    def job(at_s: float, tokens: int, max_tokens: int, group: str) -> dict:
        ids = tok.encode(make(tokens))[:tokens]
        return {"at_s": at_s, "ids": ids, "max_tokens": max_tokens, "group": group}

    return {
        "scenarios": {
            "decode8": {"budget": 512, "jobs": [job(0.0, 64, 128, "decoder") for _ in range(8)]},
            "decode32": {"budget": 512, "jobs": [job(0.0, 64, 128, "decoder") for _ in range(32)]},
            "interference": {
                "budget": 256,
                "jobs": [job(0.0, 32, 160, "decoder") for _ in range(8)] + [job(1.0, 2000, 8, "long")],
            },
        }
    }


# -- the stallfree side, in its own process (`--drive`) -------------------------------------------
def drive(threads: int) -> dict:
    from stallfree.core.build import ModelSettings, engine_over, load_runner, startup_profile
    from stallfree.core.sched.config import SchedulerConfig
    from stallfree.core.sched.request import Request, SamplingParams

    runner = load_runner(ModelSettings(threads=threads))
    profile, _ = startup_profile(runner)
    work = json.load(sys.stdin)
    out: dict = {"engine": f"stallfree ({str(runner.dtype).removeprefix('torch.')})", "threads": threads}
    out["scenarios"] = {}

    def request(rid: str, ids: list[int], max_tokens: int) -> Request:
        return Request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), time.perf_counter_ns())

    for name, scenario in work["scenarios"].items():
        config = SchedulerConfig(token_budget=scenario["budget"], max_num_seqs=64, max_model_len=4096)
        engine = engine_over(runner, config, profile)
        engine.add_request(request("warm", scenario["jobs"][0]["ids"], 4))
        while engine.has_work:
            engine.step()
        jobs = scenario["jobs"]
        pending = sorted(range(len(jobs)), key=lambda i: jobs[i]["at_s"])
        results = [{"sent_s": None, "token_s": []} for _ in jobs]
        t0 = time.perf_counter()
        while pending or engine.has_work:
            now = time.perf_counter() - t0
            while pending and jobs[pending[0]]["at_s"] <= now:
                i = pending.pop(0)
                results[i]["sent_s"] = time.perf_counter() - t0
                engine.add_request(request(str(i), jobs[i]["ids"], jobs[i]["max_tokens"]))
            if not engine.has_work:
                time.sleep(max(0.0, jobs[pending[0]]["at_s"] - now))
                continue
            step = engine.step()
            stamp = time.perf_counter() - t0
            for o in step.outputs if step else ():
                results[int(o.request_id)]["token_s"] += [stamp] * len(o.new_token_ids)
        out["scenarios"][name] = results
    return out


# -- the coordinator ------------------------------------------------------------------------------
def command(setting: str, precision: str) -> list[str]:
    """``ENGINE:THREADS[@CPUS][/noamx]``: ``@CPUS`` pins it (taskset); ``/noamx``
    keeps oneDNN off AMX (``ONEDNN_MAX_CPU_ISA``): OpenVINO 2026.4's CPU plugin
    dies of SIGFPE compiling a bf16 model for one thread with AMX (2-core Xeon)."""
    engine, _, rest = setting.partition(":")
    rest, _, flag = rest.partition("/")
    threads, _, cpus = rest.partition("@")
    pin = ["taskset", "-c", cpus] if cpus else []
    if flag == "noamx":
        pin = ["env", "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16", *pin]
    elif flag:
        raise SystemExit(f"unknown flag in {setting!r}: noamx")
    if engine == "stallfree":
        return [*pin, sys.executable, "-m", "bench.engine.peers", "--drive", threads]
    if engine == "openvino":
        python = str(OPENVINO / ".venv" / "bin" / "python")
        return [*pin, python, str(OPENVINO / "engine.py"), "--threads", threads, "--precision", precision]
    raise SystemExit(f"unknown engine in {setting!r}: stallfree or openvino")


def play(setting: str, precision: str, work: dict, log: Path) -> dict:
    """One process of one setting over every scenario: each scenario's summary."""
    with log.open("a") as err:
        cmd = command(setting, precision)
        proc = subprocess.run(cmd, input=json.dumps(work), capture_output=True, text=True, cwd=ROOT)
        err.write(proc.stderr)
    if proc.returncode != 0:
        return {"failed": proc.returncode}
    got = json.loads(proc.stdout)
    out: dict = {"engine": got["engine"]}
    for name, results in got["scenarios"].items():
        res = []
        for job, r in zip(work["scenarios"][name]["jobs"], results, strict=True):
            arrival = Arrival(job["at_s"], "", job["max_tokens"], job["group"], len(job["ids"]))
            res.append(Result(arrival, r["sent_s"], r["token_s"], len(job["ids"]), len(r["token_s"])))
        out[name] = {"all": summarize(res), "decoders": summarize(res, "decoder"), "long": summarize(res, "long")}
        if name == "interference":
            out[name]["outlived"] = outlived(res)
    return out


METRICS = [  # (scenario, group, key, label, higher is better)
    *(
        (f"decode{n}", "all", key, label.format(n=n), True)
        for n in (8, 32)
        for key, label in (
            ("throughput_tokens_per_s", "{n} streams x 128 tokens, prefill included (tokens/s)"),
            ("decode_tokens_per_s", "decode, {n} streams all decoding (tokens/s)"),
        )
    ),
    ("interference", "decoders", "itl_p50_ms", "8 streams + 2,000-token prompt: gap p50 (ms)", False),
    ("interference", "decoders", "itl_p99_ms", "8 streams + 2,000-token prompt: gap p99 (ms)", False),
    ("interference", "decoders", "max_gap_ms", "8 streams + 2,000-token prompt: worst gap (ms)", False),
    ("interference", "long", "ttft_p50_ms", "the 2,000-token prompt's TTFT (ms)", False),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drive", type=int, metavar="THREADS", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--settings",
        default="stallfree:1,openvino:1,stallfree:2,openvino:2",
        help="ENGINE:THREADS[@CPUS][/noamx] each, comma-separated (ENGINE: stallfree | openvino)",
    )
    args = ap.parse_args()
    if args.drive is not None:
        json.dump(drive(args.drive), sys.stdout)
        return
    if not (OPENVINO / ".venv" / "bin" / "python").exists() or not (OPENVINO / "smollm2-ov").exists():
        sys.exit("run bench/peers/openvino/install.sh and bench/peers/openvino/export.sh first")
    settings = args.settings.split(",")
    precision = "bf16" if resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16 else "f32"
    base = dated("engine_peers")
    log = base.with_suffix(".log")
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    for rep in range(args.repeats):
        work = workload(rep)
        for s in settings:
            started = time.perf_counter()
            got = play(s, precision, work, log)
            runs[s].append(got)
            brief = got.get("failed") or (
                f"decode32 {got['decode32']['all']['throughput_tokens_per_s']:.0f} tokens/s "
                f"(all decoding {got['decode32']['all']['decode_tokens_per_s']:.0f}), "
                f"worst gap {got['interference']['decoders']['max_gap_ms']:.0f} ms"
            )
            print(f"#{rep} {s}: {brief} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    write(base, runs, args, settings, precision)


def write(
    base: Path, runs: dict[str, list[dict]], args: argparse.Namespace, settings: list[str], precision: str
) -> None:
    first = settings[0]
    rows: list[list[str]] = []
    for scenario, group, key, label, higher in METRICS:
        for s in settings:
            xs = [r[scenario][group][key] for r in runs[s] if "failed" not in r]
            failed = [r["failed"] for r in runs[s] if "failed" in r]
            if not xs:
                rows.append([label, s, f"failed (exit {failed[0]})", "", ""])
                continue
            ratios = [
                a[scenario][group][key] / b[scenario][group][key]
                for a, b in zip(runs[s], runs[first], strict=True)
                if "failed" not in a and "failed" not in b and b[scenario][group][key]
            ]
            ratio = f"{statistics.median(ratios):.2f} [{min(ratios):.2f}–{max(ratios):.2f}]" if ratios else ""
            spread = f"{statistics.median(xs):.0f} [{min(xs):.0f}–{max(xs):.0f}]"
            rows.append([label, s, spread, ratio, "higher" if higher else "lower"])
    command = ("python -m bench.engine.peers " + " ".join(sys.argv[1:])).strip()
    m = machine()
    engines = {s: next((r["engine"] for r in runs[s] if "engine" in r), "?") for s in settings}
    base.with_suffix(".json").write_text(
        json.dumps(
            {"command": command, "machine": m, "precision": precision, "engines": engines, "runs": runs}, indent=2
        )
    )
    lines = [
        "# stallfree's engine and OpenVINO GenAI's, each alone in its process, by thread setting",
        "",
        f"`{command}` on {describe(m)}, {os.cpu_count()} cores; {precision} compute and KV cache for both engines; "
        "each run a fresh process alone on the "
        f"machine; medians of {args.repeats} alternating runs [min–max]; ratio to `{first}` per repeat.",
        "",
        *(f"- `{s}`: {e}" for s, e in engines.items()),
        "",
        *table(["metric", "setting", "value", f"÷ {first}", "better"], rows, "llrrc"),
        "",
    ]
    short = [
        f"{s} #{i}"
        for s in settings
        for i, r in enumerate(runs[s])
        if r.get("interference", {}).get("outlived") is False
    ]
    lines.append(
        "Interference runs whose streams ended before the 2,000-token prompt's first token (their gaps miss its "
        f"last chunks): {', '.join(short)}."
        if short
        else "In every interference run the 8 streams decoded until after the 2,000-token prompt's first token."
    )
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
