"""The streamed weights' copies in huge pages (kernels.huge_pages)."""

from __future__ import annotations

import mmap

import pytest
import torch

from stallfree import kernels


def test_copies_hold_the_same_values_in_their_own_memory() -> None:
    tensors = [torch.randn(33, 7).bfloat16(), torch.arange(5, dtype=torch.int64), torch.randn(3, 4, 5)]
    copies = kernels.huge_page_copies(tensors)
    for t, c in zip(tensors, copies, strict=True):
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t)
        assert c.data_ptr() != t.data_ptr() and c.data_ptr() % 64 == 0
    copies[0].zero_()  # the copies do not alias one another
    assert torch.equal(copies[1], tensors[1]) and torch.equal(copies[2], tensors[2])


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no huge-page advice on this platform")
def test_copies_start_at_a_huge_page_boundary() -> None:
    (copy,) = kernels.huge_page_copies([torch.randn(1000)])
    assert copy.data_ptr() % (2 << 20) == 0


def test_a_kernel_that_refuses_the_advice_still_gets_the_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without transparent huge pages in the kernel, madvise fails (EINVAL): the model must load all the same."""
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF, raising=False)  # advice no kernel knows
    t = torch.randn(4, 5)
    (copy,) = kernels.huge_page_copies([t])
    assert torch.equal(copy, t) and copy.data_ptr() != t.data_ptr()


def test_nothing_to_copy() -> None:
    assert kernels.huge_page_copies([]) == []
