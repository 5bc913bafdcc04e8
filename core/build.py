"""Assemble an engine over the real model from user-facing settings."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from stallfree.core.analysis.cost_model import ARTICLE_GPU, CostModel, HardwareSpec
from stallfree.core.analysis.online_cost import OnlineCost
from stallfree.core.analysis.profiler import Profile, runner_profile_path, saved_or_quick_profile, saved_profile
from stallfree.core.analysis.sim_runner import SimRunner
from stallfree.core.model.gguf import GGUFFile
from stallfree.core.model.loader import embedded_model_path, gguf_config, load_model
from stallfree.core.model.model_runner import ModelRunner, kv_blocks_for, resolve_dtype
from stallfree.core.model.tokenizer import Tokenizer
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.engine import Engine
from stallfree.kernels.linear import int8_available

# Roughly this 2-core CPU running the embedded SmolLM2 in bf16 (fitted by
# `stallfree profile`); the simulated server's default cost.
CPU_LIKE = HardwareSpec("cpu-like", flops=0.5e12, mem_bw=10e9, overhead_s=0.007, attention_flops=0.16e12)
# A GPU's roofline with a launch-bound floor per iteration (a small model on CUDA).
GPU_LIKE = dataclasses.replace(ARTICLE_GPU, name="gpu-like", overhead_s=0.005)


@dataclass(slots=True)
class ModelSettings:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct; "tiny": random test model
    dtype: str = "auto"
    device: str = "auto"  # auto: cuda when available, else cpu
    threads: int | None = None  # torch intra-op threads; None: all cores
    kv_cache_gib: float = 2.0
    block_size: int = 16
    compute: str = "float"  # float | int8 (chunk-sized GEMMs in int8; float32 activations)
    kv_dtype: str = "auto"  # the KV cache's, and so attention's, dtype; auto: dtype


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_runner(settings: ModelSettings) -> ModelRunner:
    """Load the model and size its KV cache."""
    threads = settings.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    loaded = load_model(settings.model)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    if settings.compute == "int8":
        if device.type != "cpu" or not int8_available():
            raise ValueError("--compute int8 needs a CPU with an int8 brgemm (AMX-INT8 or AVX-512 VNNI)")
        if settings.dtype not in ("auto", "fp32", "float32"):
            raise ValueError("--compute int8 runs float32 activations: use --dtype auto or fp32")
        dtype = torch.float32
    kv_dtype = dtype if settings.kv_dtype == "auto" else resolve_dtype(settings.kv_dtype, device, "--kv-dtype")
    if kv_dtype not in (dtype, torch.bfloat16):
        raise ValueError(f"--kv-dtype {settings.kv_dtype}: the KV cache holds the compute dtype ({dtype}) or bf16")
    num_blocks = kv_blocks_for(loaded, int(settings.kv_cache_gib * 2**30), settings.block_size, kv_dtype)
    runner = ModelRunner(loaded, num_blocks, settings.block_size, dtype, device, settings.compute, kv_dtype)
    if runner.sampler.grammars is not None:
        runner.sampler.grammars.warm()  # now, not on the first constrained request: it holds the GIL 0.3-0.5 s
    return runner


def startup_profile(runner: ModelRunner, path: Path | None = None, measure: bool = False) -> tuple[Profile | None, str]:
    """The profile an engine's cost model starts from, and where it came from:
    ``path`` (from ``stallfree profile``); else, with ``measure``, the one saved
    for this model, dtype and thread count or a quick one measured now (and
    saved); else the saved one if any; else none (``prior_cost`` then)."""
    if path is not None:
        return Profile.load(path), str(path)
    if measure:
        return saved_or_quick_profile(runner)
    saved = saved_profile(runner)
    return (saved, str(runner_profile_path(runner))) if saved is not None else (None, "none")


def prior_cost(runner: ModelRunner) -> CostModel:
    """A rough roofline for the device, until a profile fits one (the engine's
    online correction scales it to what iterations measure)."""
    hardware = GPU_LIKE if runner.device.type == "cuda" else CPU_LIKE
    spec = runner.config.spec(runner.dtype.itemsize, runner.kv_dtype.itemsize)
    return CostModel(spec, hardware, attention=True, kv_reads=True)


def engine_over(runner: ModelRunner, scheduler: SchedulerConfig, profile: Profile | None = None) -> Engine:
    """An engine on this runner whose cost model (the profile's, else the
    prior) is corrected online; ``max_model_len`` is capped at the model's context length."""
    scheduler = dataclasses.replace(scheduler, max_model_len=min(scheduler.max_model_len, runner.config.max_position))
    cost = profile.cost_model if profile is not None else prior_cost(runner)
    return Engine(scheduler, CacheConfig(runner.num_blocks, runner.block_size), runner, cost=OnlineCost(cost))


def build_engine(settings: ModelSettings, scheduler: SchedulerConfig) -> tuple[Engine, ModelRunner]:
    """Load the model and return an engine over it (cost model: the saved profile, else the prior)."""
    runner = load_runner(settings)
    profile, _ = startup_profile(runner)
    return engine_over(runner, scheduler, profile), runner


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
    scaled = OnlineCost(cost)  # learns the time scale and the sleeps' overshoot
    return Engine(scheduler, CacheConfig(num_blocks, block_size), runner, cost=scaled), tokenizer
