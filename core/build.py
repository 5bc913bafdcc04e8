"""Assemble an engine over the real model from user-facing settings."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from core.config import CacheConfig, SchedulerConfig
from core.engine import Engine
from core.loader import load_model
from core.model_runner import ModelRunner, kv_blocks_for, resolve_dtype


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
