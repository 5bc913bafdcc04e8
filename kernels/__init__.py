"""Hot ops of the model, behind one dispatch point.

The model runner calls only these functions. Each picks its implementation
by the device of its first tensor: Triton kernels (``kernels.triton_ops``) on
CUDA, the C++ extension (``kernels.cpu_ops``, built by ``kernels.cpu_build``)
on CPU, and the torch reference (``kernels.reference``) where neither is
available. All share one signature per op; tests run the Triton versions on
CPU under ``TRITON_INTERPRET=1`` and the C++ ones directly, against the
references.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from types import ModuleType

import torch

from stallfree.kernels import cpu_build, reference
from stallfree.kernels.attention_meta import AttentionMeta, build_attention_meta
from stallfree.kernels.compact import Quantized
from stallfree.kernels.fused_layers import FusedLayers
from stallfree.kernels.huge_pages import huge_page_copies
from stallfree.kernels.linear import Linear
from stallfree.kernels.linear import int8_available as linear_int8_available
from stallfree.kernels.screened_head import ScreenedHead


@cache
def _triton() -> ModuleType | None:
    """Imported on first use on CUDA only, so CPU runs never load Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    from stallfree.kernels import triton_ops

    return triton_ops


@cache
def native_cpu() -> ModuleType | None:
    """The C++ kernels (``kernels.cpu_ops``) when they build and load here, else None."""
    if cpu_build.status().backend != "native":
        return None
    from stallfree.kernels import cpu_ops

    return cpu_ops


_cpu_override: ModuleType | None = None


def _cpu() -> ModuleType:
    return _cpu_override or native_cpu() or reference


@contextmanager
def cpu_path(module: ModuleType) -> Iterator[None]:
    """CPU tensors go through ``module`` (``reference`` or ``native_cpu()``)
    inside the block: how benchmarks and tests compare the two paths."""
    global _cpu_override
    saved, _cpu_override = _cpu_override, module
    try:
        yield
    finally:
        _cpu_override = saved


def _impl(t: torch.Tensor) -> ModuleType:
    if t.is_cuda:
        triton_ops = _triton()
        if triton_ops is not None:
            return triton_ops
        return reference
    return _cpu()


def native_in_use(t: torch.Tensor) -> bool:
    """Whether ops on tensors like ``t`` run the C++ kernels now (a CPU tensor,
    the extension built, no other CPU path chosen by ``cpu_path``)."""
    return not t.is_cuda and native_cpu() is not None and _cpu() is native_cpu()


def backend(device: torch.device) -> str:
    """Which kernels run for tensors on ``device``, for start-up logs and bench records."""
    if device.type == "cuda" and _triton() is not None:
        return "triton"
    if device.type == "cpu":
        return str(cpu_build.status())
    return "reference"


def paths(dtype: torch.dtype, kv_dtype: torch.dtype) -> dict[str, str]:
    """Which implementation each op takes on this CPU at these dtypes, for the
    start-up log and records (the machine's kind first)."""
    status = cpu_build.status()
    if status.backend != "native":
        return {"kind": cpu_build.kind(), "all ops": str(status)}
    from stallfree.kernels import cpu_ops
    from stallfree.kernels.linear import dot_available

    amx = cpu_build.has_amx()
    if dtype == torch.bfloat16 and amx:
        gemm = f"one brgemm call a weight block (AMX) up to {Linear.VNNI_ROWS} rows, oneDNN (AMX) beyond"
    elif dtype == torch.bfloat16 and dot_available():
        gemm = "vdpbf16ps (dot_gemm; the MLP's gate and up give silu(gate) * up from its tiles)"
    elif dtype == torch.bfloat16:
        gemm = "oneDNN"
    else:
        gemm = "compact weights up to 64 rows, oneDNN beyond"
    if kv_dtype not in cpu_ops.brgemm_dtypes():
        tiles = "hand-written float32 FMA tiles"
    elif kv_dtype == torch.bfloat16:
        tiles = "brgemm (AMX)" if amx else "vdpbf16ps tiles"
    else:
        tiles = "brgemm"
    if kv_dtype == torch.bfloat16 and cpu_ops.amx_tiles():
        decode = "scores on AMX tiles (heads of 64, blocks of 16n), P V on vdpbf16ps"
    elif kv_dtype == torch.bfloat16 and dot_available():
        decode = "vdpbf16ps"
    else:
        decode = "float32 FMA"
    threads = torch.get_num_threads()
    by = ScreenedHead.runs_on()
    screen = ScreenedHead.MIN_ROWS_AMX if by == "AMX" else ScreenedHead.MIN_ROWS_DOT
    return {
        "kind": cpu_build.kind(),
        # what the engine was given, and what a kernel's parallel loop runs on (1 if built without OpenMP)
        "threads": f"{threads} (a kernel's loop runs on {torch.ops.stallfree.threads_used(4 * threads)})",
        "linear": gemm,
        "head": "float32, compact weights up to 64 rows"
        + (f"; {screen}+ argmax-only rows: a bf16 screen ({by}), float32 rechecks" if by else ""),
        "attention prefill": tiles,
        "attention decode": decode,
    }


def linear(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """x W^T + b; on CPU with the native kernels, decode-sized batches read the compact weights."""
    return _impl(x).linear(layer, x)


def linear_silu_mul(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) for a layer made ``gated`` (gate rows, then up rows)."""
    return _impl(x).linear_silu_mul(layer, x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _impl(x).rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(x).add_rms_norm(x, residual, weight, eps)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    return _impl(x).silu_mul(x)


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(q).rope(q, k, positions, cos_sin)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    _impl(k).write_kv(k_cache, v_cache, k, v, slot_mapping)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta, scale: float
) -> torch.Tensor:
    return _impl(q).paged_attention(q, k_cache, v_cache, meta, scale)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest entry, the first on ties (the greedy sampler's choice)."""
    return _impl(logits).argmax(logits)


__all__ = [
    "AttentionMeta",
    "FusedLayers",
    "Linear",
    "Quantized",
    "ScreenedHead",
    "add_rms_norm",
    "argmax",
    "backend",
    "build_attention_meta",
    "cpu_path",
    "huge_page_copies",
    "linear",
    "linear_int8_available",
    "linear_silu_mul",
    "native_cpu",
    "native_in_use",
    "paged_attention",
    "paths",
    "rms_norm",
    "rope",
    "silu_mul",
    "write_kv",
]
