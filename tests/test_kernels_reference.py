"""The CPU kernels beyond attention (attention itself: tests/test_model.py)."""

import pytest
import torch
import torch.nn.functional as F

from stallfree.kernels import Linear


@pytest.mark.parametrize("rows", [1, 8, 300])
def test_prepacked_linear_matches_f_linear(rows):
    torch.manual_seed(0)
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    for bias in (None, b):
        lin = Linear(w, bias)
        assert torch.allclose(lin(x).float(), F.linear(x, w, bias).float(), atol=0.05, rtol=0.02)
    fp32 = Linear(w.float(), b.float())
    assert fp32.packed is not None  # prepacked in fp32 too
    assert torch.allclose(fp32(x.float()), F.linear(x.float(), w.float(), b.float()), atol=1e-4)
