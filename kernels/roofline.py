"""One thread's limits on this machine, measured (``kernels/csrc/roofline.cpp``).

The figures every kernel is judged against: ``bench.engine.engine_profile``
reports each op's achieved rate as a fraction of them, and ``stallfree
profile`` records them beside its fitted rates. Each figure is the best of a
few short runs after one discarded run: on a shared machine the slow runs are
the noise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from stallfree.kernels import cpu_build


@dataclass(frozen=True, slots=True)
class Roofline:
    fma_f32: float  # FLOP/s: vector FMAs in registers, the float32 peak
    dot_bf16: float  # FLOP/s: AVX512-BF16's vdpbf16ps in registers; 0 where the build has none
    brgemm_f32: float  # FLOP/s: oneDNN's brgemm on cache-resident float32 operands
    brgemm_bf16: float  # FLOP/s: the same in bf16 (AMX tiles where present); 0 if none
    brgemm_int8: float  # OP/s: u8 x s8 (ATen offers it with AMX-INT8 only); 0 if none
    read_bw: float  # bytes/s: one thread streaming a buffer far larger than the caches

    def to_json(self) -> dict[str, float]:
        return asdict(self)

    def peak(self, dtype: torch.dtype) -> float:
        """The FLOP/s of the arithmetic a GEMM in ``dtype`` uses here: AMX tiles
        (oneDNN's bf16 brgemm) where present, else the dot-product instruction,
        else float32 FMAs (what a bf16 GEMM widens to without either)."""
        if dtype == torch.bfloat16:
            return self.brgemm_bf16 or self.dot_bf16 or self.fma_f32
        return self.fma_f32

    def arithmetic(self, dtype: torch.dtype) -> str:
        """The name of the arithmetic behind :meth:`peak`, for records."""
        if dtype == torch.bfloat16 and self.brgemm_bf16:
            return "bf16 brgemm (AMX)"
        if dtype == torch.bfloat16 and self.dot_bf16:
            return "bf16 vdpbf16ps"
        return "float32 FMA"


def measure(seconds: float = 0.1, runs: int = 3) -> Roofline | None:
    """The limits of the thread this runs on; None without the native kernels."""
    if cpu_build.status().backend != "native":
        return None
    torch.ops.stallfree.roofline(seconds)  # discarded: first-use costs (JIT, page faults)
    best = [max(v) for v in zip(*(torch.ops.stallfree.roofline(seconds) for _ in range(runs)), strict=True)]
    return Roofline(*best)
