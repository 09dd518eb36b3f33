"""Host tensors on 2 MiB transparent huge pages: what a step streams (the packed weights, the KV cache)
takes a TLB miss every 4 KiB on ordinary pages."""

from __future__ import annotations

import ctypes
import functools
import math

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty, but starting on a 2 MiB boundary with its whole 2 MiB pages advised for transparent
    huge pages (where the kernel allows them, as Debian's default "madvise" mode does). Only pages wholly
    inside the tensor are advised, so nothing past it becomes resident; the up to 2 MiB skipped before
    it is address space, never touched."""
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise()
    if nbytes < HUGE_PAGE or madvise is None:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    madvise(raw.data_ptr() + start, nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)  # a refusal only costs speed
    return raw[start:start + nbytes].view(dtype).view(shape)


@functools.cache
def _madvise():
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise
