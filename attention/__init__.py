"""Paged attention: KV-cache layout and sizing, AttentionMetadata, and the write_kv /
paged_attention ops (torch reference and Triton kernels) registered as torch.library custom ops
under the "toolkit" namespace. Device backends add their own kernels with `register_backend`.
Imports torch and triton only."""

from .kv_cache import allocate_kv_cache, available_memory_bytes, kv_cache_bytes_per_token, num_blocks_for_budget
from .metadata import AttentionMetadata
from .ops import backends, paged_attention, register_backend, write_kv

__all__ = [
    "AttentionMetadata",
    "write_kv",
    "paged_attention",
    "register_backend",
    "backends",
    "kv_cache_bytes_per_token",
    "num_blocks_for_budget",
    "allocate_kv_cache",
    "available_memory_bytes",
]
