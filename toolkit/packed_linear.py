"""Prepacked linear layers for CPU, applied to a loaded model from outside (like a parallel plan).

A decode step multiplies a few dozen rows by every weight matrix, and at that shape a plain
`F.linear` spends much of its time re-laying out the weight on every call. oneDNN can keep the
weight in its own blocked layout once and for all; measured on this 2-core AVX2 host (fp32,
[M x 768] x [768 x 2048]): M=16 0.87 -> 0.49 ms, M=64 2.2 -> 1.8 ms, and on a whole 125M decode
step about 1.7x less matmul time. Inductor does the same with `freezing=True`, but freezing
bypasses its compile caches (every start would recompile for minutes), so it is done here.

The packed weight is an opaque oneDNN tensor that Inductor cannot lower as a graph input, so the
matmul is a custom op: compiled graphs call it as an extern kernel, like any other matmul.
The model code is untouched: `pack_linears` swaps each `nn.Linear` for a packed module: the panel
kernel's (toolkit/linear_cpu.py), which measured faster still, where it is built; oneDNN's otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

from toolkit import linear_cpu


# Defined with the low-level torch.library API, not `custom_op`: a decode step called it 85 times and
# custom_op's Python wrapper added ~15 us to each call (~1.3 ms of a 45 ms batch-1 step).
_lib = torch.library.Library("toolkit", "FRAGMENT")
_lib.define("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor")
_linear_pointwise = torch.ops.mkldnn._linear_pointwise.default


def _packed_linear(x, packed_weight, bias):
    return _linear_pointwise(x, packed_weight, bias, "none", [], "")


# The packed weight is a oneDNN (MkldnnCPU) tensor and x a dense one: the call dispatches on either key.
_lib.impl("packed_linear", _packed_linear, "CPU")
_lib.impl("packed_linear", _packed_linear, "MkldnnCPU")


@torch.library.register_fake("toolkit::packed_linear")
def _packed_linear_fake(x, packed_weight, bias):
    return x.new_empty(x.shape[0], packed_weight.shape[0])


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's layout; x is [M, in_features]."""

    def __init__(self, linear: nn.Linear, batch_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.toolkit.packed_linear.default(x, self.packed_weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN on CPU, in a dtype it computes natively here (bf16 only where the CPU has bf16 units)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `pack_linears` has a fast kernel for this device and dtype."""
    return device.type == "cpu" and linear_cpu.available(dtype) or onednn_supported(device, dtype)


def pack_linears(model: nn.Module, batch_hint: int) -> int:
    """Replace every nn.Linear in `model` by a PanelLinear (or, without the panel kernel, a oneDNN
    PackedLinear); returns how many were packed.

    A Linear whose weight is shared with another module (a tied lm_head) is packed as a copy; the
    embedding keeps the original. Untied weights are released, so resident memory stays one copy.
    """
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear)]
    for parent, name, child in swaps:
        panels = linear_cpu.available(child.weight.dtype)
        packed = linear_cpu.PanelLinear(child) if panels else PackedLinear(child, batch_hint)
        if hasattr(child, "splits"):
            packed.splits = child.splits  # a MergedLinear's parts (toolkit/merged_linear.py)
        setattr(parent, name, packed)
    return len(swaps)
