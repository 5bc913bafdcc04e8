"""Scale-out on Ray Serve: engine replicas behind stallfree's router.

``stallfree serve --replicas N`` keeps the Starlette gateway in its own
process as the cluster's ingress (it tokenizes, admits, streams to clients)
and deploys N ``EngineReplica`` deployments; ``StallfreeRequestRouter``
places each request, and ``RemoteEngine`` stands in for the step loop the
gateway would otherwise own.
"""
