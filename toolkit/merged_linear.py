"""Sibling linears that read the same input (q/k/v, gate/up), merged into one matmul after loading.

The model keeps the checkpoint's layout, one Linear per projection, so weights load by name and a
tensor-parallel plan shards each by heads. It marks which projections read the same input with
`project(x, *linears)` and lists them in `merge_groups`. Where no plan applies, `merge_linears`
concatenates each group's weights into one `MergedLinear`, applied from outside like a plan: a
decode step then makes 4 matmul calls per layer instead of 7, and the small k and v weights stop
paying a call and a thread fork-join each.

Each output column is still the same dot product over the same weights, so float32 results do not
change (the CPU panel kernel computes every 16-column panel alike; tests/test_merged_linear.py).
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """One Linear over several, its output split back into theirs by `splits` (their out_features)."""

    def __init__(self, linears: list[nn.Linear]):
        first = linears[0]
        if any(lin.in_features != first.in_features for lin in linears):
            raise ValueError("merged linears must read the same input size")
        with_bias = any(lin.bias is not None for lin in linears)
        weight = first.weight
        super().__init__(first.in_features, sum(lin.out_features for lin in linears), bias=with_bias,
                         device="meta", dtype=weight.dtype)
        self.splits = tuple(lin.out_features for lin in linears)
        self.weight = nn.Parameter(torch.cat([lin.weight.detach() for lin in linears]), requires_grad=False)
        if with_bias:
            biases = [lin.bias.detach() if lin.bias is not None else weight.new_zeros(lin.out_features)
                      for lin in linears]
            self.bias = nn.Parameter(torch.cat(biases), requires_grad=False)


def project(x: torch.Tensor, *linears: nn.Module | None) -> tuple[torch.Tensor, ...]:
    """Each linear applied to x; one matmul where `merge_linears` has merged them into the first."""
    splits = getattr(linears[0], "splits", None)
    if splits is not None:
        return linears[0](x).split(splits, dim=-1)
    return tuple(linear(x) for linear in linears)


def merge_linears(model: nn.Module) -> int:
    """Merge every group a module names in its `merge_groups` (tuples of child names); returns how
    many groups were merged. The first name holds the MergedLinear, the others become None, so no
    weight is held twice."""
    merged = 0
    for module in list(model.modules()):
        for names in getattr(module, "merge_groups", ()):
            linears = [getattr(module, name) for name in names]
            if not all(type(lin) is nn.Linear for lin in linears):
                continue  # already merged, or replaced by a plan: leave it alone
            setattr(module, names[0], MergedLinear(linears))
            for name in names[1:]:
                setattr(module, name, None)
            merged += 1
    return merged
