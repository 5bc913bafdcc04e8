"""``stallfree`` command line: plan, simulate (serve and the rest join later).

Every ``--json`` output is exactly one JSON document on stdout; logs and
errors go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from core.build import ModelSettings, build_engine, build_sim_engine
from core.config import CHUNKING_MODES, POLICIES, CacheConfig, SchedulerConfig
from core.cost_model import ARTICLE_GPU, LLAMA3_8B, CostModel, HardwareSpec, ModelSpec
from core.detokenizer import Detokenizer
from core.export import export_hf_dir
from core.loader import ModelLoadError, load_model
from core.planner import format_plan, plan
from core.profiler import (
    Profile,
    choose_budget,
    default_profile_path,
    fit,
    format_profile,
    profile_runner,
    saved_or_quick_profile,
)
from core.request import Request, SamplingParams
from core.simulator import SCENARIOS, format_report, load_trace, report, scenario, simulate
from core.stats import request_timings
from gateway.auth import WILDCARD_HOSTS
from gateway.bench import add_bench_args, plot_report, run_bench
from gateway.bench import format_report as format_bench
from gateway.engine_client import EngineClient
from gateway.logs import configure_logging
from gateway.serve import log_startup, make_server
from gateway.settings import GatewaySettings
from gateway.tracing import Tracing


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("values must be >= 1")
    return values


def _add_cost_args(p: argparse.ArgumentParser) -> None:
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


def _cost(args: argparse.Namespace) -> CostModel:
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


def _add_scheduler_args(p: argparse.ArgumentParser) -> None:
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


def _add_kv_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulated KV cache")
    g.add_argument("--kv-blocks", type=int, default=8192, help="KV cache size in blocks (default %(default)s)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--no-prefix-caching", action="store_true")


def _budget(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("expected an integer or 'auto'") from None


def _scheduler_config(args: argparse.Namespace, defaults: dict[str, Any]) -> SchedulerConfig:
    values = dict(defaults)
    if args.token_budget == "auto":
        raise ValueError("--token-budget auto needs the real model (stallfree serve)")
    for name in (
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
    ):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return SchedulerConfig(**values)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", help="GGUF file or Hugging Face directory (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", help="auto (bf16 with AMX/AVX512-BF16 or CUDA, else fp32), bf16, fp32")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda")
    g.add_argument("--threads", type=int, help="torch threads (default: all cores; serve: all but one)")
    g.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV cache size (default %(default)s GiB)")


def _model_settings(args: argparse.Namespace) -> ModelSettings:
    if args.threads is not None and args.threads < 1:
        raise ValueError("--threads must be >= 1")
    if args.kv_cache_gib <= 0:
        raise ValueError("--kv-cache-gib must be > 0")
    return ModelSettings(args.model, args.dtype, args.device, args.threads, args.kv_cache_gib)


def _emit(args: argparse.Namespace, document: dict[str, Any], text: str) -> None:
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n")
    else:
        print(text)


def cmd_plan(args: argparse.Namespace) -> None:
    p = plan(_cost(args), args.decoders, args.prompt, args.budget, args.burst, args.decode_context)
    _emit(args, p, format_plan(p))


def cmd_simulate(args: argparse.Namespace) -> None:
    if args.trace:
        arrivals, defaults = load_trace(args.trace), {}
    else:
        arrivals, defaults = scenario(args.scenario)
    config = _scheduler_config(args, defaults)
    cache = CacheConfig(args.kv_blocks, args.block_size, not args.no_prefix_caching)
    cost = Profile.load(args.profile).cost_model if args.profile else _cost(args)
    result = simulate(arrivals, config, cache, cost)
    for warning in result.engine.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    rep = report(result)
    rep["scenario"] = str(args.trace) if args.trace else args.scenario
    _emit(args, rep, format_report(rep, show_iterations=args.iterations))


def cmd_generate(args: argparse.Namespace) -> None:
    """Stream one answer to stdout; timings to stderr."""
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    sampling.validate()
    engine, runner = build_engine(_model_settings(args), SchedulerConfig())
    tok = runner.tokenizer
    text = args.prompt if args.raw else tok.render_chat([{"role": "user", "content": args.prompt}])
    req = Request("generate", tok.encode(text), sampling, time.perf_counter_ns())
    engine.add_request(req)
    detok = Detokenizer(tok.token_bytes, sampling.stop)
    while engine.has_work and not detok.stopped:
        out = engine.step()
        for o in out.outputs if out else []:
            sys.stdout.write(detok.push(o.new_token_ids))
            sys.stdout.flush()
    if detok.stopped:
        engine.abort_request(req.request_id)
    sys.stdout.write(detok.flush() + "\n")
    t = request_timings(req.timeline)
    n = req.num_output_tokens
    print(
        f"[{req.num_prompt_tokens} prompt tokens, {n} generated, TTFT {t.ttft_ms:.0f} ms, "
        f"{(n - 1) / (t.decode_ms / 1e3) if n > 1 and t.decode_ms else 0:.1f} tokens/s decoding, "
        f"{runner.dtype}, {runner.threads} threads]",
        file=sys.stderr,
    )


def cmd_profile(args: argparse.Namespace) -> None:
    if args.refit:  # the measured points again, through the current cost model's fit
        prof = Profile.load(args.refit)
        rows = args.small_batch_rows
        cost = fit(prof.spec, prof.points, prof.hardware.small_batch_rows if rows is None else rows)
        prof.hardware = cost.hardware
        path = args.save or args.refit
    else:
        settings = _model_settings(args)
        engine, runner = build_engine(settings, SchedulerConfig())
        prof = profile_runner(runner, engine.kv.num_blocks, runner.threads, quick=args.quick)
        path = args.save or default_profile_path(runner.config.name, prof.dtype, runner.threads)
    prof.save(path)
    print(f"profile saved to {path}", file=sys.stderr)
    budget, how = choose_budget(prof.points, args.tpot_slo_ms)
    doc = {**prof.to_json(), "tpot_slo_ms": args.tpot_slo_ms, "token_budget": budget, "token_budget_basis": how}
    _emit(args, doc, format_profile(prof, args.tpot_slo_ms))


def cmd_serve(args: argparse.Namespace) -> None:
    auto_budget = args.token_budget == "auto"
    if auto_budget:
        args.token_budget = None
    config = _scheduler_config(args, {})
    keys = tuple(args.api_key or ()) + tuple(k for k in os.environ.get("STALLFREE_API_KEYS", "").split(",") if k)
    settings = GatewaySettings(
        max_waiting=args.max_waiting,
        max_generations_per_connection=args.max_generations_per_connection,
        key_token_rate=args.key_token_rate,
        slow_consumer_s=args.slow_consumer_s,
        api_keys=keys,
        allowed_origins=tuple(args.allowed_origin or ()),
        host_names=() if args.host in WILDCARD_HOSTS else (args.host,),
        drain_timeout_s=args.drain_timeout_s,
    )
    facts: dict[str, object] = {}
    if args.sim:
        cost = Profile.load(args.sim_profile).cost_model if args.sim_profile else None
        engine, tokenizer = build_sim_engine(
            config, cost, args.kv_cache_gib, time_scale=args.sim_time_scale, read_context=False
        )
        settings.model_name = "stallfree-sim"
        facts = {"runner": "simulated"}
    else:
        settings_model = _model_settings(args)
        if settings_model.threads is None:
            # leave a core to the event loop, tokenization and local clients
            # (bench/results/serve_threads.md: 1 thread serves as well as 2 here)
            settings_model.threads = max(1, (os.cpu_count() or 2) - 1)
        engine, runner = build_engine(settings_model, config)
        tokenizer = runner.tokenizer
        settings.model_name = args.model_name or runner.config.name
        facts = {
            "runner": "torch",
            "dtype": str(runner.dtype),
            "threads": runner.threads,
            "device": str(runner.device),
            "kernels": runner.kernels,
        }
        if auto_budget or args.dynamic_chunking:
            prof, source = saved_or_quick_profile(runner, engine.kv.num_blocks, runner.threads)
            engine.scheduler.chunk_limit = prof.cost_model.level_chunk
            facts["profile"] = source
            if auto_budget:
                budget, how = choose_budget(prof.points, args.tpot_slo_ms)
                engine.warnings += engine.reconfigure({"token_budget": budget})
                facts["token_budget_basis"] = f"auto for a {args.tpot_slo_ms:g} ms TPOT: {how}"
    # the step thread's Python (scheduling, input prep) holds the GIL in 5 ms
    # slices by default, delaying the event loop's fan-out by as much
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    tracing = Tracing.from_env(args.trace_iterations)
    facts["tracing"] = "otlp" if tracing is not None else "off"
    client = EngineClient(engine, tokenizer, settings, tracing, log_text=args.log_text)
    send_buffer = int(args.send_buffer_kib * 1024) if args.send_buffer_kib else None
    server = make_server(client, args.host, args.port, send_buffer_bytes=send_buffer)
    log_startup(engine, client, api_keys=len(keys), host=args.host, port=args.port, **facts)
    # Startup objects (tokenizer tables, model config, modules) move out of the
    # collector's way: full collections over them stalled token delivery.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)  # fewer young collections in the middle of a fan-out burst
    server.run()
    if client.fatal is not None:
        sys.exit(f"stallfree: the engine stopped: {client.fatal}")


def cmd_export(args: argparse.Namespace) -> None:
    loaded = load_model(args.model)
    export_hf_dir(loaded, args.out)
    print(f"wrote {loaded.config.name} ({loaded.source}) to {args.out}", file=sys.stderr)


def cmd_bench(args: argparse.Namespace) -> None:
    report = run_bench(args)
    if args.out:
        (args.out).mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
        for path in plot_report(report, args.out):
            print(f"wrote {path}", file=sys.stderr)
    _emit(args, report, format_bench(report))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stallfree", description="Stall-free LLM serving gateway and tools.")
    parser.add_argument("--log-level", help="log level on stderr (default: info for serve, else warning)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="the article's roofline arithmetic for a model, GPU and token budget")
    _add_cost_args(p)
    p.add_argument("--decoders", type=int, default=64, help="running decode requests (default %(default)s)")
    p.add_argument("--prompt", type=int, default=8192, help="long prompt tokens (default %(default)s)")
    p.add_argument(
        "--budget",
        type=_int_list,
        default=(576,),
        help="token budget(s), comma-separated; the first is the headline (default 576)",
    )
    p.add_argument("--burst", type=int, default=10, help="prompts in the burst example (default %(default)s)")
    p.add_argument("--decode-context", type=int, default=0, help="cached tokens per decoder (for --kv-reads)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.set_defaults(func=cmd_plan)

    s = sub.add_parser("simulate", help="run a workload through the real scheduler on a virtual clock")
    src = s.add_mutually_exclusive_group()
    src.add_argument("--scenario", default="seed-figure3", choices=SCENARIOS, help="default %(default)s")
    src.add_argument("--trace", type=Path, help="JSONL workload: t, prompt_tokens, output_tokens[, prefix, ...]")
    _add_scheduler_args(s)
    _add_kv_args(s)
    _add_cost_args(s)
    s.add_argument("--profile", type=Path, help="cost model from `stallfree profile` (this machine's real model)")
    s.add_argument("--iterations", action="store_true", help="also print every iteration")
    s.add_argument("--json", action="store_true", help="one JSON document on stdout")
    s.set_defaults(func=cmd_simulate)
    g = sub.add_parser("generate", help="stream one answer from the model (greedy by default)")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    _add_model_args(g)
    g.set_defaults(func=cmd_generate)
    pr = sub.add_parser("profile", help="measure iteration time on the real model; choose token_budget from a TPOT SLO")
    pr.add_argument("--tpot-slo-ms", type=float, default=100.0, help="TPOT target (default %(default)s ms)")
    pr.add_argument("--quick", action="store_true", help="fewer points (about half the time)")
    pr.add_argument("--save", type=Path, help="where to write the profile (default: ~/.cache/stallfree/)")
    pr.add_argument("--json", action="store_true", help="one JSON document on stdout")
    pr.add_argument("--refit", type=Path, help="fit a saved profile's measured points again (no measuring)")
    pr.add_argument(
        "--small-batch-rows",
        type=int,
        help="with --refit: batches up to this many tokens ran the compact decode GEMMs (default: as saved)",
    )
    _add_model_args(pr)
    pr.set_defaults(func=cmd_profile)
    sv = sub.add_parser("serve", help="run the gateway: WebSocket streaming, OpenAI-compatible API, dashboard")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    _add_model_args(sv)
    sv.add_argument("--model-name", help="the model id the API reports (default: the model's own name)")
    _add_scheduler_args(sv)
    sv.add_argument("--tpot-slo-ms", type=float, default=100.0, help="TPOT target for --token-budget auto")
    gw = sv.add_argument_group("gateway")
    gw.add_argument("--api-key", action="append", help="require this key (repeatable; also STALLFREE_API_KEYS)")
    gw.add_argument(
        "--allowed-origin",
        action="append",
        help="browser origin allowed to use the API and sockets, e.g. http://myhost:8000 (repeatable; "
        "default: localhost and --host)",
    )
    gw.add_argument("--max-waiting", type=int, default=256, help="waiting requests before 'overloaded'")
    gw.add_argument("--max-generations-per-connection", type=int, default=32)
    gw.add_argument(
        "--key-token-rate",
        type=float,
        default=0.0,
        help="tokens/s each API key may use, prompt + generated (429 with Retry-After beyond; default: no limit)",
    )
    gw.add_argument("--slow-consumer-s", type=float, default=30.0, help="unread tokens this old cancel a stream")
    gw.add_argument("--drain-timeout-s", type=float, default=10.0, help="grace period on shutdown")
    gw.add_argument("--send-buffer-kib", type=float, help="kernel send buffer per connection (default: the OS's)")
    gw.add_argument("--switch-interval-ms", type=float, default=1.0, help="GIL switch interval (default %(default)s)")
    ob = sv.add_argument_group("observability (traces: the standard OTEL_* variables, off unless an endpoint is set)")
    ob.add_argument("--trace-iterations", type=float, default=0.0, help="fraction of iterations traced as spans")
    ob.add_argument("--log-text", action="store_true", help="log prompt and completion text (off by default)")
    sim = sv.add_argument_group("simulated runner (no model: the cost model sets each iteration's time)")
    sim.add_argument("--sim", action="store_true", help="serve with the simulated runner")
    sim.add_argument("--sim-profile", type=Path, help="cost model from `stallfree profile`")
    sim.add_argument("--sim-time-scale", type=float, default=1.0, help="multiply simulated iteration times")
    sv.set_defaults(func=cmd_serve)
    ex = sub.add_parser("export", help="write a model as a Hugging Face directory (safetensors + tokenizer.json)")
    ex.add_argument("out", type=Path)
    ex.add_argument("--model", help="GGUF file or HF directory (default: the embedded SmolLM2)")
    ex.set_defaults(func=cmd_export)

    be = sub.add_parser("bench", help="load a server (this one or any OpenAI-compatible) and report latencies")
    add_bench_args(be)
    be.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level or ("info" if args.command == "serve" else "warning"))
    try:
        args.func(args)
    except (ValueError, OSError, ModelLoadError, httpx.HTTPError) as exc:
        print(f"stallfree {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
