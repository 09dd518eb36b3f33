"""The CPU decode-attention kernel (`paged_decode_cpu.cpp`): built on first use, called as an op.

Decode-only steps on CPU spend most of their non-matmul time in attention. The kernel walks each
row's blocks once with an online softmax. On a 64-request decode it measured ~2x faster than
Inductor's code for the traced version (decode_torch.py) in isolation, and 2.85 -> 2.07 ms per layer
inside a step (see docs/benchmarks.md).

Building: `attention/cpp_build.py` compiles it on first use and caches the library. Set
`TOOLKIT_CPU_DECODE_KERNEL=0` to turn it off; where it cannot be built, callers fall back to the
torch paths with one warning.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from attention import cpp_build

SOURCE = Path(__file__).with_name("paged_decode_cpu.cpp")
SWITCH = "TOOLKIT_CPU_DECODE_KERNEL"
DTYPES = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16", torch.float16: "paged_decode_f16"}


def build(compiler: str | None = None) -> Path:
    """Compile the kernel (or find it already compiled) and return the shared library's path."""
    return cpp_build.build(SOURCE, compiler)


@functools.cache
def _library() -> ctypes.CDLL | None:
    pointer, i32, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    signatures = {name: ([pointer] * 6 + [i32] * 7 + [f32], i32) for name in DTYPES.values()}
    return cpp_build.load(SOURCE, SWITCH, "CPU decode kernel", "the torch decode path", signatures)


_available: bool | None = None  # unknown until first asked outside a compiled region


def kernel_available() -> bool:
    """Whether the kernel is built and loaded; the first call outside torch.compile decides.

    Under torch.compile this only reads the module flag (a constant to the graph), so the build is
    never traced: a caller that compiles (the model runner) calls it once beforehand. Asked first
    inside a compiled region, it answers False and the traced decode path is used.
    """
    global _available
    if _available is None and not torch.compiler.is_compiling():
        _available = _library() is not None
    return bool(_available)


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether this call can take the kernel: CPU tensors, a cache dtype it reads, head_dim and
    block_size in whole 8-float vectors, and the kernel available."""
    block_size, head_dim = kv_cache.shape[2], kv_cache.shape[-1]
    return (
        q.device.type == "cpu"
        and kv_cache.dtype in DTYPES
        and kv_cache.is_contiguous()
        and head_dim % 8 == 0
        and block_size % 8 == 0
        and kernel_available()
    )


def _paged_decode_cpu(q, kv_cache, seq_lens, block_tables, scale):
    lib = _library()
    if lib is None:
        raise RuntimeError("toolkit::paged_decode_cpu called but the kernel is unavailable (see the warning)")
    rows, num_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not (kv_cache.is_contiguous() and kv_cache.dtype in DTYPES):
        raise ValueError(f"kv_cache must be a contiguous {' or '.join(map(str, DTYPES))} tensor")
    if head_dim % 8 or block_size % 8:  # the kernel reads whole 8-float vectors and 8-row score tiles
        raise ValueError(f"head_dim {head_dim} and block_size {block_size} must be multiples of 8")
    q32 = q.contiguous().float()
    lens = seq_lens.to(torch.int32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    out = torch.empty(rows, num_heads, head_dim)
    kernel = getattr(lib, DTYPES[kv_cache.dtype])
    bad = kernel(q32.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), lens.data_ptr(), tables.data_ptr(),
                 out.data_ptr(), rows, num_heads, num_kv_heads, head_dim, block_size, tables.shape[1], num_blocks, scale)
    if bad:
        raise IndexError(f"paged_decode_cpu: {bad} row(s) with a length past their block table or a block id "
                         f"outside [0, {num_blocks})")
    return out.to(q.dtype)


# The low-level torch.library API (as in toolkit/packed_linear.py): custom_op's Python wrapper costs
# ~15 us per call, 12 calls per step.
_lib = torch.library.Library("toolkit", "FRAGMENT")
_lib.define("paged_decode_cpu(Tensor q, Tensor kv_cache, Tensor seq_lens, Tensor block_tables, float scale) -> Tensor")
_lib.impl("paged_decode_cpu", _paged_decode_cpu, "CPU")


@torch.library.register_fake("toolkit::paged_decode_cpu")
def _paged_decode_cpu_fake(q, kv_cache, seq_lens, block_tables, scale):
    return q.new_empty(q.shape)


def paged_decode_cpu(q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [B, Hq, D], one query per row at the last of its seq_lens positions; returns [B, Hq, D].

    The caller checks `supports` first. Rows of length 0 give zeros; block-table entries past a
    row's length are not read. A length past the block table or a block id outside the cache raises
    IndexError (the kernel checks before it reads).
    """
    return torch.ops.toolkit.paged_decode_cpu.default(q, kv_cache, seq_lens, block_tables, scale)
