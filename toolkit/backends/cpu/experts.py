"""The CPU implementation of the experts op: one C++ call per layer (`toolkit::experts_cpu`,
csrc/experts.cpp) over the experts' weights in the layouts the linears' plan chose (linear.py).

A decode step gives each expert a few rows, so its matmuls are short streams over its weights; from
Python each expert cost a dozen op calls per layer (slicing, two linears, the activation, copies) on top
of the grouping, more than the streams themselves. In the one call the experts with at most `small_m`
rows run the panel kernel together, and an expert with more rows (a prefill's) runs oneDNN's native
units, whose weight is packed once here (`F.linear` on a plain bf16 weight has oneDNN reorder it on
every call).

Where the linears' plan keeps both layouts, the row count up to which an expert runs the panels is
measured apart, on the experts' own shapes (`choose_small_m`, cached beside the linears' choice): the
experts' panel loop splits every expert's panels between the threads, and a prefill's hundreds of rows
an expert ran there at half oneDNN's rate where the dense linears' crossover lay at 512 rows
(docs/benchmarks.md). Only the layouts that crossover uses are kept.

Each layer's layouts live in a `PackedExperts`, which becomes the layer's dispatcher where no
parallelism set one and no other CPU implementation was registered: the step calls the kernel straight. Expert and tensor parallelism's dispatchers
call `toolkit::moe_experts` with the stacked `Experts.w13` / `w2` (toolkit/moe/ops.py's contract,
which the reference shares), so its CPU implementation here finds the layouts by the data pointer of
`w13`; an entry lives as long as that parameter does. Experts never packed run the reference.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn

from toolkit.backends.cpu import choices, kernels
from toolkit.backends.cpu.choices import best_of_each
from toolkit.backends.cpu.linear import CANDIDATE_M, MARGIN, NEVER, ONEDNN_BATCH_HINT, LinearPlan, pack
from toolkit.moe.ops import impl_for, moe_experts_torch, register_impl

log = logging.getLogger("toolkit")


class PackedExperts(nn.Module):
    """One layer's local experts in the linear kernel's layouts (stacked panels and/or one oneDNN weight
    per expert) and the largest row count an expert runs on the panels.

    Set as the layer's `Experts.dispatcher` where no parallelism set one, so that the step calls
    `toolkit::experts_cpu` straight from the compiled graph, counting the tokens in the same call: around
    `toolkit::moe_experts`, a Python op, each layer paid the op's Python and the counting's small ops
    (about as much as a batch-1 decode's expert stream). Under expert or tensor parallelism their
    dispatchers call `toolkit::moe_experts`, whose CPU implementation finds these layouts by w13's data
    pointer (`moe_experts_cpu`)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, small_m: int):
        super().__init__()
        panels, onednn = small_m > 0, small_m < NEVER
        self.register_buffer("w13_panels", pack(w13) if panels else None, persistent=False)
        self.register_buffer("w2_panels", pack(w2) if panels else None, persistent=False)
        self.onednn_experts = w13.shape[0] if onednn else 0
        for e in range(self.onednn_experts):  # buffers, so the compiled graph takes them as inputs
            self.register_buffer(f"w13_onednn_{e}", _onednn(w13[e]), persistent=False)
            self.register_buffer(f"w2_onednn_{e}", _onednn(w2[e]), persistent=False)
        self.small_m = small_m

    def onednn(self, matmul: str) -> list[torch.Tensor]:
        """The oneDNN weight of every expert for `matmul` ("w13" or "w2"), or none. A method, not a
        property: Dynamo guards a property's getter through the class, a guard the saved step cannot
        hold (toolkit/compiled_cache.py)."""
        return [getattr(self, f"{matmul}_onednn_{e}") for e in range(self.onednn_experts)]

    def forward(self, experts: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        return self.run(x, topk_weights, topk_ids, experts.first_expert, experts.tokens_per_expert)

    def run(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, first_expert: int,
            tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.toolkit.experts_cpu.default(
            x.contiguous(), topk_weights.float().contiguous(), topk_ids.contiguous(), first_expert, self.w13_panels,
            self.w2_panels, self.onednn("w13"), self.onednn("w2"), self.small_m, tokens_per_expert)

    def extra_repr(self) -> str:
        return f"small_m={self.small_m}, panels={self.w13_panels is not None}, onednn={self.onednn_experts > 0}"


_PACKED: dict[int, PackedExperts] = {}  # Experts.w13.data_ptr() -> its packed layouts


def _onednn(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ONEDNN_BATCH_HINT)


def choose_small_m(plan: LinearPlan, dtype: torch.dtype, hidden: int, intermediate: int) -> tuple[int, str]:
    """(the largest row count an expert runs through the panels, where that came from): the plan's one
    layout where it keeps one, else measured on the experts' shapes (or read back from the last time)."""
    if not plan.panels:
        return 0, plan.source
    if not plan.onednn:
        return NEVER, plan.source
    library = kernels.library("experts")
    choice_key = choices.key(dtype, hidden, intermediate, library.name if library else "", CANDIDATE_M, MARGIN)
    choice, read_back = choices.cached("experts-choices", choice_key,
                                       lambda: {"small_m": _measure_small_m(dtype, hidden, intermediate)})
    return choice["small_m"], "cached" if read_back else "measured"


def _measure_small_m(dtype: torch.dtype, hidden: int, intermediate: int) -> int:
    """As the linears' crossover (linear.py), over two experts that every one of M tokens is routed to:
    the largest M (rows an expert) at which the panels are not beaten by oneDNN twice in a row."""
    generator = torch.Generator().manual_seed(0)
    w13 = (torch.randn(2, 2 * intermediate, hidden, generator=generator) * 0.02).to(dtype)
    w2 = (torch.randn(2, hidden, intermediate, generator=generator) * 0.02).to(dtype)
    layouts = (pack(w13), pack(w2), [_onednn(w) for w in w13], [_onednn(w) for w in w2])
    op = torch.ops.toolkit.experts_cpu.default

    def timings(m: int) -> tuple[float, float]:
        x = torch.randn(m, hidden, generator=generator).to(dtype)
        ids = torch.tensor([[0, 1]]).expand(m, 2).contiguous()
        weights = torch.full((m, 2), 0.5)
        return best_of_each(lambda use_panels: op(x, weights, ids, 0, *layouts, NEVER if use_panels else 0))

    with torch.inference_mode():
        return choices.crossover(CANDIDATE_M, timings, MARGIN, "experts", NEVER)


def describe(small_m: int) -> str:
    if small_m == NEVER:
        return "the panel kernel for every row count"
    if small_m == 0:
        return "oneDNN for every row count"
    return f"the panel kernel up to {small_m} rows an expert, oneDNN above"


def pack_experts(model: nn.Module, plan: LinearPlan, small_m: int | None = None) -> tuple[int, int]:
    """Pack every `Experts` module's weights for the experts with at most `small_m` rows on the panels
    and the rest on oneDNN (None: `choose_small_m`, under `plan`), keeping those layouts only; serve each
    layer with them (`PackedExperts`) and the experts op on CPU too; returns (how many layers were
    packed, small_m)."""
    from toolkit.models.moe import Experts

    layers = [m for m in model.modules() if isinstance(m, Experts)]
    if not layers:
        return 0, 0
    if small_m is None:
        _, hidden, intermediate = layers[0].w2.shape
        small_m, source = choose_small_m(plan, layers[0].w13.dtype, hidden, intermediate)
        log.info("CPU experts: %s (%s)", describe(small_m), source)
    register_impl("cpu", moe_experts_cpu, replace=False)
    # An implementation the user registered for CPU (toolkit.moe.register_impl) wins: the layers then
    # keep calling the op, which runs it.
    direct = impl_for(torch.device("cpu")) is moe_experts_cpu
    for experts in layers:
        packed = PackedExperts(experts.w13.detach(), experts.w2.detach(), small_m)
        key = experts.w13.data_ptr()
        _PACKED[key] = packed
        weakref.finalize(experts.w13, _PACKED.pop, key, None)
        if direct and (experts.dispatcher is None or isinstance(experts.dispatcher, PackedExperts)):
            experts.dispatcher = packed
    return len(layers), small_m


def moe_experts_cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    packed = _PACKED.get(w13.data_ptr())
    if packed is None or x.dtype != w13.dtype:
        return moe_experts_torch(x, w13, w2, topk_weights, topk_ids, first_expert)
    return packed.run(x, topk_weights, topk_ids, first_expert)
