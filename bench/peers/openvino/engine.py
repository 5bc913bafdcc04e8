"""OpenVINO GenAI's ContinuousBatchingPipeline driven in process, step by step.

Run by bench.engine.peers with this folder's venv (install.sh, export.sh):

    .venv/bin/python engine.py --threads N < workload.json > timings.json

The workload (JSON on stdin): ``{"scenarios": {name: {"budget": B, "jobs":
[{"at_s", "ids", "max_tokens"}, ...]}}}``. For each scenario a fresh pipeline
(its compile and a warm-up request are not timed) takes each job once the
loop's clock passes ``at_s``, then calls ``step()`` until every handle has
finished; after each step every readable handle is read and its new tokens
stamped with the clock. The answer (JSON on stdout): per scenario, per job,
``{"sent_s", "token_s": [...]}``, seconds since the scenario's start, and the
pipeline's thread settings as it reported them.

Settings, found while setting it up (issue 49): ``INFERENCE_NUM_THREADS`` is
the compute threads; the pipeline's sampler has its own pool,
``sampler_num_threads``, which takes every core unless told; bf16 compute
(``INFERENCE_PRECISION_HINT``) and a bf16 KV cache (``KV_CACHE_PRECISION``;
the plugin's own default is u8). Greedy, EOS ignored, no prefix caching,
``dynamic_split_fuse`` (its chunked prefill) with the scenario's token budget.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import openvino as ov
import openvino_genai as genai

MODEL = Path(__file__).resolve().parent / "smollm2-ov"


def pipeline(threads: int, budget: int, precision: str) -> genai.ContinuousBatchingPipeline:
    sched = genai.SchedulerConfig()
    sched.max_num_batched_tokens = budget
    sched.max_num_seqs = 64
    sched.dynamic_split_fuse = True
    sched.enable_prefix_caching = False
    sched.cache_size = 2  # GB
    properties = {
        "INFERENCE_NUM_THREADS": threads,
        "sampler_num_threads": threads,
        "INFERENCE_PRECISION_HINT": precision,
        "KV_CACHE_PRECISION": precision,
    }
    return genai.ContinuousBatchingPipeline(str(MODEL), sched, "CPU", properties)


def config(max_tokens: int) -> genai.GenerationConfig:
    c = genai.GenerationConfig()
    c.max_new_tokens = max_tokens
    c.min_new_tokens = max_tokens
    c.ignore_eos = True
    c.do_sample = False
    return c


def tensor(ids: list[int]) -> ov.Tensor:
    return ov.Tensor(np.asarray([ids], dtype=np.int64))


def drain(pipe: genai.ContinuousBatchingPipeline, handles: list) -> None:
    while pipe.has_non_finished_requests():
        pipe.step()
    for h in handles:
        h.read_all()


def run(pipe: genai.ContinuousBatchingPipeline, jobs: list[dict], first_id: int) -> list[dict]:
    pending = sorted(range(len(jobs)), key=lambda i: jobs[i]["at_s"])
    results = [{"sent_s": None, "token_s": []} for _ in jobs]
    handles: dict[int, object] = {}
    t0 = time.perf_counter()
    while pending or handles:
        now = time.perf_counter() - t0
        while pending and jobs[pending[0]]["at_s"] <= now:
            i = pending.pop(0)
            job = jobs[i]
            results[i]["sent_s"] = time.perf_counter() - t0
            handles[i] = pipe.add_request(first_id + i, tensor(job["ids"]), config(job["max_tokens"]))
        if not handles:  # nothing to run before the next arrival
            time.sleep(max(0.0, jobs[pending[0]]["at_s"] - now))
            continue
        pipe.step()
        stamp = time.perf_counter() - t0
        for i, h in list(handles.items()):
            if h.can_read():
                for out in h.read().values():
                    results[i]["token_s"] += [stamp] * len(out.generated_ids)
            if h.get_status() != genai.GenerationStatus.RUNNING and not h.can_read():
                del handles[i]
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--precision", default="bf16", help="compute and KV cache: bf16 | f32")
    args = ap.parse_args()
    work = json.load(sys.stdin)
    out: dict = {"engine": f"OpenVINO GenAI {genai.__version__}", "threads": args.threads, "scenarios": {}}
    for name, scenario in work["scenarios"].items():
        pipe = pipeline(args.threads, scenario["budget"], args.precision)
        warm = scenario["jobs"][0]
        h = pipe.add_request(10**6, tensor(warm["ids"]), config(4))
        drain(pipe, [h])
        out["scenarios"][name] = run(pipe, scenario["jobs"], 0)
        del pipe
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
