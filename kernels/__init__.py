"""Hot ops of the model, behind one dispatch point.

The model runner calls only these functions. On CPU they are the torch
reference (``kernels.reference``); Triton versions for CUDA plug in here by
device.
"""

from kernels.attention_meta import AttentionMeta, build_attention_meta
from kernels.linear import Linear
from kernels.reference import add_rms_norm, paged_attention, rms_norm, rope, silu_mul, write_kv

__all__ = [
    "AttentionMeta",
    "Linear",
    "add_rms_norm",
    "build_attention_meta",
    "paged_attention",
    "rms_norm",
    "rope",
    "silu_mul",
    "write_kv",
]
