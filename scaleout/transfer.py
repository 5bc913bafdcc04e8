"""How a prompt's KV travels from a prefill replica to a decode replica.

The runner exports a request's blocks (``Runner.export_kv``: its own format,
the paged layout of only those blocks); the prefill replica hands the payload
to a transport, which returns a ticket; the ticket travels with the request,
through the gateway, to a decode replica, which redeems it and has its runner
write the payload into fresh blocks (``Runner.import_kv``). Only the ticket
passes through the gateway. A transport for GPUs (NIXL, Mooncake) replaces
``ObjectStoreTransport`` behind the same two methods.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol


class KvTransport(Protocol):
    async def send(self, payload: object) -> object:
        """Keep the payload where a receiver can fetch it; return its ticket (small, picklable)."""
        ...

    async def receive(self, ticket: object) -> object:
        """The payload behind a ticket. Raises if it is gone (its sender died)."""
        ...


class ObjectStoreTransport:
    """Ray's object store: the ticket is an ObjectRef owned by the prefill
    replica, so the payload lives as long as a ticket does (or its owner),
    and the decode replica pulls it straight from the prefill replica's node."""

    async def send(self, payload: object) -> object:
        import ray

        # serialized off the replica's event loop; in a list, because a bare
        # ref passed as a call's argument arrives as its value
        return [await asyncio.to_thread(ray.put, payload)]

    async def receive(self, ticket: object) -> object:
        import ray

        refs: Any = ticket
        return await asyncio.to_thread(ray.get, refs[0])
