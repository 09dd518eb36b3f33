"""The routed experts of one MoE layer as one custom op, `toolkit::moe_experts`, with a backend per device.

    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),   e = topk_ids[t, j]

over the experts this process holds: `w13` `[E_local, 2*I, H]` (gate rows 0..I-1, then up rows) and
`w2` `[E_local, H, I]` are global experts `[first_expert, first_expert + E_local)`; a (token, slot)
routed to any other expert contributes nothing (under expert parallelism another rank computes it).
The expert outputs are weighted in float32 and summed per token in float32, then cast to x's dtype
once (transformers weights in float32 too; it sums the top-k terms in x's dtype, which only differs
in half types, and there by rounding alone).

`tokens_per_expert` (int64 `[E]`, global E), when given, is incremented in place by the number of
(token, slot) pairs each local expert received: the load statistics behind the engine's
`toolkit:moe_expert_tokens` metric. Pairs for other ranks' experts are not counted here.

As with the attention ops, torch.compile sees only the fake implementation, so a model calling the
op traces with fullgraph=True; the real implementations may use data-dependent Python (the torch
reference reads the per-expert counts on the host). Which implementation runs is chosen per call by
the device of x (`register_impl`): CUDA uses the Triton kernel (`toolkit.moe.triton_moe`, imported
on first use), any device without a registered implementation the torch reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F

log = logging.getLogger("toolkit")

# (x, w13, w2, topk_weights, topk_ids, first_expert) -> out [T, H], the reference's contract.
ExpertsImpl = Callable[..., torch.Tensor]
# device type -> implementation; written by register_impl. CUDA's default is filled in lazily.
_IMPLS: dict[str, ExpertsImpl] = {}


def moe_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """The reference: sort the (token, slot) pairs by expert, one matmul pair per expert over its
    contiguous rows, scatter-add the weighted rows back to their tokens."""
    return grouped_experts(x, topk_weights, topk_ids, first_expert, w13.shape[0],
                           lambda e, rows: swiglu(rows, w13[e], w2[e]))


def swiglu(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(rows, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def grouped_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, first_expert: int,
                    num_local: int, expert_mlp: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The grouping every host implementation shares: (token, slot) pairs of local experts sorted by
    expert, `expert_mlp(local expert, its rows) -> their outputs` once per expert that has rows, the
    outputs weighted and summed per token in float32."""
    k = topk_ids.shape[1]
    local = topk_ids.reshape(-1) - first_expert
    pairs = torch.nonzero((local >= 0) & (local < num_local)).squeeze(1)  # flat (token, slot) indices
    pairs = pairs[torch.argsort(local[pairs], stable=True)]
    counts = torch.bincount(local[pairs], minlength=num_local).tolist()
    rows = x[pairs // k]
    out_rows = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out_rows[start:start + n] = expert_mlp(e, rows[start:start + n])
            start += n
    weighted = out_rows.float() * topk_weights.reshape(-1)[pairs].float().unsqueeze(1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, pairs // k, weighted)
    return out.to(x.dtype)


def count_tokens(tokens_per_expert: torch.Tensor, topk_ids: torch.Tensor, first_expert: int, num_local: int) -> None:
    """Add the pairs routed to local experts [first_expert, first_expert + num_local) to their counters."""
    ids = topk_ids.reshape(-1)
    local = ids[(ids >= first_expert) & (ids < first_expert + num_local)]
    tokens_per_expert += torch.bincount(local, minlength=tokens_per_expert.shape[0])[:tokens_per_expert.shape[0]]


def register_impl(device_type: str, impl: ExpertsImpl | None, replace: bool = True) -> None:
    """Use `impl` (the reference's signature and contract) for inputs on `device_type` ("cpu", "cuda");
    None restores the default (CUDA: the Triton kernel; elsewhere the torch reference). A device
    backend registers its own with replace=False, so an implementation the user plugged in wins. On
    CPU, register before the engine is built: where the CPU kernel is the implementation then, the
    layers call it straight, past this registry (toolkit/backends/cpu/experts.py)."""
    if impl is None:
        _IMPLS.pop(device_type, None)
    elif replace or device_type not in _IMPLS:
        _IMPLS[device_type] = impl


def impl_for(device: torch.device) -> ExpertsImpl:
    """The implementation inputs on `device` run with."""
    impl = _IMPLS.get(device.type)
    if impl is None and device.type == "cuda":
        impl = _IMPLS["cuda"] = _triton_or_reference()
    return impl or moe_experts_torch


def _triton_or_reference() -> ExpertsImpl:
    try:
        from toolkit.moe.triton_moe import fused_experts_triton  # lazy: needs triton and a GPU
    except ImportError as e:
        log.warning("MoE experts: the Triton kernel is unavailable (%s); the torch reference serves", e)
        return moe_experts_torch
    return fused_experts_triton


@torch.library.custom_op("toolkit::moe_experts", mutates_args=("tokens_per_expert",))
def _moe_experts_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, first_expert: int = 0,
                    tokens_per_expert: Optional[torch.Tensor] = None) -> torch.Tensor:
    if tokens_per_expert is not None:
        count_tokens(tokens_per_expert, topk_ids, first_expert, w13.shape[0])
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    return impl_for(x.device)(x, w13, w2, topk_weights, topk_ids, first_expert)


@_moe_experts_op.register_fake
def _moe_experts_fake(x, w13, w2, topk_weights, topk_ids, first_expert=0, tokens_per_expert=None):
    return x.new_empty(x.shape)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, first_expert: int = 0,
                tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' combined output `[T, H]` in x's dtype, for x `[T, H]`, topk_weights `[T, k]`
    (float32) and topk_ids `[T, k]` (int64, global expert ids); see the module docstring."""
    return torch.ops.toolkit.moe_experts(x, w13, w2, topk_weights, topk_ids, first_expert, tokens_per_expert)
