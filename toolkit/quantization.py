"""Weight-only int8 (`EngineConfig.quantization="int8"`): every linear's weight quantized at load, from
any checkpoint, to int8 with one float32 scale per output channel (symmetric: q = round(w / s),
s = max|w_row| / 127), activations and everything else left in the model's dtype.

Why: a decode step streams every weight once, so batch-1 decode is bound by the weights' bytes; int8
is half of bf16's and a quarter of float32's. The error is bounded by the scales: |w - q s| <= s / 2
per weight. MoE routers (the other Float32Logits) stay in the model's dtype: a router's scores pick
experts, and the experts' own weights are not linears here (they stay unquantized too).

`Int8Linear` is the portable module (the weight widened to x's dtype at each call: correct anywhere,
slow); the CPU backend replaces it with the panel kernel's int8 layout (toolkit/backends/cpu/linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("int8",)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q int8 [N, K], scales float32 [N]) with W ~ q * scales[:, None]; an all-zero row
    gets scale 1 (its q is 0)."""
    w = weight.detach().float()
    top = w.abs().amax(dim=1)
    scales = torch.where(top > 0, top / 127, torch.ones_like(top))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


class Int8Linear(nn.Module):
    """y = x (q s)^T + b, from a Linear: its weight quantized (quantize_int8), its bias kept in float32.
    A Float32Logits lm_head keeps float32 inputs and outputs (toolkit/models/logits.py)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scales = quantize_int8(linear.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self.dtype = linear.weight.dtype  # the activations'
        self.float32_logits = getattr(linear, "float32_logits", False)
        if hasattr(linear, "splits"):
            self.splits = linear.splits  # a MergedLinear's parts (toolkit/merged_linear.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if self.float32_logits else x.dtype
        weight = (self.qweight.to(torch.float32) * self.scales[:, None]).to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x.to(dtype), weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def quantize_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` but the MoE routers by an Int8Linear; returns how many. A tied
    lm_head gets its own int8 copy (the embedding keeps the original)."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear) and not _is_router(name, child)]
    for parent, name, child in swaps:
        setattr(parent, name, Int8Linear(child))
    return len(swaps)


def _is_router(name: str, linear: nn.Linear) -> bool:
    return getattr(linear, "float32_logits", False) and name != "lm_head"
