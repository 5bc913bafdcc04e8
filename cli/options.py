"""Argument groups several commands share, and the settings built from them."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING, Any

import orjson

from stallfree.core.analysis.cost_model import ARTICLE_GPU, LLAMA3_8B, CostModel, HardwareSpec, ModelSpec
from stallfree.core.sched.config import CHUNKING_MODES, POLICIES, SPECULATE_MODES, SchedulerConfig

if TYPE_CHECKING:
    from stallfree.core.analysis.disagg_plan import Link
    from stallfree.core.analysis.traces import Replay
    from stallfree.core.build import ModelSettings


def add_disaggregate_args(p: argparse.ArgumentParser, what: str) -> argparse._ArgumentGroup:
    """``--disaggregate P:D`` and the KV link's flags; ``what`` says what the command does with them."""
    d = p.add_argument_group(f"disaggregation (--disaggregate P:D: {what})")
    d.add_argument("--disaggregate", type=workers_pair, metavar="P:D", help="prefill and decode workers, e.g. 1:3")
    d.add_argument("--link-gbps", type=float, default=100.0, help="KV link per prefill worker (default %(default)g)")
    d.add_argument("--link-latency-ms", type=float, default=0.0, help="per transfer (default %(default)g)")
    return d


def kv_link(args: argparse.Namespace) -> Link:
    from stallfree.core.analysis.disagg_plan import Link

    return Link(args.link_gbps, args.link_latency_ms / 1e3)


def workers_pair(text: str) -> tuple[int, int]:
    """``P:D``: prefill and decode workers."""
    try:
        p, d = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected P:D (two integers), got {text!r}") from None
    if p < 1 or d < 1:
        raise argparse.ArgumentTypeError("P and D must be >= 1")
    return p, d


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("values must be >= 1")
    return values


def add_replay_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """How ``--trace`` is replayed (the trace flag itself is the command's)."""
    g = p.add_argument_group(
        "trace replay (--trace: Azure LLM 2023 .csv, Mooncake .jsonl with hash_ids, or stallfree's .jsonl)"
    )
    g.add_argument("--window", type=window, default=(0, None), metavar="START:COUNT", help="rows to replay")
    g.add_argument("--rate", type=float, help="mean arrival rate to replay them at, requests/s (rescales every gap)")
    g.add_argument("--time-scale", type=float, default=1.0, help="or multiply every inter-arrival gap (default 1)")
    g.add_argument("--length-scale", type=float, default=1.0, help="multiply prompt and output lengths (default 1)")
    g.add_argument("--max-context", type=int, help="cap prompt + output (output to half of it, prompt to the rest)")
    g.add_argument(
        "--keep-ties",
        action="store_true",
        help="replay requests logged at one time as one burst (default: spread evenly to the next logged time; "
        "Mooncake's trace logs on a 3 s grid)",
    )
    return g


def window(text: str) -> tuple[int, int | None]:
    """``START:COUNT`` (or ``START:`` to the end)."""
    start, _, count = text.partition(":")
    try:
        return int(start or 0), int(count) if count else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:COUNT, got {text!r}") from None


def replay_of(args: argparse.Namespace, rate: float | None = None) -> Replay:
    """The replay the flags describe (``rate``: instead of ``--rate``)."""
    from stallfree.core.analysis.traces import Replay

    start, count = args.window
    pace = rate if rate is not None else args.rate
    return Replay(
        start,
        count,
        pace,
        time_scale=args.time_scale,
        length_scale=args.length_scale,
        max_context=args.max_context,
        spread_ties=not args.keep_ties,
    )


def add_cost_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and hardware (defaults: the article's 8B model on its illustrative GPU)")
    m, hw = LLAMA3_8B, ARTICLE_GPU
    g.add_argument("--params", type=float, default=m.params, help="parameter count (default %(default).3g)")
    g.add_argument("--bytes-per-param", type=float, default=m.bytes_per_param, help="2 for bf16 (default)")
    g.add_argument("--layers", type=int, default=m.layers)
    g.add_argument("--heads", type=int, default=m.heads, help="query heads")
    g.add_argument("--kv-heads", type=int, default=m.kv_heads)
    g.add_argument("--head-dim", type=int, default=m.head_dim)
    g.add_argument("--flops", type=float, default=hw.flops, help="sustained FLOP/s (default %(default).3g)")
    g.add_argument("--mem-bw", type=float, default=hw.mem_bw, help="memory bandwidth, bytes/s (default %(default).3g)")
    g.add_argument("--overhead-ms", type=float, default=0.0, help="fixed cost per iteration")
    g.add_argument("--attention", action="store_true", help="add attention FLOPs to iteration times")
    g.add_argument("--kv-reads", action="store_true", help="add KV-cache reads to iteration times")


def cost_model(args: argparse.Namespace) -> CostModel:
    for name in ("params", "bytes_per_param", "flops", "mem_bw"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    model = ModelSpec(
        "custom", args.params, args.bytes_per_param, args.layers, args.heads, args.kv_heads, args.head_dim
    )
    if dataclasses.replace(model, name=LLAMA3_8B.name) == LLAMA3_8B:
        model = LLAMA3_8B
    hardware = HardwareSpec("custom", args.flops, args.mem_bw, args.overhead_ms / 1e3)
    if dataclasses.replace(hardware, name=ARTICLE_GPU.name) == ARTICLE_GPU:
        hardware = ARTICLE_GPU
    return CostModel(model, hardware, attention=args.attention, kv_reads=args.kv_reads)


SCHEDULER_FIELDS = (
    "chunking",
    "token_budget",
    "max_num_seqs",
    "max_partial_prefills",
    "max_model_len",
    "policy",
    "max_defer_s",
    "dynamic_chunking",
    "decode_reserve_tokens",
    "long_prefill_tokens",
    "tbt_slo_ms",
    "ttft_slo_ms",
    "ttft_reserve",
    "tbt_stretch",
    "speculate",
    "draft_tokens",
    "ngram_min",
    "ngram_max",
)


def add_scheduler_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduler (defaults: the scenario's, else the engine's)")
    g.add_argument("--chunking", choices=CHUNKING_MODES)
    g.add_argument("--token-budget", type=_budget, help="tokens per iteration (serve also takes 'auto')")
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--max-partial-prefills", type=int)
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--policy", choices=POLICIES)
    g.add_argument("--max-defer-s", type=float)
    g.add_argument(
        "--dynamic-chunking",
        action="store_true",
        default=None,
        help="shrink later chunks so iteration time stays level (needs --attention to matter)",
    )
    g.add_argument("--decode-reserve-tokens", type=int)
    g.add_argument(
        "--long-prefill-tokens",
        type=int,
        help="prompts with more tokens than this left to prefill are long: short ones go first "
        "(default 0: the token budget)",
    )
    g.add_argument(
        "--tbt-slo-ms",
        type=float,
        help="TBT target: while decodes run, each iteration's prefill is cut so its predicted time stays "
        "within this many ms; 0: off, the token budget alone (serve's default on the model: 5 x the "
        "decode-only iteration of 8 decodes it measures at start-up; elsewhere 0)",
    )
    g.add_argument(
        "--ttft-slo-ms",
        type=float,
        help="TTFT target: waiting and partly prefilled prompts go least slack first (deadline minus the "
        "predicted prefill time still needed); a request may set its own (ttft_slo_ms). 0: off, arrival order "
        "(serve's default on the model: 2000; elsewhere 0)",
    )
    g.add_argument(
        "--ttft-reserve",
        type=float,
        help="with TTFT targets: the share of each target kept in hand; while every queued prompt can make its "
        "deadline, prefill takes only the tokens that finish each by its deadline less that share, so iterations "
        "run below the TBT target (default 0: off, prefill as fast as the targets and budget allow)",
    )
    g.add_argument(
        "--tbt-stretch",
        type=float,
        help="with TBT and TTFT targets: while a queued prompt would miss its TTFT target at the TBT target's pace "
        "(or has), iterations may grow to this many times the TBT target (default 1: the target holds; serve's "
        "derived targets: 1.5)",
    )
    g.add_argument(
        "--speculate",
        choices=SPECULATE_MODES,
        help="ngram: speculative decoding by prompt lookup; drafts take only what decodes and prefill leave "
        "of the budget and TBT target, and only where the cost model says they pay (default off)",
    )
    g.add_argument("--draft-tokens", type=int, help="most draft tokens per decode (default 4)")
    g.add_argument("--ngram-min", type=int, help="shortest suffix looked up for drafts (default 2)")
    g.add_argument("--ngram-max", type=int, help="longest suffix looked up for drafts (default 4)")


def _budget(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("expected an integer or 'auto'") from None


def scheduler_config(args: argparse.Namespace, defaults: dict[str, Any]) -> SchedulerConfig:
    values = dict(defaults)
    if args.token_budget == "auto":
        raise ValueError("--token-budget auto needs the real model (stallfree serve)")
    for name in SCHEDULER_FIELDS:
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return SchedulerConfig(**values)


def add_kv_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulated KV cache")
    g.add_argument("--kv-blocks", type=int, default=8192, help="KV cache size in blocks (default %(default)s)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--no-prefix-caching", action="store_true")


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", help="GGUF file or Hugging Face directory (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", help="auto (bf16 with AMX/AVX512-BF16 or CUDA, else fp32), bf16, fp32")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda")
    g.add_argument(
        "--compute",
        default="float",
        choices=["float", "int8"],
        help="float: GEMMs in --dtype; int8: prefill chunks' GEMMs in int8 (activations per row, weights per "
        "output column; float32 elsewhere; needs AMX-INT8: ATen offers no int8 brgemm on AVX-512 VNNI alone)",
    )
    g.add_argument(
        "--kv-dtype",
        default="auto",
        help="the KV cache's dtype, in which attention runs: auto (the compute dtype) or bf16 (half the cache's "
        "bytes and attention on bf16 tiles under float32 GEMMs)",
    )
    g.add_argument("--threads", type=int, help="compute threads (default: all cores)")
    g.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV cache size (default %(default)s GiB)")


def model_settings(args: argparse.Namespace) -> ModelSettings:
    from stallfree.core.build import ModelSettings

    if args.threads is not None and args.threads < 1:
        raise ValueError("--threads must be >= 1")
    if args.kv_cache_gib <= 0:
        raise ValueError("--kv-cache-gib must be > 0")
    return ModelSettings(
        args.model,
        args.dtype,
        args.device,
        args.threads,
        args.kv_cache_gib,
        compute=args.compute,
        kv_dtype=args.kv_dtype,
    )


def add_json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")


def emit(args: argparse.Namespace, document: dict[str, Any], text: str) -> None:
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n")
    else:
        print(text)
