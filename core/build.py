"""Assemble an engine over the real model from user-facing settings."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from core.analysis.cost_model import CostModel, HardwareSpec
from core.analysis.sim_runner import SimRunner
from core.model.gguf import GGUFFile
from core.model.loader import embedded_model_path, gguf_config, load_model
from core.model.model_runner import ModelRunner, kv_blocks_for, resolve_dtype
from core.model.tokenizer import Tokenizer
from core.sched.config import CacheConfig, SchedulerConfig
from core.sched.engine import Engine

# Roughly this 2-core CPU running the embedded SmolLM2 in bf16 (fitted by
# `stallfree profile`); the simulated server's default cost.
CPU_LIKE = HardwareSpec("cpu-like", flops=0.5e12, mem_bw=10e9, overhead_s=0.007, attention_flops=0.16e12)


@dataclass(slots=True)
class ModelSettings:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct; "tiny": random test model
    dtype: str = "auto"
    device: str = "auto"  # auto: cuda when available, else cpu
    threads: int | None = None  # torch intra-op threads; None: all cores
    kv_cache_gib: float = 2.0
    block_size: int = 16


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_engine(settings: ModelSettings, scheduler: SchedulerConfig) -> tuple[Engine, ModelRunner]:
    """Load the model, size the KV cache, and return an engine over it.

    ``max_model_len`` is capped at the model's context length.
    """
    threads = settings.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    loaded = load_model(settings.model)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    num_blocks = kv_blocks_for(loaded, int(settings.kv_cache_gib * 2**30), settings.block_size, dtype)
    runner = ModelRunner(loaded, num_blocks, settings.block_size, dtype, device)
    scheduler = dataclasses.replace(scheduler, max_model_len=min(scheduler.max_model_len, loaded.config.max_position))
    return Engine(scheduler, CacheConfig(num_blocks, settings.block_size), runner), runner


def build_sim_engine(
    scheduler: SchedulerConfig,
    cost: CostModel | None = None,
    kv_cache_gib: float = 2.0,
    block_size: int = 16,
    time_scale: float = 1.0,
    read_context: bool = True,
) -> tuple[Engine, Tokenizer]:
    """An engine on SimRunner in real time (it sleeps each iteration's predicted
    cost), with the embedded model's tokenizer, so a whole server runs
    without the model."""
    gguf = GGUFFile(embedded_model_path())
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    if cost is None:
        cost = CostModel(gguf_config(gguf).spec(2), CPU_LIKE, attention=True, kv_reads=True)
    num_blocks = max(1, int(kv_cache_gib * 2**30) // (block_size * cost.model.kv_bytes_per_token))
    runner = SimRunner(cost, block_size, None, tokenizer.vocab_size, time_scale, read_context)
    return Engine(scheduler, CacheConfig(num_blocks, block_size), runner, chunk_limit=cost.level_chunk), tokenizer
