"""Decode attention written for Inductor: the CPU fast path of decode-only steps when compiled.

The reference (`reference.py`) gathers each request's blocks into a padded copy and calls SDPA:
right for any batch, but every layer pays a full copy of the batch's KV (the step profile of a
64-request decode showed the gathers and SDPA at about 60% of the step). Here every op is a plain
tensor op over the block table, so Inductor fuses the gather into the two reductions: the keys and
values are read in place from the paged cache, once, and nothing of context size is materialized
but the scores. The same code runs eagerly (it is tested against the reference that way), but
only compiled is it fast; eager steps keep the reference.

Shapes: one query token per row; q [B, Hq, D], seq_lens [B], block_tables [B, W]. Query head h
uses kv head h // G (G = Hq // Hkv), as in the reference. Scores are laid out [B, Hkv, S, G] so the
G query heads that share a kv head are computed from one read of each key.
"""

import torch


def decode_attention_torch(
    q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Hq, D] at the last position of each row's seq_lens; returns [B, Hq, D] in q's dtype."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    width = block_tables.shape[1] * block_size
    tables = block_tables.long()

    def context(cache: torch.Tensor) -> torch.Tensor:  # [B, Hkv, S, D], a view Inductor fuses
        return cache[tables].permute(0, 3, 1, 2, 4).flatten(2, 3)

    k, v = context(kv_cache[0]).float(), context(kv_cache[1]).float()
    qg = q.float().view(-1, num_kv_heads, 1, group, head_dim)
    scores = (qg * k[:, :, :, None, :]).sum(-1) * scale  # [B, Hkv, S, G]
    valid = torch.arange(width, device=q.device)[None, :] < seq_lens.long()[:, None]  # [B, S]
    scores = scores.masked_fill(~valid[:, None, :, None], float("-inf"))
    probs = scores.softmax(dim=2)
    out = (probs[..., None] * v[:, :, :, None, :]).sum(2)  # [B, Hkv, G, D]
    return out.reshape(-1, num_heads, head_dim).to(q.dtype)
