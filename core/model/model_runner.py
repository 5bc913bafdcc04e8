"""The torch runner: turns a scheduled batch into one forward pass and samples.

Owns the paged KV cache tensors ``[layers, blocks, block_size, kv_heads,
head_dim]``; the scheduler's block tables index them directly.
"""

from __future__ import annotations

import time
import warnings

import torch

from stallfree.core.model.llama import LlamaModel
from stallfree.core.model.loader import LoadedModel
from stallfree.core.model.sampler import Sampler
from stallfree.core.sched.batch import Batch, Sampled
from stallfree.kernels import Linear, backend, build_attention_meta, cpu_build, paths, roofline


def cpu_has_fast_bf16() -> bool:
    """AMX or AVX-512 BF16 (the machine's kind, which ``STALLFREE_CPU_ISA``
    can force lower): bf16 matmuls there run 2-8x faster than fp32."""
    return cpu_build.kind() in ("avx512-bf16", "amx")


def resolve_dtype(name: str, device: torch.device, flag: str = "--dtype") -> torch.dtype:
    """``auto``: bf16 on CUDA or a CPU with fast bf16, else fp32."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_fast_bf16() else torch.float32
    dtypes = {
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float32": torch.float32,
        "fp32": torch.float32,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in dtypes:
        raise ValueError(f"{flag} {name}: unknown dtype (auto, bfloat16, float32, float16)")
    return dtypes[name]


def kv_blocks_for(loaded: LoadedModel, cache_bytes: int, block_size: int, dtype: torch.dtype) -> int:
    c = loaded.config
    per_block = 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * dtype.itemsize
    return max(1, cache_bytes // per_block)


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        compute: str = "float",
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        start = time.perf_counter()
        c = loaded.config
        self.config = c
        self.device = device
        self.dtype = dtype
        # the KV cache's dtype (default: dtype); attention runs in it (LlamaModel.forward)
        self.kv_dtype = kv_dtype or dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.threads = torch.get_num_threads()
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.tokenizer.eos_token_ids
        self.vocab_size = c.vocab_size
        self.compute = compute  # float: GEMMs in dtype; int8: chunk GEMMs in int8 (kernels.Linear)
        self.model = LlamaModel(c, loaded.weights, dtype, device, loaded.quantized, int8=compute == "int8")
        self.sampler = Sampler(c.vocab_size, device, loaded.tokenizer)
        shape = (c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=self.kv_dtype, device=device)
        self.kernels = backend(device)  # e.g. native-avx2, triton, reference (why)
        # the CPU's kind and each op's implementation, for the start-up log and records
        self.kernel_paths = paths(self.dtype, self.kv_dtype) if device.type == "cpu" else {}
        if self.kernel_paths and "all ops" not in self.kernel_paths:
            fused = self.model.fused is not None and self.kv_dtype == self.dtype
            self.kernel_paths["layer loop"] = "one native call (layers.cpp)" if fused else "op by op from Python"
        # batches up to this many tokens read the compact decode weights (0: none)
        self.small_batch_rows = Linear.COMPACT_ROWS if self.model.layers[0].gate_up.compact is not None else 0
        self.load_s = time.perf_counter() - start

    def roofline(self, seconds: float = 0.1) -> dict[str, float] | None:
        """This machine's measured limits on one thread (CPU with the native
        kernels), for the profile; ``seconds`` per figure and run."""
        if self.device.type != "cpu":
            return None
        measured = roofline.measure(seconds)
        return None if measured is None else measured.to_json()

    def export_kv(self, block_ids: list[int], num_tokens: int) -> object:
        """(dtype, K, V): K and V of those blocks, each (layers, blocks, block size,
        kv heads, head dim), the paged layout of only this request's blocks, as
        the bytes of this cache's dtype in numpy arrays on the CPU: Ray moves
        those without pickling them (several times faster than tensors)."""
        blocks = torch.tensor(block_ids[: -(-num_tokens // self.block_size)], device=self.device)
        k, v = (c[:, blocks].cpu().view(torch.uint8).numpy() for c in (self.k_cache, self.v_cache))
        return str(self.kv_dtype).removeprefix("torch."), k, v

    def import_kv(self, block_ids: list[int], num_tokens: int, payload: object) -> None:
        assert isinstance(payload, tuple)
        dtype, k_bytes, v_bytes = payload
        with warnings.catch_warnings():  # read-only arrays (Ray's shared memory): only read here
            warnings.simplefilter("ignore", UserWarning)
            k, v = (torch.from_numpy(b).view(getattr(torch, dtype)) for b in (k_bytes, v_bytes))
        blocks = torch.tensor(block_ids[: k.shape[1]], device=self.device)
        self.k_cache[:, blocks] = k.to(self.device, self.kv_dtype)
        self.v_cache[:, blocks] = v.to(self.device, self.kv_dtype)

    def release(self, request_ids: list[str]) -> None:
        self.sampler.release(request_ids)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        for source, copy in copies:
            self.k_cache[:, copy] = self.k_cache[:, source]
            self.v_cache[:, copy] = self.v_cache[:, source]

    def execute(self, batch: Batch) -> Sampled:
        ids: list[int] = []
        tables, seq_lens, query_lens, sampled, drafts = [], [], [], [], []
        logits_rows: list[int] = []
        argmax_only: list[bool] = []  # per logits row: its request wants only the argmax
        for item in batch.items:
            req = item.request
            ids += item.token_ids()
            tables.append(req.block_ids)
            seq_lens.append(item.start + item.num_tokens)
            query_lens.append(item.num_tokens)
            if item.samples:
                logits_rows += range(len(ids) - 1 - len(item.drafts), len(ids))
                argmax_only += [req.sampling.argmax_only] * (1 + len(item.drafts))
                sampled.append(req)
                drafts.append(item.drafts)
        grammars = self.sampler.grammars
        if grammars is not None:  # compiled while this iteration's forward pass runs
            grammars.prepare(
                [i.request for i in batch.items if i.is_prefill and i.request.sampling.grammar is not None]
            )
        # plain decodes lead the batch; speculating ones run as chunks
        num_decodes = sum(1 for item in batch.items if not item.is_prefill and item.num_tokens == 1)
        dev = self.device
        meta = build_attention_meta(tables, seq_lens, query_lens, num_decodes, self.block_size, dev)
        logits = self.model.forward(
            torch.tensor(ids, device=dev),
            meta.positions,
            meta,
            self.k_cache,
            self.v_cache,
            torch.tensor(logits_rows, device=dev, dtype=torch.long),
            torch.tensor(argmax_only, device=dev, dtype=torch.bool),
        )
        if not sampled:
            return Sampled([])
        return self.sampler(logits, sampled, drafts)
