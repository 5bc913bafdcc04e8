"""The float32 head's argmax at the cost of a bf16 GEMM, for rows that want
only their argmax.

The head runs in float32 (``LlamaModel`` says why: a greedy choice can hang
on a 0.08 logit gap). Over many rows that is a float32 GEMM over the whole
vocabulary; where bf16 products run (oneDNN's brgemm on AMX, else
AVX512-BF16's ``vdpbf16ps``) a row that wants only its argmax
(``SamplingParams.argmax_only``) takes a screen instead:

1. logits of the operands rounded to bf16, summed in float32 (the brgemm or
   the dot-product kernel);
2. a bound on each one's error: rounding x and w_v to bf16 moves x . w_v by
   at most (2u + u^2) sum |x_k w_vk| <= (2u + u^2) ||x|| ||w_v||, u = 2^-8,
   and float32 sums of K terms (the screen's and the recheck's) by at most
   K 2^-24 each of about the same (doubled here for the screen's slightly
   larger terms), so E_v = C ||x|| ||w_v|| with the sum of all, plus a floor
   for the subnormal operands, products and sums both instructions flush to
   zero;
3. every entry that could still lead (screen_v + E_v >= max_u(screen_u -
   E_u)) recomputed in float32 and written over its screened value. The
   screen notes each row's max(screen_v - E_v) and max(screen_v + E_v) over
   every block of 64 entries as it writes them (``kernels/csrc/screen.cpp``),
   so the rechecks read only the blocks that can hold a candidate, not the
   whole vocabulary twice.

The true leader is among the rechecked entries (its screen plus its bound
reaches at least the leader's float32 value, which reaches every other
entry's screen minus its bound), and every entry left screened is below a
rechecked one, so the row's argmax is the float32 argmax. The other values
are the screen's: a row that wants more than its argmax never comes here.

x in two bf16 parts (hi + lo, one GEMM of twice the rows) halves C and cut
the rechecks from about 50 entries a row to 10, but on the 2-core Xeon the
doubled GEMM cost more than they did (head-2026-12-05 against -2).
"""

from __future__ import annotations

import torch

from stallfree.kernels import cpu_build
from stallfree.kernels.linear import Linear, dot_available

U = 2.0**-8  # bf16's unit roundoff (round to nearest even)
# at most K subnormal operands, products or sums (each under 2^-126 times the
# other operand, far below 1e5 here) flushed to zero
FLUSHED = 1e-30


class ScreenedHead:
    # Fewer rows than this take the float32 head whole. AMX (2-core Xeon): its
    # compact copy reads fewer bytes than the bf16 screen; at 8 rows the screen
    # took 1.3x its time, at 16 0.6-0.8x, at 32 0.7x (head-2026-12-05-2, 1 and 2
    # threads). vdpbf16ps (2-core Zen 4): the whole head's float32 FMAs cost more
    # from 4 rows: the screen took 0.78-0.87x its time at 4, 0.55-0.61x at 8,
    # 0.47-0.49x at 32 (head-2026-12-06).
    MIN_ROWS_AMX, MIN_ROWS_DOT = 16, 4

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight  # float32 [V, K]: the rechecks read its rows
        self.min_rows = self.MIN_ROWS_AMX if cpu_build.has_amx() else self.MIN_ROWS_DOT
        self.packed = self._pack(weight.bfloat16())
        self.norms = weight.norm(dim=1)  # ||w_v||
        self.c = 2 * U + U * U + 4 * weight.shape[1] * 2.0**-24

    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.stallfree.pack_bf16(w) if cpu_build.has_amx() else torch.ops.stallfree.pack_dot(w)

    def _screen(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 x . bf16 w_v for every v, summed in float32 (AMX brgemm or vdpbf16ps), and
        bounds [V/64, R, 2]: each row's max(screen_v - E_v), max(screen_v + E_v)
        over each block of 64 entries."""
        return torch.ops.stallfree.screen(x.bfloat16(), self.packed, self.weight.shape[0], self.norms, scale, FLUSHED)

    @staticmethod
    def runs_on() -> str | None:
        """The bf16 products the screen runs on here: oneDNN's brgemm ("AMX"),
        the dot-product kernel ("vdpbf16ps"), or None where neither runs."""
        if cpu_build.status().backend != "native":
            return None
        if cpu_build.has_amx():
            return "AMX" if torch.ops.stallfree.bf16_brgemm() else None
        return "vdpbf16ps" if dot_available() else None

    @staticmethod
    def available(layer: Linear) -> bool:
        """A float32 CPU head without bias whose shape both packings take, where
        the screen runs (``runs_on``)."""
        w = layer.weight
        return (
            w.device.type == "cpu"
            and w.dtype == torch.float32
            and layer.bias is None
            and w.shape[0] % 64 == 0
            and w.shape[1] % 2 == 0
            and ScreenedHead.runs_on() is not None
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: float32 [R, K] -> [R, V] float32 whose argmax per row is the float32 head's."""
        return self.logits(x)[0]

    def logits(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The screened logits with their rechecks, and how many entries were rechecked."""
        x = x.contiguous()
        scale = self.c * x.norm(dim=1)  # E_v = scale[row] * ||w_v|| + FLUSHED
        logits, bounds = self._screen(x, scale)
        rechecked = torch.ops.stallfree.screen_recheck(logits, bounds, x, self.weight, self.norms, scale, FLUSHED)
        return logits, int(rechecked)
