"""The CPU implementation of the experts op: one C++ call per layer (`toolkit::experts_cpu`,
csrc/experts.cpp) over the experts' weights in the layouts the linears' plan chose (linear.py).

A decode step gives each expert a few rows, so its matmuls are short streams over its weights; from
Python each expert cost a dozen op calls per layer (slicing, two linears, the activation, copies) on top
of the grouping, more than the streams themselves. In the one call the experts with at most `small_m`
rows run the panel kernel together, and an expert with more rows (a prefill's) runs oneDNN's native
units, whose weight is packed once here (`F.linear` on a plain bf16 weight has oneDNN reorder it on
every call).

The op is called with the stacked `Experts.w13` / `w2` (toolkit/moe/ops.py's contract, which the
reference and expert parallelism share), so the packed layouts are found by the data pointer of
`w13`; an entry lives as long as that parameter does. Experts never packed run the reference.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from toolkit.backends.cpu.linear import NEVER, ONEDNN_BATCH_HINT, LinearPlan, pack
from toolkit.moe.ops import moe_experts_torch, register_impl


@dataclass
class _Packed:
    """One layer's local experts in the linear kernel's layouts: stacked panels and/or a oneDNN weight
    per expert, and the largest row count the panels serve."""

    w13_panels: torch.Tensor | None
    w2_panels: torch.Tensor | None
    w13_onednn: list[torch.Tensor]
    w2_onednn: list[torch.Tensor]
    small_m: int


_PACKED: dict[int, _Packed] = {}  # Experts.w13.data_ptr() -> its packed layouts


def _onednn(weights: torch.Tensor, plan: LinearPlan) -> list[torch.Tensor]:
    if not plan.onednn:
        return []
    return [torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), ONEDNN_BATCH_HINT) for w in weights]


def pack_experts(model: nn.Module, plan: LinearPlan) -> int:
    """Pack every `Experts` module's weights under `plan` and serve the experts op on CPU with them;
    returns how many layers were packed."""
    from toolkit.models.moe import Experts

    count = 0
    for experts in (m for m in model.modules() if isinstance(m, Experts)):
        w13, w2 = experts.w13.detach(), experts.w2.detach()
        key = w13.data_ptr()
        _PACKED[key] = _Packed(pack(w13) if plan.panels else None, pack(w2) if plan.panels else None,
                               _onednn(w13, plan), _onednn(w2, plan),
                               small_m=(plan.small_m if plan.onednn else NEVER) if plan.panels else 0)
        weakref.finalize(experts.w13, _PACKED.pop, key, None)
        count += 1
    if count:
        register_impl("cpu", moe_experts_cpu, replace=False)
    return count


def moe_experts_cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    packed = _PACKED.get(w13.data_ptr())
    if packed is None or x.dtype != w13.dtype:
        return moe_experts_torch(x, w13, w2, topk_weights, topk_ids, first_expert)
    return torch.ops.toolkit.experts_cpu.default(
        x.contiguous(), topk_weights.float().contiguous(), topk_ids.contiguous(), first_expert, packed.w13_panels,
        packed.w2_panels, packed.w13_onednn, packed.w2_onednn, packed.small_m)
