"""Torch reference for write_kv and paged_attention.

This is the oracle every other backend is tested against, and the path of any device without
kernels of its own (or with them switched off), so it is written to be fast as well as plain: all
decodes of a batch go through one gathered, masked scaled_dot_product_attention call, and each
prefill chunk gets one call of its own.

GQA: query head h uses kv head h // G (G = Hq // Hkv). Decodes fold the G query heads of a kv head
into rows, q [B, Hkv, G, D] against k, v [B, Hkv, S, D], with no copy of K/V per query head (on CPU
several times faster than enable_gqa for bf16 decodes). Prefill chunks use enable_gqa with 4-d
inputs, which takes SDPA's flash kernel on CPU.
"""

import torch
import torch.nn.functional as F


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, Hkv, D] into kv_cache [2, N, block_size, Hkv, D] at slot_mapping; -1 is skipped."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    # view (not reshape) so a non-contiguous cache fails loudly instead of writing into a copy.
    k_slots = kv_cache[0].view(-1, num_kv_heads, head_dim)
    v_slots = kv_cache[1].view(-1, num_kv_heads, head_dim)
    slots = slot_mapping.long()  # index_copy_ wants int64 indices
    valid = slots >= 0
    if not bool(valid.all()):  # masking costs more than the copy itself: only when there is padding
        slots, k, v = slots[valid], k[valid], v[valid]
    k_slots.index_copy_(0, slots, k.to(kv_cache.dtype))
    v_slots.index_copy_(0, slots, v.to(kv_cache.dtype))


def paged_attention_torch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal varlen attention of q [T, Hq, D] over each request's cached context; see ops.paged_attention."""
    out = q.new_zeros(q.shape)  # padding tokens past query_start_loc[-1] stay zero
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [end - start for start, end in zip(starts, starts[1:])]
    for i, (q_len, seq_len) in enumerate(zip(q_lens, lens)):
        if q_len < 0 or q_len > seq_len:
            raise ValueError(f"request {i}: q_len {q_len} must be in [0, seq_len {seq_len}]")

    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    if decodes:
        _decode_batch(q, kv_cache, starts, lens, block_tables, decodes, scale, out)
    for i, n in enumerate(q_lens):
        if n > 1:
            _prefill_chunk(q, kv_cache, starts[i], starts[i + 1], lens[i], block_tables[i], scale, out)
    return out


def _decode_batch(q, kv_cache, starts, lens, block_tables, requests, scale, out) -> None:
    """All single-token requests at once: gather their blocks, pad to the longest, mask the rest."""
    device = q.device
    token_idx = torch.tensor([starts[i] for i in requests], device=device)
    seq_lens = torch.tensor([lens[i] for i in requests], device=device)
    max_len = max(lens[i] for i in requests)
    tables = block_tables[torch.tensor(requests, device=device)]
    k, v = _gather_context(kv_cache, tables, max_len)  # [Bd, Hkv, S, D]

    num_reqs, num_kv_heads = k.shape[:2]
    num_heads, head_dim = q.shape[1:]
    # One query position per request, so the G query heads of a kv head are G rows with one mask.
    qd = q[token_idx].view(num_reqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = torch.arange(max_len, device=device) < seq_lens[:, None]  # [Bd, S]
    o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    out[token_idx] = o.reshape(num_reqs, num_heads, head_dim)


def _prefill_chunk(q, kv_cache, start, end, seq_len, block_table, scale, out) -> None:
    """One request's chunk of q_len > 1 queries: the last q_len of its seq_len positions."""
    device = q.device
    q_len = end - start
    k, v = _gather_context(kv_cache, block_table[None], seq_len)  # [1, Hkv, S, D]
    # 4-d inputs: SDPA's CPU flash kernel (3-d ones take the slower math path), with the
    # G query heads of a kv head sharing its K/V through enable_gqa (no copy per query head).
    qh = q[start:end].transpose(0, 1)[None]  # [1, Hq, q_len, D]
    if q_len == seq_len:
        # A first chunk: plain causal attention (the flash kernel skips the masked half, which it
        # cannot do for the same mask given explicitly).
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query j sits at absolute position seq_len - q_len + j (earlier chunks are already cached),
        # so causality is a lower-right aligned mask, not SDPA's top-left is_causal.
        query_pos = seq_len - q_len + torch.arange(q_len, device=device)
        mask = torch.arange(seq_len, device=device)[None, :] <= query_pos[:, None]  # [q_len, S]
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out[start:end] = o[0].transpose(0, 1)


def _gather_context(kv_cache, tables, length):
    """K and V [B, Hkv, length, D] of the first `length` tokens of each block table row."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-length // block_size)
    tables = tables[:, :num_blocks].long()
    k = kv_cache[0][tables].flatten(1, 2)[:, :length]  # [B, length, Hkv, D]
    v = kv_cache[1][tables].flatten(1, 2)[:, :length]
    return k.transpose(1, 2), v.transpose(1, 2)
