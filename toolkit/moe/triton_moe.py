"""The routed experts of an MoE layer as a Triton grouped GEMM (vLLM's fused_moe structure).

`fused_experts_triton(x, w13, w2, topk_weights, topk_ids, first_expert)` computes, per token t,

    out[t] = sum_j topk_weights[t, j] * (silu(x_t @ gate_e^T) * (x_t @ up_e^T)) @ down_e^T

with e = topk_ids[t, j] - first_expert, gate_e = w13[e, :I], up_e = w13[e, I:], down_e = w2[e]. A
(token, slot) pair whose expert is not local (e outside [0, E_local)) contributes nothing: that is
how an expert-parallel rank computes only its own experts.

Two steps:
1. `moe_align_block_size` sorts the (token, slot) pairs by local expert and pads each expert's run
   of rows to a multiple of BLOCK_M with a sentinel (the pair count P), so that every block of
   BLOCK_M rows belongs to one expert; `expert_ids` names the expert of each block. Sizes depend on
   shapes only (P + min(E, P) * (BLOCK_M - 1) rows at most), never on the routing, so nothing syncs
   with the host and a CUDA graph can capture it.
2. `_grouped_gemm_kernel` runs twice. A program owns one block of rows (one expert) and one BLOCK_N
   tile of the output columns, and gathers its rows of A through the sorted pair indices:
   - x @ w13^T with silu(gate) * up fused (each program holds the gate tile and the matching up
     tile), written per pair into an [P, I] cache in x's dtype;
   - that cache @ w2^T, scaled by the routing weight in float32, written per pair into an [P, H]
     float32 buffer whose k slots are then summed per token.
   Products accumulate in float32 (input_precision="ieee": float32 inputs are not truncated to tf32).

This module imports triton at the top; import it lazily (the op in ops.py does). Under
TRITON_INTERPRET=1, set before triton is first imported, the kernel runs on CPU tensors.
"""

import torch
import triton
import triton.language as tl


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int, first_expert: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs of topk_ids [T, k] by local expert, padded to blocks of block_m rows.

    Pair p is token p // k, slot p % k (topk_ids flattened). Local expert = id - first_expert; pairs
    whose local expert is outside [0, num_experts) are left out.

    Returns
    - sorted_ids [max_rows] int64: the pairs of local expert 0, padded with the sentinel P (= T * k)
      to a multiple of block_m, then those of expert 1, ...; rows past the padded total are P too.
      Within an expert, pairs keep their original order.
    - expert_ids [max_rows // block_m] int64: the local expert of each block, -1 past the last.
    - num_rows_post_padded [1] int64: the padded total (a multiple of block_m).
    max_rows = P + min(num_experts, P) * (block_m - 1), rounded up to a multiple of block_m: a bound
    set by shapes alone, so the step does not sync with the host.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64) - first_expert
    num_pairs = flat.numel()
    max_rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    max_rows = triton.cdiv(max_rows, block_m) * block_m
    sorted_ids = torch.full((max_rows + 1,), num_pairs, dtype=torch.int64, device=device)  # +1: a dump row
    if num_experts == 0:
        return sorted_ids[:max_rows], torch.full((0,), -1, dtype=torch.int64, device=device), \
            torch.zeros(1, dtype=torch.int64, device=device)
    local = (flat >= 0) & (flat < num_experts)
    key = torch.where(local, flat, num_experts)  # non-local pairs go to an extra bucket, dropped below
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))  # not bincount: that syncs to size its output
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts

    order = torch.argsort(key, stable=True)  # pair indices grouped by expert, original order within
    sorted_key = key[order]
    safe_key = sorted_key.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=device) - start[safe_key]
    # A local pair lands at its expert's padded start plus its rank there; the others at the dump row.
    dest = torch.where(sorted_key < num_experts, padded_start[safe_key] + rank, max_rows)
    sorted_ids.scatter_(0, dest, order)
    sorted_ids = sorted_ids[:max_rows]

    block_start = torch.arange(0, max_rows, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)  # num_experts: past the end
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1)
    num_rows_post_padded = padded_end[-1:].clone()
    return sorted_ids, expert_ids, num_rows_post_padded


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_rows_ptr,
    N, K, num_pairs, up_offset,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    A_ROW_DIV: tl.constexpr, SILU_MUL: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # C[p, n] = sum_k A[p // A_ROW_DIV, k] * B[e, n, k] for the pairs p of one block (expert e).
    # SILU_MUL: C = silu(that) * (the same with B's rows n + up_offset). MUL_WEIGHT: C *= weights[p].
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):  # a spare block of the shape-sized grid
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_valid = pairs < num_pairs  # the rest are padding (the sentinel)
    a_rows = pairs // A_ROW_DIV
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < N
    b_base = b_ptr + expert * stride_be

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SILU_MUL:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        b_mask = k_valid[:, None] & col_valid[None, :]
        b = tl.load(b_base + cols[None, :] * stride_bn + ks[:, None] * stride_bk, mask=b_mask, other=0.0)
        acc += tl.dot(a, b, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        if SILU_MUL:
            b_up = tl.load(b_base + (cols[None, :] + up_offset) * stride_bn + ks[:, None] * stride_bk,
                           mask=b_mask, other=0.0)
            acc_up += tl.dot(a, b_up, input_precision="ieee")
    if SILU_MUL:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pairs, mask=row_valid, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=row_valid[:, None] & col_valid[None, :])


def _block_sizes(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    # Few rows per expert (decode): small row blocks waste less on padding. tl.dot needs 16 at least.
    if num_pairs <= 16 * num_experts:
        return 16, 64, 64
    return 64, 64, 32


def _launch(a, b, c, weights, sorted_ids, expert_ids, num_rows, n, k, num_pairs, up_offset, a_row_div,
            silu_mul, mul_weight, block_m, block_n, block_k):
    grid = (sorted_ids.numel() // block_m, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, c, weights, sorted_ids, expert_ids, num_rows,
        n, k, num_pairs, up_offset,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, SILU_MUL=silu_mul, MUL_WEIGHT=mul_weight,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def fused_experts_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int = 0,
    block_sizes: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """The routed experts (module docstring) for x [T, H], w13 [E_local, 2I, H], w2 [E_local, H, I],
    topk_weights [T, k] (applied in float32), topk_ids [T, k] global expert ids. Returns [T, H] in
    x's dtype; tokens with no local expert get zeros. x, w13 and w2 share one dtype (float32,
    bfloat16 or float16). block_sizes = (BLOCK_M, BLOCK_N, BLOCK_K) overrides the heuristic (tests)."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, w13_hidden = w13.shape
    inter = two_inter // 2
    if w13_hidden != hidden or two_inter != 2 * inter or tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"expert weights do not match: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T={num_tokens}, k]")
    if not (x.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"x, w13 and w2 must share a dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0 or num_experts == 0:
        return x.new_zeros(x.shape)
    block_m, block_n, block_k = block_sizes or _block_sizes(num_pairs, num_experts)
    sorted_ids, expert_ids, num_rows = moe_align_block_size(topk_ids, block_m, num_experts, first_expert)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()

    # Rows of pairs no local expert serves are never written here and never read.
    act = x.new_empty(num_pairs, inter)
    _launch(x, w13, act, weights, sorted_ids, expert_ids, num_rows, inter, hidden, num_pairs, inter,
            top_k, True, False, block_m, block_n, block_k)
    out = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)  # non-local pairs: zero
    _launch(act, w2, out, weights, sorted_ids, expert_ids, num_rows, hidden, inter, num_pairs, 0,
            1, False, True, block_m, block_n, block_k)
    return out.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
