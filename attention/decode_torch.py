"""Decode attention written for Inductor: decode-only steps of the torch backend when compiled (a
device backend's own kernel, such as the CPU one, replaces it where registered).

The reference (`reference.py`) gathers each request's blocks into a padded copy and calls SDPA:
right for any batch, but every layer pays a full copy of the batch's KV (most of a 64-request
decode step, in the profile in docs/benchmarks.md). Here every op is a plain
tensor op over the block table, so Inductor fuses the gather into the two reductions: the keys and
values are read in place from the paged cache, once, and nothing of context size is materialized
but the scores. The same code runs eagerly (it is tested against the reference that way), but
only compiled is it fast; eager steps keep the reference.

Shapes: one query token per row; q [B, Hq, D], seq_lens [B], block_tables [B, W]. Query head h
uses kv head h // G (G = Hq // Hkv), as in the reference. Scores are laid out [B, W, bs, Hkv, G]
(W blocks of bs positions) so the G query heads that share a kv head are computed from one read of
each key.
"""

import torch


def decode_attention_torch(
    q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Hq, D] at the last position of each row's seq_lens; returns [B, Hq, D] in q's dtype."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    width = block_tables.shape[1]
    tables = block_tables.long()
    k = kv_cache[0][tables].float()  # [B, W, bs, Hkv, D]: a view Inductor fuses into the reductions
    v = kv_cache[1][tables].float()
    qg = q.float().view(-1, 1, 1, num_kv_heads, group, head_dim)
    scores = (qg * k[:, :, :, :, None, :]).sum(-1) * scale  # [B, W, bs, Hkv, G]
    position = torch.arange(width * block_size, device=q.device).view(width, block_size)
    valid = position[None] < seq_lens.long()[:, None, None]  # [B, W, bs]
    scores = scores.masked_fill(~valid[..., None, None], float("-inf"))
    weights = (scores - scores.amax(dim=(1, 2), keepdim=True)).exp()
    # The value sum in two levels, within each block and then over blocks: the inner loop then runs
    # over one block's rows, so the block-table lookup is paid once per block, not once per position.
    per_block = (weights[..., None] * v[:, :, :, :, None, :]).sum(2)  # [B, W, Hkv, G, D]
    out = per_block.sum(1) / weights.sum(dim=(1, 2))[..., None]
    return out.reshape(-1, num_heads, head_dim).to(q.dtype)
