"""The runner seam: the engine hands it a batch, it returns sampled tokens.

Two implementations share the scheduler: the torch model runner
(``core.model.model_runner``) and the cost-model runner
(``core.analysis.sim_runner``).
"""

from __future__ import annotations

from typing import Protocol

from stallfree.core.sched.batch import Batch, Sampled


class Runner(Protocol):
    eos_token_ids: frozenset[int]
    vocab_size: int  # rows of the logits: the largest meaningful top_k

    def execute(self, batch: Batch) -> Sampled:
        """Run the batch's items; return, per item that samples and in item order, the
        tokens it yields: one, or a speculating decode's kept drafts and the token
        after them (``core.sched.drafts.verified``). The engine has had the runner
        release, copy and import what the batch names."""
        ...

    def release(self, request_ids: list[str]) -> None:
        """Drop whatever the runner keeps per request for these (ended) requests;
        an id it does not know is no error."""
        ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, copy) KV block: copy on write of a shared block."""
        ...

    def export_kv(self, block_ids: list[int], num_tokens: int) -> object:
        """The KV of the first num_tokens tokens held in these blocks, to move to
        another engine (disaggregated prefill): the one transfer format, whatever
        carries it (Ray's object store here; NIXL or another transport on GPUs)."""
        ...

    def import_kv(self, block_ids: list[int], num_tokens: int, payload: object) -> None:
        """Write an ``export_kv`` payload into these (fresh) blocks."""
        ...
