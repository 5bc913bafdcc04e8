"""The simulator on both production traces at full scale: Sarathi-Serve's
capacity of each way of scheduling for the article's 8B model and GPU.

    .venv/bin/python -m bench.simulator.sim_capacity [--requests 1000] [--disaggregate 1:1] \
        [--searches capacity,goodput] [--ttft-slo-ms 2000] [--slos strict,relaxed] [--trace azure|mooncake|both]

The real scheduler on the article's roofline (Llama-3-8B in bf16 on a 400
TFLOP/s, 3 TB/s accelerator, attention FLOPs and KV reads included; 64 GiB
of KV, 256 sequences) replays each trace at its own lengths: every trial,
the same first ``--requests`` of the trace at the trial's rate, searched to
2.5 % (``stallfree simulate --capacity``). The SLOs are 5 x (strict) and
25 x (relaxed) the decode-only iteration of 8 decodes at the trace's median
prompt. Compared: the token budget 512; the largest budget the cost model
puts within the SLO; a TBT target of the SLO (budget 512); with
``--draft-acceptance``, that target with speculative decoding (every decode
proposes drafts, each kept with that probability); unchunked; and
disaggregated P:D (its capacity is the P + D workers'). With ``goodput``
among ``--searches``: goodput capacity (at least 90 % of the requests good:
TTFT within ``--ttft-slo-ms``, their own P99 gap within the SLO, refused
ones not good) of the TBT target alone, both targets, and both with
shedding. Writes a new bench/results/sim_capacity-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from bench.serving.capacity import TRACE_SETS, TRACE_SPECS
from stallfree.core.analysis.capacity_search import RELAXED, SLO, STRICT
from stallfree.core.analysis.cost_model import ARTICLE_GPU, LLAMA3_8B, CostModel
from stallfree.core.analysis.disagg_plan import Link
from stallfree.core.analysis.simulated_capacity import Setup, capacities, figures_at_capacity, goodput_capacities
from stallfree.core.analysis.traces import Replay, read_trace
from stallfree.core.sched.config import CacheConfig, SchedulerConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000, help="every trial: the trace's first N requests")
    ap.add_argument("--disaggregate", default="1:1", help="P:D workers for the disaggregated row")
    ap.add_argument("--link-gbps", type=float, default=100.0)
    ap.add_argument(
        "--draft-acceptance",
        type=float,
        help="adds the TBT target with speculative decoding, every draft kept with this probability",
    )
    ap.add_argument("--searches", default="capacity", help="capacity (Sarathi-Serve's), goodput, or both")
    ap.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="the TTFT target goodput is judged by")
    ap.add_argument("--slos", default="strict,relaxed", help="which of Sarathi-Serve's SLOs")
    # the production traces as logged (the prefill-heavy workload is scaled for a CPU)
    ap.add_argument("--trace", choices=[*TRACE_SETS["both"], "both"], default="both")
    args = ap.parse_args()
    searches = args.searches.split(",")
    p, d = (int(x) for x in args.disaggregate.split(":"))
    cost = CostModel(LLAMA3_8B, ARTICLE_GPU, attention=True, kv_reads=True)
    config = SchedulerConfig(token_budget=512, max_num_seqs=256, max_model_len=131_072)
    cache = CacheConfig(num_blocks=32_768, block_size=16)  # 64 GiB at 128 KiB a token
    doc: dict[str, Any] = {
        "command": "python -m bench.simulator.sim_capacity " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "model": "Llama-3-8B bf16 on the article's accelerator (400 TFLOP/s, 3 TB/s), attention and KV reads",
        "scheduler": {"token_budget": 512, "max_num_seqs": 256, "kv_tokens": cache.num_tokens},
        "traces": [],
    }
    for key in TRACE_SETS.get(args.trace, (args.trace,)):
        spec = TRACE_SPECS[key]
        setup = Setup(
            read_trace(spec.file),
            Replay(count=args.requests),
            config,
            cache,
            cost,
            (p, d),
            Link(args.link_gbps),
            args.draft_acceptance,
        )
        decode_ms, context = setup.decode_iteration_ms(8)
        entry: dict[str, Any] = {
            "trace": spec.name,
            "file": str(spec.file.name),
            "own_rate_req_per_s": setup.own_rate(),
            "decode_iteration_ms": decode_ms,
            "context": context,
            "slos": {},
        }
        for slo_name, multiple in (("strict", STRICT), ("relaxed", RELAXED)):
            if slo_name not in args.slos.split(","):
                continue
            slo = SLO(multiple * decode_ms)
            started = time.perf_counter()
            rows = capacities(setup, slo, 8, setup.own_rate()) if "capacity" in searches else []
            entry["slos"][slo_name] = {"slo_ms": slo.tbt_p99_ms, "modes": rows}
            if "goodput" in searches:
                entry["slos"][slo_name]["ttft_slo_ms"] = args.ttft_slo_ms
                entry["slos"][slo_name]["goodput"] = goodput_capacities(setup, slo, args.ttft_slo_ms, setup.own_rate())
                rows = rows + [
                    {"mode": f"goodput, {r['mode']}", "capacity_req_per_s": r["goodput_capacity_req_per_s"]}
                    for r in entry["slos"][slo_name]["goodput"]
                ]
            print(
                f"{key} {slo_name}: "
                + ", ".join(f"{r['mode']} {r['capacity_req_per_s']:.3g}" for r in rows)
                + f" ({time.perf_counter() - started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        doc["traces"].append(entry)
    write(doc, args.requests)


def write(doc: dict[str, Any], requests: int) -> None:
    from bench.record import dated, table

    base = dated("sim_capacity")
    base.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    lines = [
        "# The simulator on both production traces at full scale: capacity under a TBT SLO, and goodput capacity",
        "",
        f"`{doc['command']}`, {doc['date']}: {doc['model']}; token budget 512, 256 sequences, "
        f"{doc['scheduler']['kv_tokens']:,} tokens of KV. Every trial replays the trace's first {requests} "
        "requests at the trial's rate, its own lengths (equal arrival times spread to the next); capacity is the "
        "highest rate with P99 TBT <= SLO and P50 scheduling delay <= 2 s, to 2.5 %. Times in ms, at capacity.",
        "",
    ]
    for t in doc["traces"]:
        lines += [
            f"## {t['trace']} (`{t['file']}`, its own rate {t['own_rate_req_per_s']:.3g} req/s)",
            "",
            f"Decode-only iteration: {t['decode_iteration_ms']:.2f} ms (8 decodes at {t['context']} tokens).",
            "",
        ]
        cells = []
        for slo_name, cell in t["slos"].items():
            for r in cell["modes"]:
                f = figures_at_capacity(r)
                figures = [f"{f[0]:.0f}", f"{f[1]:.0f}", f"{f[2]:.1f}", f"{f[3]:.1f}", f"{f[4]:.0f}", f"{f[5]:.0f}"]
                cells.append(
                    [f"{slo_name} ({cell['slo_ms']:.1f})", r["mode"], f"{r['capacity_req_per_s']:.3g}", *figures]
                )
        header = ["SLO", "mode", "req/s", "TTFT p50", "p99", "TBT p50", "p99", "worst gap", "sched. p50"]
        if cells:
            lines += table(header, cells, "llrrrrrrr")
            lines.append("")
        good = []
        for slo_name, cell in t["slos"].items():
            for r in cell.get("goodput", []):
                at = r["at_capacity"] or {}
                good.append(
                    [
                        f"{slo_name} ({cell['slo_ms']:.1f})",
                        f"{cell['ttft_slo_ms']:g}",
                        r["mode"],
                        f"{r['goodput_capacity_req_per_s']:.3g}",
                        f"{at.get('good_share', float('nan')):.1%}",
                        str(at.get("shed_requests", 0)),
                        f"{at.get('ttft_p50_ms', float('nan')):.0f}",
                        f"{at.get('ttft_p99_ms', float('nan')):.0f}",
                        f"{at.get('itl_p99_ms', float('nan')):.1f}",
                    ]
                )
        if good:
            lines += [
                "Goodput capacity: the highest rate at which at least 90 % of the requests were good (TTFT within "
                "the TTFT target, their own P99 gap within the SLO; refused ones not good).",
                "",
                *table(
                    ["SLO", "TTFT target", "mode", "req/s", "good", "refused", "TTFT p50", "p99", "TBT p99"],
                    good,
                    "lllrrrrrr",
                ),
                "",
            ]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
