"""write_kv written for Inductor: compiled torch-backend steps store the new keys and values with
one in-place `index_copy_` inside the graph instead of calling the opaque op.

The opaque op costs more than the copy it does: at batch 1 its Python dispatch and padding mask
take longer than writing a few hundred bytes. Two details keep Inductor writing in place instead of
copying the cache: the copy goes through a view of the whole cache tensor (through `kv_cache[0]`
alone, Inductor copied the layer's whole cache on every call), and no row is dropped (a
data-dependent row count would break the graph). Padding rows (slot -1, after the real tokens)
write the last real token's key and value to that token's slot once more: the same value to the
same slot, so the order of the duplicate writes cannot matter.
"""

import torch


def write_kv_traced(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Same contract as `write_kv_torch`, for a batch whose padding (-1) rows follow at least one real row."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(-1, num_kv_heads, head_dim)  # keys in rows [0, S), values in [S, 2S)
    num_slots = flat.shape[0] // 2
    slots = slot_mapping.long()
    real = slots >= 0
    last_real = (real.sum() - 1).clamp(min=0)
    rows = torch.where(real, torch.arange(slots.shape[0], device=slots.device), last_real)
    slots = slots[rows]
    flat.index_copy_(0, torch.cat([slots, slots + num_slots]), torch.cat([k[rows], v[rows]]).to(flat.dtype))
