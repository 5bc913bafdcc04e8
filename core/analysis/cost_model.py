"""Roofline cost of one iteration: the article's arithmetic as code.

A linear layer over T tokens does 2 x params x T FLOPs and reads the weights
once, so the linear layers take max(compute, weight reads); with a fixed
per-iteration overhead that is the article's worked arithmetic. Two
refinements it sets aside can be switched on: attention's FLOPs over the
cached prefix (quadratic in prompt length) and the KV bytes each token's
attention reads (decode context and the chunk re-read of earlier chunks).
Attention runs after the projections, not beside them, so its own roofline,
max(attention compute, KV reads), is added to the linear layers'. On CPU,
small-batch GEMMs do not hide weight reads under compute either: a fitted
profile may set ``overlap=False`` and add the two. Where small batches run a
different GEMM altogether (the compact decode weights on CPU, up to
``small_batch_rows`` tokens), they get their own fitted FLOP/s and
weight-read rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stallfree.core.sched.cost import Chunks


@dataclass(slots=True, frozen=True)
class ModelSpec:
    name: str
    params: float  # parameter count
    bytes_per_param: float
    layers: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    kv_bytes_per_value: float = 2.0

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return int(2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_value)

    def attention_flops(self, prefix: int, n: int) -> float:
        """QK^T and PV for n causal queries after `prefix` cached tokens."""
        pairs = n * prefix + n * (n + 1) / 2
        return 4.0 * self.layers * self.heads * self.head_dim * pairs


@dataclass(slots=True, frozen=True)
class HardwareSpec:
    name: str
    flops: float  # sustained dense FLOP/s
    mem_bw: float  # bytes/s
    overhead_s: float = 0.0  # fixed per iteration: scheduling, launch, sampling
    # attention kernels often run well below GEMM speed (CPU SDPA here: ~10x);
    # 0 means "same as flops"
    attention_flops: float = 0.0
    # do weight reads hide under compute (a GPU's roofline: max) or add to it
    # (small-batch GEMMs on CPU: fitted by `stallfree profile`, whichever fits)
    overlap: bool = True
    # batches of up to this many tokens run another GEMM (on CPU: the compact
    # decode weights), with its own FLOP/s and weight-read rate, added
    small_batch_rows: int = 0
    small_batch_flops: float = 0.0
    small_batch_bw: float = 0.0
    # fixed per sequence in the batch (each decode, each chunk): its sampling, its
    # attention metadata and launch, its Python; on CPU a decode costs far more
    # than its GEMM rows (fitted by `stallfree profile`)
    per_sequence_s: float = 0.0


# The article's illustrative figures (not benchmarks).
LLAMA3_8B = ModelSpec("llama-3-8b", 8e9, 2.0, layers=32, heads=32, kv_heads=8, head_dim=128)
ARTICLE_GPU = HardwareSpec("article-gpu", flops=400e12, mem_bw=3e12)


@dataclass(slots=True, frozen=True)
class CostModel:
    model: ModelSpec = LLAMA3_8B
    hardware: HardwareSpec = ARTICLE_GPU
    attention: bool = False  # add attention FLOPs
    kv_reads: bool = False  # add KV-cache read bytes

    def linear_s(self, tokens: int) -> float:
        """The projections and MLP: compute or weight reads, whichever binds
        (or both, where the hardware does not overlap them)."""
        hw = self.hardware
        flops = 2.0 * self.model.params * tokens
        if tokens <= hw.small_batch_rows:
            return flops / hw.small_batch_flops + self.model.weight_bytes / hw.small_batch_bw
        compute, memory = flops / hw.flops, self.model.weight_bytes / hw.mem_bw
        return max(compute, memory) if hw.overlap else compute + memory

    def attention_s(self, attn_flops: float, kv_tokens_read: int) -> float:
        """One kind of attention (the decodes', or the chunks'): its FLOPs or its
        KV reads, whichever binds."""
        hw = self.hardware
        compute = attn_flops / (hw.attention_flops or hw.flops)
        return max(compute, kv_tokens_read * self.model.kv_bytes_per_token / hw.mem_bw)

    def iteration_s(self, decode_contexts: Sequence[int], chunks: Chunks) -> float:
        """Time of one iteration.

        decode_contexts: tokens already cached for each decoding request.
        chunks: (prefix length, chunk tokens) for each prefill chunk.

        The decodes' attention (bound by its KV reads) and the chunks' (bound
        by their FLOPs) are each their own roofline, added: the kernel runs
        them one after the other. Taken as one (the larger of all the FLOPs
        and all the reads), a chunk after a long prefix hid under the decodes'
        reads: measured / predicted rose with the prefix (0.94 under 256
        tokens, 1.04 at 512-1,024) and the p99 of a mixed workload was 1.14.
        """
        decodes, context = len(decode_contexts), sum(decode_contexts)
        tokens = decodes + sum(n for _, n in chunks)
        if tokens == 0:
            return 0.0
        attn = 0.0
        if self.attention or self.kv_reads:
            # one query after ctx cached tokens attends to ctx + 1: summed in closed form
            flops = self.model.attention_flops(0, 1) * (context + decodes) if self.attention else 0.0
            attn = self.attention_s(flops, context if self.kv_reads else 0)
            flops = sum(self.model.attention_flops(p, n) for p, n in chunks) if self.attention else 0.0
            attn += self.attention_s(flops, sum(p for p, _ in chunks) if self.kv_reads else 0)
        hw = self.hardware
        sequences = decodes + len(chunks)
        return self.linear_s(tokens) + attn + hw.overhead_s + hw.per_sequence_s * sequences

    def observe(self, decode_contexts: Sequence[int], chunks: Chunks, measured_s: float) -> None:
        """A fixed model learns nothing (``OnlineCost`` corrects one from measurements)."""

    def correction(self, with_prefill: bool) -> float:
        return 1.0
