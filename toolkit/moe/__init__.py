"""Mixture-of-experts ops: the routed experts op (ops.py) and its Triton kernel (triton_moe.py).

`moe_experts(x, w13, w2, topk_weights, topk_ids, first_expert=0, tokens_per_expert=None)` is the
custom op `toolkit::moe_experts`; `register_impl(device_type, fn)` plugs in a device's own kernel
(CUDA defaults to the Triton one, imported on first use); `moe_experts_torch` is the reference.
"""

from toolkit.moe.ops import impl_for, moe_experts, moe_experts_torch, register_impl

__all__ = ["impl_for", "moe_experts", "moe_experts_torch", "register_impl"]
