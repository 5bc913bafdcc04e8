"""The runner seam: the engine hands it a batch, it returns sampled tokens.

Two implementations share the scheduler: the torch model runner
(``core.model.model_runner``) and the cost-model runner
(``core.analysis.sim_runner``).
"""

from __future__ import annotations

from typing import Protocol

from core.sched.batch import Batch, Sampled


class Runner(Protocol):
    eos_token_ids: frozenset[int]
    vocab_size: int  # rows of the logits: the largest meaningful top_k

    def execute(self, batch: Batch) -> Sampled:
        """Run the batch; return one token per item that samples, in item order.
        First ``batch.copies``, then each of ``batch.imports``' ``kv_payload``
        into its blocks (``import_kv``)."""
        ...

    def export_kv(self, block_ids: list[int], num_tokens: int) -> object:
        """The KV of the first num_tokens tokens held in these blocks, to move to
        another engine (disaggregated prefill): the one transfer format, whatever
        carries it (Ray's object store here; NIXL or another transport on GPUs)."""
        ...

    def import_kv(self, block_ids: list[int], num_tokens: int, payload: object) -> None:
        """Write an ``export_kv`` payload into these (fresh) blocks."""
        ...
