"""The CPU implementation of the experts op: each expert's matmuls through `toolkit::linear_cpu`, with
the layouts the linears' plan chose (linear.py), instead of `F.linear` on the plain stacked weights.

`F.linear` on a plain bf16 weight lets oneDNN reorder that weight on every call: per expert, per
layer, per step. Packed once here (oneDNN's reordered weight, and the panels where the plan gives the
panel kernel small row counts), an expert's rows cost what a packed linear's do.

The op is called with the stacked `Experts.w13` / `w2` (toolkit/moe/ops.py's contract, which the
reference and expert parallelism share), so the packed layouts are found by the data pointer of
`w13`; an entry lives as long as that parameter does. Experts never packed run the reference.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.backends.cpu.linear import NEVER, ONEDNN_BATCH_HINT, LinearPlan, pack
from toolkit.moe.ops import grouped_experts, moe_experts_torch, register_impl


@dataclass
class _Packed:
    """One layer's local experts in the linear kernel's layouts: per expert, (panels, oneDNN weight)."""

    w13: list[tuple[torch.Tensor | None, torch.Tensor | None]]
    w2: list[tuple[torch.Tensor | None, torch.Tensor | None]]
    intermediate: int
    hidden: int
    small_m: int

    def mlp(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = _linear(rows, self.w13[e], 2 * self.intermediate, self.small_m).chunk(2, dim=-1)
        return _linear((F.silu(gate) * up).contiguous(), self.w2[e], self.hidden, self.small_m)


_PACKED: dict[int, _Packed] = {}  # Experts.w13.data_ptr() -> its packed layouts


def _linear(x: torch.Tensor, weights, out_features: int, small_m: int) -> torch.Tensor:
    panels, onednn = weights
    return torch.ops.toolkit.linear_cpu.default(x, panels, onednn, None, out_features, small_m)


def _layouts(weight: torch.Tensor, plan: LinearPlan) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    panels = pack(weight) if plan.panels else None
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ONEDNN_BATCH_HINT) if plan.onednn else None
    return panels, onednn


def pack_experts(model: nn.Module, plan: LinearPlan) -> int:
    """Pack every `Experts` module's weights under `plan` and serve the experts op on CPU with them;
    returns how many layers were packed."""
    from toolkit.models.moe import Experts

    count = 0
    for experts in (m for m in model.modules() if isinstance(m, Experts)):
        w13, w2 = experts.w13.detach(), experts.w2.detach()
        key = w13.data_ptr()
        _PACKED[key] = _Packed([_layouts(w, plan) for w in w13], [_layouts(w, plan) for w in w2],
                               intermediate=w2.shape[2], hidden=w2.shape[1],
                               small_m=plan.small_m if plan.onednn else NEVER)
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
    return grouped_experts(x, topk_weights, topk_ids, first_expert, w13.shape[0], packed.mlp)
