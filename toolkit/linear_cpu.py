"""The CPU panel linear (`linear_cpu.cpp`): weights repacked once into column panels, called as an op.

On this 2-core AVX2 host it beat oneDNN's prepacked fp32 weights (toolkit/packed_linear.py) on
every decode shape measured: 1.5x at M=1, 1.1-1.3x at M=64, about even at M=2048. With bf16
weights it reads half the bytes and computes in float32 registers, where torch's own bf16 matmul
is emulated on CPUs without AVX-512 BF16: 2.6x oneDNN fp32 at M=1. fp16 weights run alike (F16C
widening), 6.7x torch's own fp16 matmul at M=64 here. Numerics: float32 products and float32
accumulation, as torch's CPU matmuls; half outputs are rounded once at the end.

The kernel is built on first use (attention/cpp_build.py). `TOOLKIT_CPU_LINEAR_KERNEL=0` turns it
off; where it cannot be built, linears fall back to oneDNN with one warning.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch
from torch import nn

from attention import cpp_build

SOURCE = Path(__file__).with_name("linear_cpu.cpp")
SWITCH = "TOOLKIT_CPU_LINEAR_KERNEL"
PANEL = 16  # output columns per panel
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # x and out, as linear_cpu.cpp's Kind


@functools.cache
def _library() -> ctypes.CDLL | None:
    pointer, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    signatures = {}
    for suffix in SUFFIX.values():
        signatures[f"pack_{suffix}"] = ([pointer, i64, i64, pointer], None)
        signatures[f"linear_{suffix}"] = ([pointer, i32, i64, pointer, pointer, pointer, i32, i64, i64, i64], None)
    return cpp_build.load(SOURCE, SWITCH, "CPU linear kernel", "oneDNN's", signatures)


def available(dtype: torch.dtype) -> bool:
    """Whether the kernel is built and takes weights of `dtype` (float32, bfloat16 or float16)."""
    return dtype in SUFFIX and _library() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] (float32, bfloat16 or float16, CPU) -> panels [ceil(N / 16), K, 16] of the same dtype."""
    if weight.dim() != 2 or weight.dtype not in SUFFIX or weight.device.type != "cpu":
        raise ValueError(f"pack takes a 2-d float32, bfloat16 or float16 CPU weight, got {weight.dtype} {tuple(weight.shape)} "
                         f"on {weight.device}")
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU linear kernel is unavailable (see the warning)")
    n, k = weight.shape
    weight = weight.contiguous()
    panels = _empty_on_huge_pages((-(-n // PANEL), k, PANEL), weight.dtype)
    getattr(lib, f"pack_{SUFFIX[weight.dtype]}")(weight.data_ptr(), n, k, panels.data_ptr())
    return panels


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


@functools.cache
def _madvise():
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def _empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty, but starting on a 2 MiB boundary with its whole 2 MiB pages advised for transparent
    huge pages (where the kernel allows them, as Debian's default "madvise" mode does). A batch-1 step
    streams every weight once: with 4 KiB pages that is a TLB miss every 4 KiB, and huge pages took
    a chain of the 125M model's panel linears from 10.53 to 10.24 ms (medians of 200 alternated calls).
    Only pages wholly inside the tensor are advised, so nothing past it becomes resident; the up to
    2 MiB skipped before it is address space, never touched."""
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise()
    if nbytes < HUGE_PAGE or madvise is None:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    madvise(raw.data_ptr() + start, nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)  # a refusal only costs speed
    return raw[start:start + nbytes].view(dtype).view(shape)


@functools.cache
def _kernel(dtype: torch.dtype):
    lib = _library()
    if lib is None:
        raise RuntimeError("toolkit::linear_cpu called but the kernel is unavailable (see the warning)")
    if dtype not in SUFFIX:
        raise ValueError(f"linear_cpu: panels must be float32, bfloat16 or float16, got {dtype}")
    return getattr(lib, f"linear_{SUFFIX[dtype]}")


def _linear_cpu(x, panels, out_features, bias):
    # A 125M decode step makes 49 of these calls: the checks are few attribute reads (this body took
    # ~20 us a call with one check per line, of ~27 us in all at batch-1 sizes).
    kernel = _kernel(panels.dtype)
    num_panels, k, width = panels.shape
    if x.dim() != 2 or x.shape[1] != k or width != PANEL or not panels.is_contiguous():
        raise ValueError(f"linear_cpu: x {tuple(x.shape)} does not match panels {tuple(panels.shape)} "
                         f"(contiguous panels of [ceil(N / 16), K, 16])")
    if not 0 < out_features <= num_panels * PANEL or (bias is not None and bias.shape != (out_features,)):
        raise ValueError(f"linear_cpu: out_features {out_features} or bias does not fit panels {tuple(panels.shape)}")
    dtype = x.dtype
    # x and out: float32, or the panels' own half type, which the kernel widens and rounds itself.
    kind = KIND.get(dtype) if dtype == torch.float32 or dtype == panels.dtype else None
    if kind is None:
        x, kind = x.float(), 0
    if x.stride(1) != 1:
        x = x.contiguous()
    bias32 = None if bias is None else bias.float().contiguous()  # held until the call returns
    m = x.shape[0]
    out = torch.empty(m, out_features, dtype=x.dtype)
    kernel(x.data_ptr(), kind, x.stride(0), panels.data_ptr(), None if bias32 is None else bias32.data_ptr(),
           out.data_ptr(), kind, m, out_features, k)
    return out if out.dtype == dtype else out.to(dtype)


# The low-level torch.library API, as for toolkit::packed_linear: custom_op's wrapper costs ~15 us
# a call, and a 125M decode step makes 49 of them (85 before q/k/v and gate/up were merged).
_lib = torch.library.Library("toolkit", "FRAGMENT")
_lib.define("linear_cpu(Tensor x, Tensor panels, int out_features, Tensor? bias) -> Tensor")
_lib.impl("linear_cpu", _linear_cpu, "CPU")


@torch.library.register_fake("toolkit::linear_cpu")
def _linear_cpu_fake(x, panels, out_features, bias):
    return x.new_empty(x.shape[0], out_features)


class PanelLinear(nn.Module):
    """y = x W^T + b with W held as panels (the model's dtype: fp32, bf16 or fp16); x is [M, in_features]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("panels", pack(linear.weight.detach()), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.toolkit.linear_cpu.default(x, self.panels, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
