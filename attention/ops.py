"""The attention ops as torch.library custom ops, and the public wrappers that pick a backend.

Custom ops are opaque to torch.compile: the compiler sees only their fake (meta) implementations,
so a model calling them traces with fullgraph=True, while the real implementations are free to use
data-dependent Python (the torch reference calls .tolist()). The Triton ops are registered here too,
but triton itself is imported only when one of them first runs, so the package imports without it.

Backends, named by `AttentionMetadata.backend`: "torch" (the reference, any device), "triton", and
those a device backend registers with `register_backend` (the CPU kernels register "cpu",
toolkit/backends/cpu/): this package knows no device's kernels itself.
"""

from collections.abc import Callable

import torch

from .metadata import AttentionMetadata
from .decode_torch import decode_attention_torch
from .reference import paged_attention_torch, write_kv_torch
from .write_torch import write_kv_traced

BUILTIN_BACKENDS = ("torch", "triton")
# name -> (paged_attention_fn, write_kv_fn); written by register_backend.
_REGISTERED: dict[str, tuple[Callable, Callable]] = {}


def register_backend(name: str, paged_attention_fn: Callable, write_kv_fn: Callable) -> None:
    """Add an attention backend: `paged_attention_fn(q, kv_cache, metadata, scale)` and
    `write_kv_fn(k, v, kv_cache, slot_mapping)`, with `paged_attention`'s and `write_kv`'s contracts,
    for every step kind."""
    if name in BUILTIN_BACKENDS:
        raise ValueError(f"{name!r} is a built-in attention backend")
    _REGISTERED[name] = (paged_attention_fn, write_kv_fn)


def backends() -> tuple[str, ...]:
    """Every backend name a step can use in this process."""
    return BUILTIN_BACKENDS + tuple(_REGISTERED)


@torch.library.custom_op("toolkit::write_kv", mutates_args=("kv_cache",))
def _write_kv_op(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    write_kv_torch(k, v, kv_cache, slot_mapping)


@torch.library.custom_op("toolkit::paged_attention", mutates_args=())
def _paged_attention_op(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return paged_attention_torch(q, kv_cache, query_start_loc, seq_lens, block_tables, scale)


@torch.library.custom_op("toolkit::write_kv_triton", mutates_args=("kv_cache",))
def _write_kv_triton_op(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    from . import triton_ops  # lazy: needs triton

    triton_ops.write_kv_triton(k, v, kv_cache, slot_mapping)


@torch.library.custom_op("toolkit::paged_attention_triton", mutates_args=())
def _paged_attention_triton_op(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    from . import triton_ops  # lazy: needs triton

    return triton_ops.paged_attention_triton(q, kv_cache, query_start_loc, seq_lens, block_tables, scale)


@_write_kv_op.register_fake
@_write_kv_triton_op.register_fake
def _write_kv_fake(k, v, kv_cache, slot_mapping) -> None:
    return None


@_paged_attention_op.register_fake
@_paged_attention_triton_op.register_fake
def _paged_attention_fake(q, kv_cache, query_start_loc, seq_lens, block_tables, scale):
    # Both real implementations return a fresh contiguous tensor shaped and typed like q.
    return q.new_empty(q.shape)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, backend: str = "torch"
) -> None:
    """Write k, v [T, Hkv, D] into kv_cache [2, N, block_size, Hkv, D] in place at slot_mapping [T].

    Slot -1 marks a padding token, which is not written. Under torch.compile the torch backend traces
    the write into the graph (`write_torch.py`); there padding must follow at least one real token.
    """
    if backend == "triton":
        torch.ops.toolkit.write_kv_triton(k, v, kv_cache, slot_mapping)
    elif backend in _REGISTERED:
        _REGISTERED[backend][1](k, v, kv_cache, slot_mapping)
    elif backend == "torch":
        if torch.compiler.is_compiling():
            write_kv_traced(k, v, kv_cache, slot_mapping)
        else:
            torch.ops.toolkit.write_kv(k, v, kv_cache, slot_mapping)
    else:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {backends()}")


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of the packed new tokens q [T, Hq, D] over each request's paged KV.

    Request i's queries are the last q_len_i of its seq_len_i positions; its keys and values (already
    written by write_kv) are read through its block table. Query head h uses kv head h // (Hq // Hkv).
    Prefill chunks and decodes mix freely in one batch. Rows past query_start_loc[-1] are zeros.
    Returns [T, Hq, D] in q's dtype; the softmax accumulates in float32.
    """
    args = (q, kv_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, scale)
    if metadata.backend == "triton":
        return torch.ops.toolkit.paged_attention_triton(*args)
    if metadata.backend == "torch":
        if metadata.decode_only and torch.compiler.is_compiling():
            # Traced, so Inductor fuses the paged gather into the reductions (see decode_torch.py).
            return decode_attention_torch(q, kv_cache, metadata.seq_lens, metadata.block_tables, scale)
        return torch.ops.toolkit.paged_attention(*args)
    registered = _REGISTERED.get(metadata.backend)
    if registered is not None:
        return registered[0](q, kv_cache, metadata, scale)
    raise ValueError(f"unknown attention backend {metadata.backend!r}; expected one of {backends()}")
