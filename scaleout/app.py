"""Deploy the engine replicas on Ray Serve and hand the gateway its handle."""

from __future__ import annotations

import os
from typing import Any

from core.analysis.cost_model import CostModel
from scaleout.replica import EngineReplica
from scaleout.spec import ReplicaSpec

APP_NAME = "stallfree"


def start_ray(ray_address: str | None, replicas: int, threads: int) -> None:
    """Join a cluster, or start a local one with a CPU per replica thread."""
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
            object_store_memory=256 * 2**20,  # only small messages travel (outputs, reports)
            include_dashboard=False,
            log_to_driver=False,
            runtime_env=env,
        )


def deploy(spec: ReplicaSpec, replicas: int, router: str, cost: CostModel | None = None, name: str = APP_NAME) -> Any:
    """N replicas, no Serve HTTP proxy: the stallfree gateway is the ingress."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    serve.start(proxy_location="Disabled")
    gpus = 1 if spec.device == "cuda" else 0
    deployment = serve.deployment(
        EngineReplica,
        name="engine",
        num_replicas=replicas,
        max_ongoing_requests=100_000,  # admission is the engine's (KV, max_num_seqs), not Serve's
        health_check_period_s=1.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=5.0,
        ray_actor_options={"num_cpus": 0 if spec.sim else spec.threads, "num_gpus": gpus},
        request_router_config=RequestRouterConfig(  # (Ray's pydantic stubs type every field as a dict)
            request_router_class="scaleout.router.StallfreeRequestRouter",  # type: ignore[arg-type]
            request_router_kwargs={"router": router, "cost": cost},
            request_routing_stats_period_s=spec.stats_period_s,  # type: ignore[arg-type]
            request_routing_stats_timeout_s=10.0,  # type: ignore[arg-type]
        ),
    )
    return serve.run(deployment.bind(spec), name=name, route_prefix=None)  # type: ignore[attr-defined]


def shutdown(name: str = APP_NAME) -> None:
    """Remove the replicas; leave (a joined) or stop (a local) Ray cluster."""
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.delete(name)
        ray.shutdown()
