"""Triton kernels for write_kv and paged attention.

This module imports triton at the top, so it is imported lazily (by the custom ops in ops.py, on
their first call). Under TRITON_INTERPRET=1, which must be set before this module is imported, the
same kernels run on CPU tensors; that is how the tests check them against the torch reference.

The attention kernel is one unified kernel for prefill chunks and decodes. A program owns one
query tile of one request and one kv head: BLOCK_M rows, each a (query token, query head of that
kv head's group) pair, so GQA reads each K/V block once for all G heads of the group. It walks the
request's blocks through its block table with an online softmax in float32.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_mapping_ptr,
    k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    cache_stride_kv, cache_stride_block, cache_stride_slot, cache_stride_h,
    block_size,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program copies one token's key and value for one kv head.
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding token
        return
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    k = tl.load(k_ptr + token * k_stride_t + head * k_stride_h + dims, mask=dim_valid)
    v = tl.load(v_ptr + token * v_stride_t + head * v_stride_h + dims, mask=dim_valid)
    dst = (slot // block_size) * cache_stride_block + (slot % block_size) * cache_stride_slot + head * cache_stride_h
    tl.store(cache_ptr + dst + dims, k.to(cache_ptr.dtype.element_ty), mask=dim_valid)
    tl.store(cache_ptr + cache_stride_kv + dst + dims, v.to(cache_ptr.dtype.element_ty), mask=dim_valid)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton version of reference.write_kv_torch (same arguments and effect)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _check_last_dim_contiguous(k=k, v=v, kv_cache=kv_cache)
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        kv_cache.shape[2],
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _find_request(query_start_loc_ptr, num_requests, tile, BLOCK_Q: tl.constexpr):
    # Request i's tiles start at query_start_loc[i] // BLOCK_Q + i, which strictly increases with i
    # and leaves room for its cdiv(q_len, BLOCK_Q) tiles; find the last request starting at or before tile.
    lo = 0
    hi = num_requests
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, cache_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    scale, num_requests,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h,
    cache_stride_kv, cache_stride_block, cache_stride_slot, cache_stride_h,
    block_tables_stride,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, num_requests, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_tile = tile - (q_start // BLOCK_Q + req)
    if local_tile * BLOCK_Q >= q_len:  # a spare program of the fixed-size grid
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # tokens cached before this step's queries

    # Row r is query token local_tile * BLOCK_Q + r // GROUP, query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    q_idx = local_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    query_pos = context_len + q_idx  # absolute position of each row's query token
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q_offsets = (q_start + q_idx)[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    # Finite start for the running max so rows that see no key yet never compute inf - inf.
    m = tl.full([BLOCK_M], -1e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys past the tile's last query are in the causal future of every row: stop before them.
    last_pos = context_len + tl.minimum(q_len, (local_tile + 1) * BLOCK_Q) - 1
    slots = tl.arange(0, BLOCK_SIZE)
    for j in range(0, last_pos // BLOCK_SIZE + 1):
        block = tl.load(block_tables_ptr + req * block_tables_stride + j).to(tl.int64)
        key_pos = j * BLOCK_SIZE + slots
        kv_valid = (key_pos < seq_len)[:, None] & dim_valid[None, :]  # never read slots nobody wrote
        kv_offsets = block * cache_stride_block + slots[:, None] * cache_stride_slot + kv_head * cache_stride_h
        k = tl.load(cache_ptr + kv_offsets + dims[None, :], mask=kv_valid, other=0.0)
        v = tl.load(cache_ptr + cache_stride_kv + kv_offsets + dims[None, :], mask=kv_valid, other=0.0)

        # ieee: fp32 inputs would otherwise be truncated to tf32 on GPUs; 16-bit inputs are unaffected.
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_SIZE], fp32
        s = tl.where(key_pos[None, :] <= query_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)  # rescales what was accumulated under the old max
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    out = acc / l[:, None]
    out_offsets = (q_start + q_idx)[:, None] * out_stride_t + head[:, None] * out_stride_h + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


def paged_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton version of reference.paged_attention_torch (same arguments and result)."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_requests = seq_lens.shape[0]
    out = q.new_zeros(q.shape)  # padding rows past query_start_loc[-1] stay zero; no program writes them
    if num_tokens == 0 or num_requests == 0:
        return out
    _check_last_dim_contiguous(q=q, kv_cache=kv_cache)
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"triton paged attention needs a power-of-two block_size >= 16, got {block_size}")
    group = num_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group))  # tl.dot needs at least 16 rows
    block_q = block_m // group  # query tokens per tile
    # A grid fixed by shapes alone (no host sync on the metadata): enough tiles for any split of
    # num_tokens into num_requests requests; programs without work return at once.
    grid = (num_tokens // block_q + num_requests, num_kv_heads)
    _paged_attention_kernel[grid](
        out, q, kv_cache, query_start_loc, seq_lens, block_tables,
        scale, num_requests,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q,
    )
    return out


def _check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    # The kernels index the head dimension with unit stride; other strides are passed in.
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
