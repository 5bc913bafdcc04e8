"""Linear layers: weights prepacked for oneDNN on CPU, plus a compact copy
for decode-sized batches where the native kernels can read one.

torch's plain ``F.linear`` re-lays out the weight on every call; a prepacked
weight runs decode-sized bf16 GEMMs 1.3-1.8x faster on an AVX-512 BF16 machine
(8 rows: 0.17 -> 0.28 TFLOP/s on one thread) and prepacked fp32 ones faster
on an AVX2 EPYC too. Elsewhere (CUDA, a torch without the op) this is plain
``F.linear``. Which of the two a call uses is the kernel dispatch's choice
(``kernels.linear``): the compact copy (``kernels.compact``) only up to
``Linear.COMPACT_ROWS`` rows, where reading fewer bytes beats oneDNN.

A layer made with ``int8`` (``--compute int8``) keeps an int8 copy of its
float32 weight, one scale per output column, and runs float32 batches through
``gemm_int8`` (activations quantized per row, oneDNN's u8 x s8 brgemm: AMX-INT8
where ATen offers it: with AMX only, not on AVX-512 VNNI) above ``COMPACT_ROWS`` rows: only prefill chunks run in int8,
decode-sized batches stay exact.

A bf16 layer on a CPU with AVX512-BF16 but no AMX (``kernels/csrc/dot_gemm.cpp``)
runs every batch, decode or chunk, on the dot-product instruction from a
copy packed in k pairs: 2.26x oneDNN's bf16 GEMM at 1 row, 1.10x at 32, level
at chunk sizes (``bench.kernels.linear_kernels --dtype bf16``, Zen 4), with
float32 outputs where the layer needs them. With AMX, a batch of up to
``Linear.VNNI_ROWS`` rows takes one oneDNN brgemm call a block of 64 output
columns over a copy packed in VNNI pairs (``gemm_vnni``: nothing between the
weights and the tiles), larger ones oneDNN's prepacked matmul. Elsewhere
bf16 goes to oneDNN.

A layer made ``gated`` (the MLP's gate and up projections, stacked) on the
dot-product kernel keeps its copy in blocks of 16 gate and the 16 matching up
columns, so that ``kernels.linear_silu_mul`` gives silu(gate) * up straight from
each tile's sums (``gemm_dot_silu``): the gate/up product is never written
and read back.

A layer made with ``float_out`` (the ones whose output joins the float32
residual stream) returns float32 products of its narrower operands, never
rounded to bf16: by the dot-product kernel, or oneDNN's brgemm (AMX,
``gemm_vnni``), else by a float32 GEMM of the same bf16 values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stallfree.kernels import cpu_build
from stallfree.kernels.compact import CompactWeight, Quantized, compact_weight

_PACK_HINT = 64  # rows the packed layout is tuned for
_PACKED = (torch.bfloat16, torch.float32)


class Linear:
    COMPACT_ROWS = 64  # up to here the compact copy measured faster (bench.kernels.linear_kernels)
    # With AMX, bf16 batches up to here take gemm_vnni: on the 2-core Xeon it ran
    # the model's 120 bf16 weights 1.10-1.23x faster than oneDNN's matmul from
    # 1 to 32 rows on 1 thread (1.13-1.27x on 2) and 1.2-2.0x faster than the
    # dot kernel from 1 to 8 rows; from 48 rows (two brgemm calls a block)
    # oneDNN led (linear_kernels-2026-12-05-3 and -4).
    VNNI_ROWS = 32

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        quantized: Quantized | None = None,
        float_out: bool = False,
        int8: bool = False,
        gated: bool = False,
    ):
        self.weight, self.bias = weight, bias
        # gate rows then up rows, for linear_silu_mul: the dot copy interleaves them (pack_dot_gated)
        self.gated = False
        self.packed: torch.Tensor | None = None
        self.compact: CompactWeight | None = None
        self.float_out = float_out and weight.dtype != torch.float32
        self.dot: torch.Tensor | None = None  # bf16 weight packed for gemm_dot (every batch)
        self.vnni: torch.Tensor | None = None  # bf16 weight packed for gemm_vnni (AMX)
        self.wide: tuple[torch.Tensor, torch.Tensor | None] | None = None  # float_out without brgemm
        self.int8: list[torch.Tensor] | None = None  # [packed, scale, shift] for gemm_int8
        if weight.device.type != "cpu":
            return
        if int8:
            if not int8_available() or weight.dtype != torch.float32:
                raise ValueError("int8 compute needs float32 weights and the native kernels' int8 brgemm")
            if weight.shape[0] % 64 == 0 and weight.shape[1] % 64 == 0:
                self.int8 = torch.ops.stallfree.pack_int8(weight)
        n, k = weight.shape
        bf16 = weight.dtype == torch.bfloat16
        if bf16 and cpu_build.has_amx():
            if n % 64 == 0 and k % 2 == 0 and _has_bf16_brgemm():
                self.vnni = torch.ops.stallfree.pack_bf16(weight)
        elif bf16 and n % 32 == 0 and k % 2 == 0 and dot_available():
            self.gated = gated and bias is None
            pack = torch.ops.stallfree.pack_dot_gated if self.gated else torch.ops.stallfree.pack_dot
            self.dot = pack(weight)
            return  # every batch on the dot kernel
        if weight.dtype in _PACKED and _has_mkldnn_linear():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT)
            except RuntimeError:
                self.packed = None
        if weight.dtype == torch.float32 and cpu_build.status().backend == "native":
            self.compact = compact_weight(weight, quantized)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b by the dot-product kernel, oneDNN's brgemm on the VNNI copy,
        oneDNN's prepacked weight or ``F.linear`` (every device)."""
        if self.int8 is not None and x.dtype == torch.float32 and x.shape[0] > self.COMPACT_ROWS:
            return torch.ops.stallfree.gemm_int8(x.contiguous(), *self.int8, self.bias)
        if self.dot is not None and x.dtype == torch.bfloat16 and x.dim() == 2:
            y = torch.ops.stallfree.gemm_dot(x, self.dot, self.bias, self.float_out)
            if self.gated:  # columns in blocks of 16 gate then 16 up: back to all gate, then all up
                y = y.view(y.shape[0], -1, 2, 16).transpose(1, 2).reshape(y.shape[0], -1)
            return y
        vnni = self.vnni is not None and x.dtype == torch.bfloat16 and x.dim() == 2
        if vnni and (self.float_out or x.shape[0] <= self.VNNI_ROWS):  # float32 out: only this gives it unrounded
            return torch.ops.stallfree.gemm_vnni(x, self.vnni, self.weight.shape[0], self.bias, self.float_out)
        if self.float_out:
            if self.wide is None:  # the same bf16 values, widened once
                self.wide = (self.weight.float(), None if self.bias is None else self.bias.float())
            return F.linear(x.float(), *self.wide)
        if self.packed is not None and x.dtype == self.weight.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def int8_available() -> bool:
    """Whether ``--compute int8`` can run here: the native kernels and ATen's
    int8 brgemm (AMX-INT8; ATen offers none on AVX-512 VNNI alone)."""
    return cpu_build.status().backend == "native" and bool(torch.ops.stallfree.int8_brgemm())


def dot_available() -> bool:
    """Whether bf16 layers run on the AVX512-BF16 dot-product kernel here."""
    return cpu_build.status().backend == "native" and bool(torch.ops.stallfree.dot_bf16())


def _has_bf16_brgemm() -> bool:
    return cpu_build.status().backend == "native" and bool(torch.ops.stallfree.bf16_brgemm())


def _has_mkldnn_linear() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )
