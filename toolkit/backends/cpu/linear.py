"""The CPU linear: which implementation serves which row counts, chosen by the machine, and the module
that holds the weights for it.

Two implementations stand behind the one op `toolkit::linear_cpu` (csrc/linear.cpp): the panel
kernel, a stream over W at memory speed that wins for decode-sized M, and oneDNN, which uses native
bf16 units (AVX-512 BF16, AMX) and wins once M makes the matmul compute-bound. Where each wins depends
on the CPU, the dtype and the shapes, so `choose` measures it at engine start on one decoder layer's
own shapes: `small_m` is the largest row count the panel kernel serves, the op sends larger ones to
oneDNN. The choice is cached per CPU, torch version, threads, dtype and shapes
(`$TOOLKIT_CACHE/kernels/linear-choices.json`) and logged once. Where oneDNN has no native units for
the dtype (bf16 on an AVX2-only CPU, fp16 without AVX-512 FP16/AMX), it is never measured: the panel
kernel serves every M and no oneDNN weight is kept.

A layer keeps the weight in each layout its choice uses: both where the panel kernel serves small M
and oneDNN the rest (the engine logs the memory that costs), one otherwise.

Weight-only int8 linears (toolkit/quantization.py) keep only int8 panels (`CPUInt8Linear`): the panel
kernel up to INT8_SMALL_M rows, where it streams half of bf16's bytes (a quarter of float32's); above,
where the matmul is compute-bound, the op widens the weight to x's dtype for oneDNN, where oneDNN has
native units for it (otherwise the panel kernel serves every M).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from toolkit.backends.cpu import choices, kernels
from toolkit.backends.cpu.choices import best_of_each
from toolkit.backends.cpu.huge_pages import empty_on_huge_pages

log = logging.getLogger("toolkit")

PANEL = 16  # output columns per panel
NEVER = 1 << 62  # small_m that sends every row count to the panel kernel
ONEDNN_BATCH_HINT = 64  # the row count oneDNN lays its packed weight out for
# Up to a prefill chunk's size (max_num_batched_tokens' default): on AMX the panel kernel's tiles keep up
# with oneDNN past 64 rows, so the crossover can lie far out; measured only up to 512, SmolLM2's shapes
# read as "never" once and its 2,048-row chunks went to the panels, at 1.5x oneDNN's time.
CANDIDATE_M = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256, 512, 1024, 2048)
MARGIN = 0.95  # oneDNN must be 5% faster to take a row count: ties go to the one-copy layout
# Int8 panels up to this many rows: the panel kernel widens each weight in registers and computes at the
# float32 FMA rate; widening the whole weight for oneDNN each call pays back between 32 and 64 rows, in
# float32 and bf16 alike (docs/benchmarks.md, weight-only int8).
INT8_SMALL_M = 48


@dataclass(frozen=True)
class LinearPlan:
    """What every linear of a model uses: small_m as in the op; panels and/or a oneDNN weight.
    `float32_small_m` is small_m for float32 x over half weights (the float32 logits), where it was
    measured apart: the panel kernel runs half x on the bf16 units (AMX's tiles, AVX-512 BF16's dot
    products) and float32 x on FMAs, until x is rounded for them (linear.cpp, float32_io_paired)."""

    panels: bool
    onednn: bool
    small_m: int
    source: str  # "measured", "cached", "rule: ..." or "config"
    float32_small_m: int | None = None  # None: small_m

    def describe(self) -> str:
        logits = "" if self.float32_small_m in (None, self.small_m) else \
            f" (float32 x: up to {self.float32_small_m})"
        if not self.onednn:
            return f"the panel kernel for every row count{logits}"
        if not self.panels:
            return "oneDNN for every row count"
        return f"the panel kernel for up to {self.small_m} rows{logits}, oneDNN above"


def onednn_native(dtype: torch.dtype) -> bool:
    """Whether oneDNN computes `dtype` with native units here (never emulated)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def plan_for(choice: str, dtype: torch.dtype, shapes: list[tuple[int, int]]) -> LinearPlan | None:
    """The plan for `choice` ("auto", "panel", "onednn" or "torch"), the kernel being loaded; None
    means plain nn.Linear."""
    if choice == "torch" or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if choice == "panel":
        return LinearPlan(True, False, NEVER, "config")
    if choice == "onednn":
        if not onednn_native(dtype):
            raise ValueError(f"cpu_linear='onednn': oneDNN has no native {dtype} units on this CPU (it would emulate them)")
        return LinearPlan(False, True, 0, "config")
    if not onednn_native(dtype):
        return LinearPlan(True, False, NEVER, f"rule: oneDNN would emulate {str(dtype).removeprefix('torch.')} here")
    return choose(dtype, shapes)


def choose(dtype: torch.dtype, shapes: list[tuple[int, int]]) -> LinearPlan:
    """Measure the panel kernel against oneDNN on `shapes` ([(N, K)] of one decoder layer), or read the
    cached result of that measurement (choices.py)."""
    library = kernels.library("linear")
    choice_key = choices.key(dtype, json.dumps(sorted(shapes)), library.name if library else "", CANDIDATE_M, MARGIN,
                             " ".join(LinearPlan.__dataclass_fields__))

    def measure() -> dict:
        start = time.perf_counter()
        small_m = _measure_small_m(dtype, shapes)
        # Float32 x over half panels takes the FMA path up to its crossover, the bf16 units above it (x
        # rounded, the near-top entries recomputed): AMX's tiles, AVX-512 BF16's dot products (which need
        # no oneDNN weight, hence measured for "never" too) or oneDNN.
        float32_small_m = _measure_small_m(dtype, shapes, torch.float32) \
            if dtype != torch.float32 and 0 < small_m and (small_m < NEVER or dtype == torch.bfloat16) else None
        log.info("measured the CPU linear kernels on the model's shapes in %.1f s", time.perf_counter() - start)
        return {"panels": small_m > 0, "onednn": small_m < NEVER, "small_m": small_m,
                "float32_small_m": None if float32_small_m == small_m else float32_small_m}

    choice, read_back = choices.cached("linear-choices", choice_key, measure)
    return LinearPlan(**choice, source="cached" if read_back else "measured")


def _measure_small_m(dtype: torch.dtype, shapes: list[tuple[int, int]], x_dtype: torch.dtype | None = None) -> int:
    """The largest candidate M up to which the panel kernel is not beaten by oneDNN (by MARGIN) at two
    candidates in a row (a shared host's noise can hand one reading to either side), x in x_dtype
    (default: the weights'); 0 when oneDNN wins from one row on, NEVER when it never does so."""
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=generator) * 0.02).to(dtype) for n, k in shapes]
    panels = [pack(w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_BATCH_HINT) for w in weights]
    op = torch.ops.toolkit.linear_cpu.default

    def timings(m: int) -> tuple[float, float]:
        xs = [torch.randn(m, k, generator=generator).to(x_dtype or dtype) for _, k in shapes]

        def run(use_panels):
            for x, p, o, (n, _) in zip(xs, panels, onednn, shapes):
                op(x, p, o, None, n, NEVER if use_panels else 0)

        return best_of_each(run)

    with torch.inference_mode():
        return choices.crossover(CANDIDATE_M, timings, MARGIN, "linear", NEVER)


# --- the module ----------------------------------------------------------------------------------


def panels_shape(weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    *stack, n, k = weight_shape
    return (*stack, -(-n // PANEL), k, PANEL)


def pack(weight: torch.Tensor, arena: HugePageArena | None = None) -> torch.Tensor:
    """W [N, K] (float32, bfloat16, float16 or int8, CPU) -> panels [ceil(N / 16), K, 16] of the same dtype; a
    stack of them [..., N, K] -> [..., ceil(N / 16), K, 16] (an MoE layer's experts). In `arena` where
    given (pack_linears: one model's linears side by side on huge pages)."""
    *stack, n, k = weight.shape
    shape = panels_shape(weight.shape)
    panels = arena.take(shape, weight.dtype) if arena is not None else empty_on_huge_pages(shape, weight.dtype)
    for w, p in zip(weight.reshape(-1, n, k), panels.view(-1, -(-n // PANEL), k, PANEL)):
        torch.ops.toolkit.pack_panels(w.contiguous(), p)
    return panels


class CPULinear(nn.Module):
    """y = x W^T + b through `toolkit::linear_cpu`, W held as panels and/or a oneDNN weight."""

    def __init__(self, linear: nn.Linear, plan: LinearPlan, arena: HugePageArena | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # Float32 in and out over half weights (toolkit/models/logits.py: the lm_head, an MoE router): the
        # panel kernel computes float32 x with half panels exactly; above small_m oneDNN's rounded output
        # has each row's largest entries recomputed from the panels, so the panels are always kept.
        self.float32_io = getattr(linear, "float32_logits", False) and weight.dtype != torch.float32
        if self.float32_io:
            small_m = plan.small_m if plan.float32_small_m is None else plan.float32_small_m
            plan = LinearPlan(True, plan.onednn, small_m if plan.panels else 0, plan.source)
        self.small_m = plan.small_m
        self.register_buffer("panels", pack(weight, arena) if plan.panels else None, persistent=False)
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_BATCH_HINT) if plan.onednn else None
        self.register_buffer("onednn_weight", onednn, persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        if hasattr(linear, "splits"):
            self.splits = linear.splits  # a MergedLinear's parts (toolkit/merged_linear.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float32_io:
            x = x.float()
        return torch.ops.toolkit.linear_cpu.default(x, self.panels, self.onednn_weight, self.bias, self.out_features,
                                                    self.small_m)

    def extra_repr(self) -> str:
        layouts = "+".join(name for name, t in (("panels", self.panels), ("onednn", self.onednn_weight)) if t is not None)
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"weights={layouts}, small_m={self.small_m}"


def pack_linears(model: nn.Module, plan: LinearPlan) -> int:
    """Replace every nn.Linear in `model` by a CPULinear under `plan`; returns how many.

    A Linear whose weight is shared with another module (a tied lm_head) is packed as a copy; the
    embedding keeps the original. Untied weights are released, so resident memory holds only the
    layouts the plan uses.
    """
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear)]
    arena = HugePageArena([(panels_shape(c.weight.shape), c.weight.dtype) for _, _, c in swaps]) if plan.panels else None
    for parent, name, child in swaps:
        setattr(parent, name, CPULinear(child, plan, arena))
    return len(swaps)


class CPUInt8Linear(nn.Module):
    """An Int8Linear (toolkit/quantization.py) through `toolkit::linear_int8_cpu`: int8 panels, float32
    scales and bias."""

    def __init__(self, linear: nn.Module, small_m: int, arena: HugePageArena | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.float32_logits = linear.float32_logits
        self.small_m = small_m
        self.register_buffer("panels", pack(linear.qweight, arena), persistent=False)
        self.register_buffer("scales", linear.scales.contiguous(), persistent=False)
        self.register_buffer("bias", linear.bias, persistent=False)
        if hasattr(linear, "splits"):
            self.splits = linear.splits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float32_logits:
            x = x.float()
        return torch.ops.toolkit.linear_int8_cpu.default(x, self.panels, self.scales, self.bias, self.out_features,
                                                         self.small_m)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"int8 panels, small_m={self.small_m}"


def pack_int8_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace every Int8Linear in `model` by a CPUInt8Linear; returns how many."""
    from toolkit.quantization import Int8Linear

    small_m = INT8_SMALL_M if onednn_native(dtype) else NEVER
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, Int8Linear)]
    arena = HugePageArena([(panels_shape(c.qweight.shape), torch.int8) for _, _, c in swaps])
    for parent, name, child in swaps:
        setattr(parent, name, CPUInt8Linear(child, small_m, arena))
    return len(swaps)


def layer_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """(N, K) of the first decoder layer's linears, and of its experts' matmuls (they run the same
    kernels, experts.py): the shapes the choice is measured on."""
    from toolkit.models.moe import Experts

    layer = next(iter(model.model.layers.values()))
    shapes = {(m.out_features, m.in_features) for m in layer.modules() if isinstance(m, nn.Linear)}
    for experts in (m for m in layer.modules() if isinstance(m, Experts)):
        shapes |= {tuple(experts.w13.shape[1:]), tuple(experts.w2.shape[1:])}
    return sorted(shapes)


class HugePageArena:
    """Room for the given tensors side by side, in one allocation advised for transparent huge pages.

    A decoder layer's weights are mostly under 2 MiB each (SmolLM2's q/k/v, o, down), too small for
    huge pages of their own, so a decode step took a TLB miss every 4 KiB of them; laid out together
    they fill whole huge pages (docs/benchmarks.md has the decode rates). Views are handed out in the
    order asked for, each on a cache line; a request past the room (none, when the sizes given are the
    ones taken) gets a tensor of its own."""

    ALIGN = 64

    def __init__(self, tensors: list[tuple[tuple[int, ...], torch.dtype]]):
        self.size = sum(self._room(shape, dtype) for shape, dtype in tensors)
        self.offset = 0
        self.buffer = empty_on_huge_pages((self.size,), torch.uint8) if self.size else None

    def _room(self, shape, dtype) -> int:
        return -(-math.prod(shape) * dtype.itemsize // self.ALIGN) * self.ALIGN

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        room = self._room(shape, dtype)
        if self.buffer is None or self.offset + room > self.size:
            return empty_on_huge_pages(shape, dtype)
        view = self.buffer[self.offset:self.offset + math.prod(shape) * dtype.itemsize]
        self.offset += room
        return view.view(dtype).view(shape)



