"""KV-cache layout and sizing.

Per layer the cache is one tensor [2, num_blocks, block_size, num_kv_heads, head_dim]: index 0 holds
keys, 1 values, and token slot s lives at block s // block_size, offset s % block_size.
"""

import os
from collections.abc import Callable

import torch


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token occupies across all layers (a key and a value per kv head per layer)."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


def num_blocks_for_budget(
    budget_bytes: int, *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """How many whole blocks fit in budget_bytes (0 when the budget is too small or negative)."""
    block_bytes = block_size * kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
    return max(0, int(budget_bytes) // block_bytes)


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer; `empty(shape,
    dtype)`, where given, allocates each on the device (the CPU backend's puts them on huge pages)."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    if empty is None:
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    return [empty(shape, dtype).zero_() for _ in range(num_layers)]


def available_memory_bytes(device: torch.device | str) -> int:
    """Memory that could still be allocated on device right now, in bytes."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        return _cpu_available_bytes()
    raise ValueError(f"available_memory_bytes: unsupported device type {device.type!r}")


def _cpu_available_bytes() -> int:
    # MemAvailable counts reclaimable page cache too, which is what a new allocation can really use;
    # the sysconf fallback (free pages only) is an underestimate for systems without /proc/meminfo.
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file reports kB
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
