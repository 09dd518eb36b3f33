"""Paged attention: KV-cache layout and sizing, AttentionMetadata, and the write_kv /
paged_attention ops (torch reference and Triton kernels) registered as torch.library custom ops
under the "toolkit" namespace."""

from .kv_cache import allocate_kv_cache, available_memory_bytes, kv_cache_bytes_per_token, num_blocks_for_budget
from .metadata import AttentionMetadata
from .ops import paged_attention, write_kv

__all__ = [
    "AttentionMetadata",
    "write_kv",
    "paged_attention",
    "kv_cache_bytes_per_token",
    "num_blocks_for_budget",
    "allocate_kv_cache",
    "available_memory_bytes",
]
