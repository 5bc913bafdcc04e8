"""The routers compared on paper: ``stallfree simulate --replicas N`` at 8 and
64 replicas on the multi-turn chat workload, every router on the same
workload, recorded as one dated table.

    python -m bench.scaleout.router_table [--kv-blocks 16384] [--sizes 8,64]

Simulated time on the cost model (the article's 8B model and GPU), so the
figures do not depend on this machine; it only sets how long the run takes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import orjson

from bench.record import dated, table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,64")
    p.add_argument("--kv-blocks", type=int, default=16384)
    args = p.parse_args()
    docs = []
    for n in (int(v) for v in args.sizes.split(",")):
        command = [
            sys.executable,
            "-m",
            "stallfree.cli",
            "simulate",
            "--replicas",
            str(n),
            "--kv-blocks",
            str(args.kv_blocks),
        ]
        t0 = time.perf_counter()
        out = subprocess.run([*command, "--json"], check=True, capture_output=True).stdout
        doc = orjson.loads(out)
        doc["command"] = " ".join(["stallfree", *command[3:]])
        doc["wall_s"] = round(time.perf_counter() - t0, 1)
        docs.append(doc)
        print(f"{n} replicas: {doc['wall_s']} s", file=sys.stderr)
    path = dated("router_table")
    path.with_suffix(".json").write_bytes(orjson.dumps(docs, option=orjson.OPT_INDENT_2))
    lines = ["# Routers on the multi-turn chat workload (simulated)", ""]
    for doc in docs:
        w = doc["workload"]
        lines += [
            f"`{doc['command']}` ({doc['wall_s']} s of this machine)",
            "",
            f"{w['conversations']} conversations of {w['turns']} turns started at {w['rate_per_s']:g}/s, "
            f"a {w['system_tokens']}-token system prompt, user messages {w['user_tokens']} tokens, "
            f"answers {w['output_tokens']}, think {w['think_s']} s; {doc['kv_blocks']} KV blocks per replica.",
            "",
        ]
        header = ["router", "prefix-hit rate", "TTFT p50 ms", "TTFT p99 ms", "ITL p99 ms", "max gap ms", "tokens/s"]
        cells = [
            [
                r["router"],
                f"{r['prefix_hit_rate']:.1%}",
                *(f"{r[k]:.1f}" for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "max_gap_ms")),
                f"{r['throughput_tokens_per_s']:,.0f}",
                f"{r['routed_min']}-{r['routed_max']}",
            ]
            for r in doc["routers"]
        ]
        lines += table([*header, "requests per replica (min-max)"], cells, "lrrrrrrr")
        lines.append("")
    path.with_suffix(".md").write_text("\n".join(lines))
    print(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
