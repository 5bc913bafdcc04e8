"""Deploy the engine replicas on Ray Serve and hand the gateway its handle."""

from __future__ import annotations

import os
from typing import Any

from stallfree.core.analysis.cost_model import CostModel
from stallfree.scaleout.board import BOARDS
from stallfree.scaleout.replica import EngineReplica
from stallfree.scaleout.spec import ReplicaSpec

APP_NAME = "stallfree"


def start_ray(ray_address: str | None, replicas: int, threads: int, object_store_gib: float = 0.25) -> None:
    """Join a cluster, or start a local one with a CPU per replica thread.
    The object store carries small messages (outputs, reports) and, when
    serving disaggregated, prompts' KV on their way to a decode replica."""
    import ray

    if ray.is_initialized():
        return
    env = {"env_vars": {k: v for k, v in os.environ.items() if k.startswith(("OTEL_", "STALLFREE_"))}}
    if ray_address:
        ray.init(address=ray_address, runtime_env=env, log_to_driver=False)
    else:
        cpus = max(os.cpu_count() or 1, replicas * threads)
        # Ray runs its workers at niceness 15 unless told: the replicas' engines
        # would then lose every contended core to the gateway and its clients
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(
            address="local",
            num_cpus=cpus,
            object_store_memory=int(object_store_gib * 2**30),
            include_dashboard=False,
            log_to_driver=False,
            runtime_env=env,
        )


def deploy(
    spec: ReplicaSpec,
    replicas: int,
    router: str,
    cost: CostModel | None = None,
    name: str = APP_NAME,
    pool: str = "engine",
) -> Any:
    """N replicas, no Serve HTTP proxy: the stallfree gateway is the ingress.
    ``pool="prefill"``: disaggregated serving's prefill replicas, an
    application of their own (``prefill_app(name)``) beside the decode one."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    serve.start(proxy_location="Disabled")
    gpus = 1 if spec.device == "cuda" else 0
    deployment = serve.deployment(
        EngineReplica,
        name=pool,
        num_replicas=replicas,
        max_ongoing_requests=100_000,  # admission is the engine's (KV, max_num_seqs), not Serve's
        health_check_period_s=1.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=5.0,
        ray_actor_options={"num_cpus": 0 if spec.sim else spec.threads, "num_gpus": gpus},
        request_router_config=RequestRouterConfig(  # (Ray's pydantic stubs type every field as a dict)
            request_router_class="stallfree.scaleout.request_router.StallfreeRequestRouter",  # type: ignore[arg-type]
            request_router_kwargs={"router": router, "cost": cost, "pool": pool},
            request_routing_stats_period_s=spec.stats_period_s,  # type: ignore[arg-type]
            request_routing_stats_timeout_s=10.0,  # type: ignore[arg-type]
        ),
    )
    app = prefill_app(name) if pool == "prefill" else name
    return serve.run(deployment.bind(spec), name=app, route_prefix=None)  # type: ignore[attr-defined]


def prefill_app(name: str) -> str:
    return f"{name}-prefill"


def shutdown(name: str = APP_NAME) -> None:
    """Remove the replicas; leave (a joined) or stop (a local) Ray cluster."""
    import ray
    from ray import serve

    if ray.is_initialized():
        for app in (name, prefill_app(name)):
            if app in serve.status().applications:
                serve.delete(app)
        ray.shutdown()
    for board in BOARDS.values():
        board.clear()
