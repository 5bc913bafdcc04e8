"""``stallfree serve``: run the gateway: WebSocket streaming, OpenAI-compatible API, dashboard."""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stallfree.cli.options import add_model_args, add_scheduler_args, model_settings, scheduler_config, workers_pair
from stallfree.core.cluster.router import ROUTERS

if TYPE_CHECKING:
    from stallfree.core.model.model_runner import ModelRunner
    from stallfree.core.model.tokenizer import Tokenizer
    from stallfree.core.sched.config import SchedulerConfig
    from stallfree.core.sched.engine_process import BuiltEngine
    from stallfree.gateway.engine.backend import EngineBackend
    from stallfree.gateway.observe.tracing import Tracing


def add_parser(sub: Any) -> argparse.ArgumentParser:
    sv: argparse.ArgumentParser = sub.add_parser("serve", help=__doc__.split(": ", 1)[1].rstrip("."))
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    add_model_args(sv)
    sv.add_argument("--model-name", help="the model id the API reports (default: the model's own name)")
    add_scheduler_args(sv)
    sv.add_argument("--tpot-slo-ms", type=float, default=100.0, help="TPOT target for --token-budget auto")
    sv.add_argument(
        "--profile",
        type=Path,
        help="cost model from `stallfree profile` (default: the one saved for this model, dtype and threads)",
    )
    gw = sv.add_argument_group("gateway")
    gw.add_argument(
        "--api-key",
        action="append",
        help="require this key to generate (repeatable; also STALLFREE_API_KEYS); the n-th key's tenant is key-<n>",
    )
    gw.add_argument(
        "--admin-key",
        action="append",
        help="an operator key: once any key is set, only these change live settings (PUT /api/config); "
        "they also generate, unbounded by grants (repeatable; also STALLFREE_ADMIN_KEYS)",
    )
    gw.add_argument(
        "--key-grant",
        action="append",
        metavar="key-<n>:priority=<int>,ttft_slo_ms=<ms>",
        help="let API key n ask a priority below 0 or a TTFT target tighter than the server's (repeatable; "
        "default: neither)",
    )
    gw.add_argument(
        "--share-prefix-cache",
        action="store_true",
        help="one prefix cache for all API keys (only when they are one tenant; default: each key hits only its own)",
    )
    gw.add_argument(
        "--allowed-origin",
        action="append",
        help="browser origin allowed to use the API and sockets, e.g. http://myhost:8000 (repeatable; "
        "default: localhost and --host)",
    )
    gw.add_argument("--max-waiting", type=int, default=256, help="waiting requests before 'overloaded'")
    gw.add_argument(
        "--max-waiting-per-key", type=int, default=128, help="one API key's share of --max-waiting (0: no share)"
    )
    gw.add_argument("--max-generations-per-connection", type=int, default=32)
    gw.add_argument(
        "--key-token-rate",
        type=float,
        default=0.0,
        help="tokens/s each API key may use, prompt + generated (429 with Retry-After beyond; default: no limit)",
    )
    gw.add_argument(
        "--shed-load",
        action="store_true",
        help="refuse at once (429, Retry-After) a request the queue forecast says cannot meet its TTFT target "
        "because of the queue ahead, instead of admitting it best-effort (live: PUT /api/config shed_load)",
    )
    gw.add_argument("--slow-consumer-s", type=float, default=30.0, help="unread tokens this old cancel a stream")
    gw.add_argument(
        "--stalled-connection-s", type=float, default=60.0, help="a client that reads nothing this long is dropped"
    )
    gw.add_argument("--max-connections", type=int, default=8192, help="open connections in all (503 beyond)")
    gw.add_argument("--max-connections-per-client", type=int, default=2048, help="open connections per address")
    gw.add_argument("--header-timeout-s", type=float, default=10.0, help="request line + headers arrive within this")
    gw.add_argument("--drain-timeout-s", type=float, default=10.0, help="grace period on shutdown")
    gw.add_argument("--send-buffer-kib", type=float, help="kernel send buffer per connection (default: the OS's)")
    sv.add_argument(
        "--engine",
        choices=("process", "thread"),
        default="process",
        help="where the step loop runs: an engine process of its own (default), or a thread of this one",
    )
    gw.add_argument(
        "--switch-interval-ms",
        type=float,
        default=1.0,
        help="GIL switch interval in the gateway's process, where --engine thread's step thread runs too "
        "(default %(default)s)",
    )
    gw.add_argument(
        "--engine-switch-interval-ms",
        type=float,
        default=5.0,
        help="GIL switch interval in the engine process (default %(default)s, Python's own; "
        "bench/README: Thread placement)",
    )
    ob = sv.add_argument_group("observability (traces: the standard OTEL_* variables, off unless an endpoint is set)")
    ob.add_argument("--trace-iterations", type=float, default=0.0, help="fraction of iterations traced as spans")
    ob.add_argument("--log-text", action="store_true", help="log prompt and completion text (off by default)")
    sim = sv.add_argument_group("simulated runner (no model: the cost model sets each iteration's time)")
    sim.add_argument("--sim", action="store_true", help="serve with the simulated runner")
    sim.add_argument("--sim-profile", type=Path, help="cost model from `stallfree profile`")
    sim.add_argument("--sim-time-scale", type=float, default=1.0, help="multiply simulated iteration times")
    ro = sv.add_argument_group("scale-out on Ray Serve (this process stays the gateway: the cluster's ingress)")
    ro.add_argument("--replicas", type=int, help="engine replicas (default: one engine in this process)")
    ro.add_argument(
        "--disaggregate",
        type=workers_pair,
        metavar="P:D",
        help="P prefill and D decode replicas instead: prompts computed on one, their KV moved to the other",
    )
    ro.add_argument("--object-store-gib", type=float, help="local Ray's object store (default 0.25, 2 disaggregated)")
    ro.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    ro.add_argument("--ray-app", default="stallfree", help="Serve application name (default %(default)s)")
    ro.add_argument("--router", default="cost", choices=ROUTERS, help="replica choice (default %(default)s)")
    ro.add_argument("--stats-period-s", type=float, default=0.25, help="routing report period (default %(default)s)")
    return sv


def run(args: argparse.Namespace) -> None:
    """One bootstrap: the engine here or on Ray replicas (the backend), then the
    same gateway, start-up log, collector settings and exit status for both."""
    from stallfree.gateway.edge.auth import WILDCARD_HOSTS
    from stallfree.gateway.edge.connections import raise_file_limit
    from stallfree.gateway.edge.grants import parse_grant
    from stallfree.gateway.engine.client import EngineClient
    from stallfree.gateway.observe.tracing import Tracing
    from stallfree.gateway.server import log_startup, make_server
    from stallfree.gateway.settings import GatewaySettings

    auto_budget = args.token_budget == "auto"
    if auto_budget:
        args.token_budget = None
    config = scheduler_config(args, {})
    keys = tuple(args.api_key or ()) + tuple(k for k in os.environ.get("STALLFREE_API_KEYS", "").split(",") if k)
    admin_keys = tuple(args.admin_key or ()) + tuple(
        k for k in os.environ.get("STALLFREE_ADMIN_KEYS", "").split(",") if k
    )
    grants = dict(parse_grant(text) for text in args.key_grant or ())
    if unknown := sorted(t for t in grants if int(t.removeprefix("key-")) not in range(1, len(keys) + 1)):
        raise ValueError(f"--key-grant names {', '.join(unknown)}, but only {len(keys)} API key(s) are set")
    settings = GatewaySettings(
        max_waiting=args.max_waiting,
        max_waiting_per_key=args.max_waiting_per_key,
        max_generations_per_connection=args.max_generations_per_connection,
        key_token_rate=args.key_token_rate,
        slow_consumer_s=args.slow_consumer_s,
        stalled_connection_s=args.stalled_connection_s,
        api_keys=keys,
        admin_keys=admin_keys,
        key_grants=grants,
        share_prefix_cache=args.share_prefix_cache,
        allowed_origins=tuple(args.allowed_origin or ()),
        host_names=() if args.host in WILDCARD_HOSTS else (args.host,),
        drain_timeout_s=args.drain_timeout_s,
        header_timeout_s=args.header_timeout_s,
        max_connections_per_client=args.max_connections_per_client,
        shed_load=args.shed_load,
    )
    # every connection is a file: the soft limit up to the hard one, the cap below it
    files_before, files = raise_file_limit()
    settings.max_connections = min(args.max_connections, files - 64)
    facts: dict[str, object] = {"open_files_limit": f"{files_before} -> {files}" if files != files_before else files}
    facts["max_connections"] = settings.max_connections
    tracing = Tracing.from_env(args.trace_iterations)
    facts["tracing"] = "otlp" if tracing is not None else "off"
    replicated = args.replicas is not None or args.disaggregate is not None
    if replicated:
        backend, tokenizer, name = replica_backend(args, config, auto_budget, tracing, facts)
    else:
        backend, tokenizer, name = local_backend(args, config, auto_budget, facts)
    settings.model_name = args.model_name or name
    # a thread's Python holds the GIL in 5 ms slices by default: here the step
    # thread's (--engine thread) would delay the event loop's fan-out by as much.
    # The engine process has no event loop and keeps its own interval
    # (--engine-switch-interval-ms, Python's 5 ms by default: 1 ms there was
    # no faster, and slower in one trial).
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    client = EngineClient(backend, tokenizer, settings, tracing, log_text=args.log_text)
    send_buffer = int(args.send_buffer_kib * 1024) if args.send_buffer_kib else None
    server = make_server(client, args.host, args.port, send_buffer_bytes=send_buffer)
    facts["share_prefix_cache"] = settings.share_prefix_cache
    log_startup(client, api_keys=len(keys), admin_keys=len(admin_keys), host=args.host, port=args.port, **facts)
    # Startup objects (tokenizer tables, model config, modules) move out of the
    # collector's way: full collections over them stalled token delivery.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)  # fewer young collections in the middle of a fan-out burst
    try:
        server.run()
    finally:
        if replicated:
            from stallfree.scaleout import app

            app.shutdown(args.ray_app)
    if client.fatal is not None:
        sys.exit(f"stallfree: the engine stopped: {client.fatal}")


def local_backend(
    args: argparse.Namespace, config: SchedulerConfig, auto_budget: bool, facts: dict[str, object]
) -> tuple[EngineBackend, Tokenizer, str]:
    """One engine on this machine: in an engine process of its own (``--engine
    process``, the default) or on this process's step thread (``--engine thread``)."""
    from functools import partial

    from stallfree.core.model.embedded import load_tokenizer

    tokenizer = load_tokenizer(None if args.sim else args.model)
    facts["engine"] = args.engine
    if args.engine == "process":
        from stallfree.gateway.engine.process import EngineProcess

        process = EngineProcess(
            partial(local_engine, args, config, auto_budget), switch_interval_s=args.engine_switch_interval_ms / 1e3
        )
        facts |= process.facts
        return process, tokenizer, process.name
    from stallfree.core.sched.step_loop import StepLoop, on_own_thread

    built = on_own_thread(partial(local_engine, args, config, auto_budget))
    facts |= built.facts
    return StepLoop(built.engine), tokenizer, built.name


def local_engine(args: argparse.Namespace, config: SchedulerConfig, auto_budget: bool) -> BuiltEngine:
    """The engine the command line asks for (the simulated runner or the model),
    built where it will run, with what the start-up log says of it."""
    from stallfree.core.analysis.profiler import Profile, choose_budget
    from stallfree.core.analysis.targets import derived_targets, measured_decode_s
    from stallfree.core.sched.engine_process import BuiltEngine

    if args.sim:
        from stallfree.core.build import build_sim_engine

        cost = Profile.load(args.sim_profile).cost_model if args.sim_profile else None
        engine, _ = build_sim_engine(
            config, cost, args.kv_cache_gib, time_scale=args.sim_time_scale, read_context=False
        )
        return BuiltEngine(engine, "stallfree-sim", {"runner": "simulated"})
    from stallfree.core.build import engine_over, load_runner, startup_profile

    settings_model = model_settings(args)
    if settings_model.threads is None:
        # every core computes: through the server on 2 cores, 2 threads ran decode iterations
        # 1.46-1.71x faster than 1 while the gateway used 0.03 of a core and the client 0.02
        # (bench/results/server_overhead-2026-12-05.md; the kernels built without OpenMP had
        # made a second thread worth nothing, bench/results/serve_threads.md)
        settings_model.threads = os.cpu_count() or 1
    runner = load_runner(settings_model)
    # a target in time, the auto budget, dynamic chunking and the drafts' cost rule deserve a fitted
    # model, measured now if none is saved; a target not set is derived (core.analysis.targets)
    derive = args.tbt_slo_ms is None or args.ttft_slo_ms is None
    targets = derive or bool(config.tbt_slo_ms or config.ttft_slo_ms)
    measure = auto_budget or bool(args.dynamic_chunking) or targets or config.speculate != "off"
    prof, source = startup_profile(runner, args.profile, measure)
    engine = engine_over(runner, config, prof)
    facts = runner_facts(runner) | {
        "cost_model": source if prof is not None else "prior (no profile saved: run `stallfree profile`)",
    }
    if derive:  # the decode probe runs before any target is set: its iterations are the engine's first
        derived = derived_targets(measured_decode_s(engine) if args.tbt_slo_ms is None else None)
        unset = {name: v for name, v in derived.settings.items() if getattr(args, name) is None}
        engine.warnings += engine.reconfigure(unset)
        facts["targets_basis"] = f"derived where not set: {derived.basis}"
    if auto_budget:
        assert prof is not None
        budget, how = choose_budget(prof.points, args.tpot_slo_ms)
        engine.warnings += engine.reconfigure({"token_budget": budget})
        facts["token_budget_basis"] = f"auto for a {args.tpot_slo_ms:g} ms TPOT: {how}"
    return BuiltEngine(engine, runner.config.name, facts)


def runner_facts(runner: ModelRunner) -> dict[str, object]:
    """What the start-up log says of the model runner: dtypes, threads, and on
    CPU the machine's kind and each op's kernel path."""
    return {
        "runner": "torch",
        "dtype": str(runner.dtype),
        "kv_dtype": str(runner.kv_dtype),
        "threads": runner.threads,
        "device": str(runner.device),
        "kernels": runner.kernels,
        **({"kernel_paths": runner.kernel_paths} if runner.kernel_paths else {}),
    }


def replica_backend(
    args: argparse.Namespace,
    config: SchedulerConfig,
    auto_budget: bool,
    tracing: Tracing | None,
    facts: dict[str, object],
) -> tuple[EngineBackend, Tokenizer, str]:
    """N engines on Ray Serve replicas behind the router (P prefill + D decode, disaggregated)."""
    if importlib.util.find_spec("ray") is None:
        raise ValueError(
            "--replicas and --disaggregate run engines on Ray Serve, which is not installed:"
            " pip install 'stallfree[scale]' (make test installs it)"
        )
    # the flags first: a refusal comes before torch and Ray are imported (2 s -> 0.3 s here)
    if args.replicas is not None and args.disaggregate is not None:
        raise ValueError("--replicas and --disaggregate are exclusive: P:D sets both pools")
    prefill, decode = args.disaggregate or (0, args.replicas)
    if decode < 1:
        raise ValueError("--replicas must be >= 1")
    if args.model is not None and not args.model.endswith(".gguf"):
        raise ValueError("--replicas serves the embedded model or a GGUF file")
    if auto_budget or args.dynamic_chunking:
        raise ValueError("--token-budget auto and --dynamic-chunking need a local engine (no --replicas)")
    from stallfree.core.analysis.profiler import Profile
    from stallfree.core.model.gguf import GGUFFile
    from stallfree.core.model.loader import embedded_model_path, gguf_config
    from stallfree.core.model.tokenizer import Tokenizer
    from stallfree.scaleout import app
    from stallfree.scaleout.remote import RemoteEngine
    from stallfree.scaleout.spec import ReplicaSpec

    spec = ReplicaSpec(
        config,
        sim=args.sim,
        sim_time_scale=args.sim_time_scale,
        model=args.model,
        dtype=args.dtype,
        compute=args.compute,
        kv_dtype=args.kv_dtype,
        device=args.device,
        threads=args.threads or 1,
        kv_cache_gib=args.kv_cache_gib,
        stats_period_s=args.stats_period_s,
    )
    gguf = GGUFFile(args.model or embedded_model_path())
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    cost = Profile.load(args.sim_profile).cost_model if args.sim_profile else None
    store_gib = args.object_store_gib or (2.0 if prefill else 0.25)  # prompts' KV passes through it
    app.start_ray(args.ray_address, prefill + decode, spec.threads, store_gib)
    # decode replicas take over prompts computed elsewhere: the least loaded one does
    handle = app.deploy(spec, decode, "least_loaded" if prefill else args.router, cost, args.ray_app)
    prefill_handle = app.deploy(spec, prefill, args.router, cost, args.ray_app, pool="prefill") if prefill else None
    traceparent = tracing.traceparent if tracing is not None else (lambda request_id: None)
    backend = RemoteEngine(handle, spec, prefill + decode, tokenizer.vocab_size, traceparent, prefill_handle)
    facts |= {
        "replicas": prefill + decode,
        "disaggregated": f"{prefill}:{decode}" if prefill else None,
        "router": args.router,
        "runner": "simulated" if args.sim else "torch",
    }
    return backend, tokenizer, "stallfree-sim" if args.sim else gguf_config(gguf).name
