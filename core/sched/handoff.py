"""Disaggregated prefill: a prompt computed on one engine, decoded on another.

A prefill worker's request carries ``KvHandoff(export=True)``: once its
prompt is computed, the engine has the runner export the KV of all but its
last token into ``payload`` (opaque here: the runner's own format). A decode
worker's request arrives with ``KvHandoff(imported_tokens, payload)``: it is
admitted onto fresh blocks, the batch carries a ``KvImport`` the runner
writes into them first, and it decodes from its last prompt token on. How
the payload travels between engines is ``scaleout.transfer``'s business.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class KvHandoff:
    export: bool = False  # a prefill worker's: export the prompt's KV once computed
    imported_tokens: int = 0  # a decode worker's: the tokens whose KV arrived from elsewhere
    payload: object | None = None  # the KV: exported here, or arrived (taken once it is scheduled)


@dataclass(slots=True, frozen=True)
class KvImport:
    """KV computed by another engine, to write into these blocks before the batch runs."""

    block_ids: list[int]
    num_tokens: int
    payload: object
