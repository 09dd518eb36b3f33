"""Paged batches for the attention tests: random block ids, garbage in every slot a request does not
own, and the dense float64 causal attention every implementation is held to."""

import math
import random
from dataclasses import dataclass

import torch

from toolkit.attention import AttentionMetadata

HEAD_CONFIGS = [(4, 4), (8, 2), (8, 1)]  # (Hq, Hkv): GQA ratio 1, 4, and MQA


@dataclass
class Batch:
    q: torch.Tensor  # [T, Hq, D]
    kv_cache: torch.Tensor  # [2, N, block_size, Hkv, D]
    metadata: AttentionMetadata
    keys: list  # per request: full K [seq_len, Hkv, D] (context + new tokens)
    values: list
    specs: list  # per request: (context_len, q_len)
    num_tokens: int  # real (non-padding) tokens; rows past it are padding
    scale: float


def make_batch(specs, *, block_size, num_heads, num_kv_heads, head_dim, num_pad=0, dtype=torch.float32, seed=0):
    """A paged batch whose request i has specs[i] = (context_len, q_len): context_len tokens cached
    by earlier steps plus q_len new ones, all already in the cache (filled here by a plain loop)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [c + n for c, n in specs]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # a few blocks nobody owns
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # non-contiguous, out-of-order blocks for every request

    # Garbage everywhere a request does not own: a wrong read changes the result visibly.
    kv_cache = 100 * torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    max_blocks = max(blocks_per_req, default=0) + 1  # one extra column of 0-padding
    block_tables = torch.zeros(len(specs), max_blocks, dtype=torch.int32)
    keys, values = [], []
    for i, seq_len in enumerate(seq_lens):
        own = [ids.pop() for _ in range(blocks_per_req[i])]
        block_tables[i, : len(own)] = torch.tensor(own, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(seq_len):
            block, offset = own[pos // block_size], pos % block_size
            kv_cache[0, block, offset] = k[pos]
            kv_cache[1, block, offset] = v[pos]
        keys.append(k)
        values.append(v)

    q_lens = [n for _, n in specs]
    num_tokens = sum(q_lens)
    query_start_loc = torch.tensor([0] + list(_cumsum(q_lens)), dtype=torch.int32)
    slot_mapping = torch.full((num_tokens + num_pad,), -1, dtype=torch.int64)
    for i, (ctx, n) in enumerate(specs):
        for j in range(n):
            pos = ctx + j
            block = int(block_tables[i, pos // block_size])
            slot_mapping[query_start_loc[i] + j] = block * block_size + pos % block_size
    q = torch.randn(num_tokens + num_pad, num_heads, head_dim, generator=gen).to(dtype)
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=slot_mapping,
    )
    return Batch(q, kv_cache.to(dtype), metadata, keys, values, list(specs), num_tokens, head_dim**-0.5)


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def dense_reference(batch: Batch) -> torch.Tensor:
    """Plain causal attention per request over its full K/V, in float64; padding rows are zero."""
    q = batch.q.double()
    out = torch.zeros_like(q)
    num_heads = q.shape[1]
    start = 0
    for (ctx, n), k, v in zip(batch.specs, batch.keys, batch.values):
        group = num_heads // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)  # [S, Hq, D]: head h reads kv head h // group
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + n], k) * batch.scale
        query_pos = ctx + torch.arange(n)
        future = torch.arange(ctx + n)[None, :] > query_pos[:, None]
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        out[start : start + n] = torch.einsum("hqk,khd->qhd", probs, v)
        start += n
    return out


def random_specs(rng, block_size, num_requests):
    """A mix of decodes, fresh prefills and later prefill chunks, crossing block boundaries."""
    specs = []
    for _ in range(num_requests):
        kind = rng.choice(["decode", "fresh", "chunk", "chunk"])
        if kind == "decode":
            specs.append((rng.randint(0, 3 * block_size), 1))
        elif kind == "fresh":
            specs.append((0, rng.randint(2, 2 * block_size + 3)))
        else:
            specs.append((rng.randint(1, 2 * block_size + 3), rng.randint(2, block_size + 5)))
    return specs
