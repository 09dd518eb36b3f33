"""Float32Logits: the linears whose outputs are compared and ranked (the lm_head's logits, an MoE
router's), computed from float32 inputs into float32 outputs over the model's (half) weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Float32Logits(nn.Linear):
    """A Linear from float32 inputs to float32 outputs over the model's weights, half ones widened (the
    inputs never rounded to them, the outputs never rounded at all). In bf16 a logit of magnitude 16-32
    rounds to steps of 0.06-0.125, so two near-tied tokens (or experts) would tie exactly and the argmax
    would pick by index; float32 keeps their order, at the cost of one small matmul's output width. A
    device backend may replace this with a kernel that computes the same (on CPU: the panel kernel)."""

    float32_logits = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())
