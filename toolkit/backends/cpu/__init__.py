"""The CPU backend: C++ kernels as torch ops, the linears' layouts chosen by the machine, and a
compiled step with no Python between its kernels.

- Kernels (`kernels.py`, `csrc/`): the linear and paged attention (and the experts' for an MoE model),
  built at engine start (at once, cached) and registered in torch's dispatcher through its stable C ABI. Where one cannot be
  built, a warning names its source and torch's own ops serve instead.
- Attention: the kernel serves every step kind (prefill chunks, decodes, mixed) and is registered
  with `attention` as the "cpu" backend, the default wherever it is built and the shapes fit. Long
  prefill chunks go to ATen's flash attention from the chunk length measured at start to pay
  (`attention_plan.py`).
- Linears (`linear.py`): each nn.Linear becomes a `CPULinear` whose weights are laid out for the
  implementations its row counts use: the panel kernel for small M, oneDNN's native bf16 above, as
  measured at start on the model's own shapes. Tensor-parallel ranks keep their DTensor weights.
- Compile options: Inductor's C++ wrapper (`cpp_wrapper`), so a compiled step is one C++ function
  that calls Inductor's fused loops and the kernels' ops through the dispatcher.
"""

from __future__ import annotations

import logging

import torch

from toolkit import attention
from toolkit.backends import Backend
from toolkit.backends.cpu import attention_plan, kernels, vec_isa_probes
from toolkit.backends.cpu.experts import describe as describe_experts
from toolkit.backends.cpu.experts import pack_experts
from toolkit.backends.cpu.huge_pages import empty_on_huge_pages
from toolkit.backends.cpu.linear import (LinearPlan, layer_shapes, onednn_native, pack_int8_linears, pack_linears,
                                         plan_for)

log = logging.getLogger("toolkit")


class CPUBackend(Backend):
    name = "cpu"

    def __init__(self, config, model_config):
        super().__init__(config, model_config)
        # The experts' kernel only for a model with experts: a dense model's cold start does not build it.
        self._kernels = kernels.EVERY_MODEL + (("experts",) if model_config.moe is not None else ())
        if config.cpu_kernels:
            kernels.start_build(self._kernels)  # overlaps the weights' loading; waited for by the first question below
        self._unavailable: dict[str, str] | None = None if config.cpu_kernels else {
            name: "cpu_kernels=False" for name in kernels.SOURCES}
        self._attention: str | None = None
        self.linear_plan: LinearPlan | None = None
        self.prefill_attention: str | None = None  # what attention_plan chose, for stats
        self.packed_linears = 0
        if config.attention_backend == "cpu" and not self._attention_fits():  # before any weight is read
            raise ValueError(f"the CPU attention kernel needs head_dim ({model_config.head_dim}) and block_size "
                             f"({config.block_size}) to be multiples of 8; use attention_backend='torch'")

    def _attention_fits(self) -> bool:
        # The kernel reads whole 8-float vectors of head_dim and 8-row tiles of a block.
        return self.model_config.head_dim % 8 == 0 and self.config.block_size % 8 == 0

    @property
    def unavailable(self) -> dict[str, str]:
        """{kernel: why this engine does not use it}; waits for the build the first time."""
        if self._unavailable is None:
            self._unavailable = kernels.load(self._kernels)
            if self.has_kernel("attention"):
                register_attention()
            dtype = self.config.dtype
            if dtype != torch.float32 and not self.has_kernel("linear") and not onednn_native(dtype):
                log.warning("%s on a CPU without native %s units and without the CPU linear kernel: matmuls run "
                            "emulated, several times slower than float32", dtype, dtype)
        return self._unavailable

    def has_kernel(self, name: str) -> bool:
        """Whether this engine uses the C++ kernel `name` (built, and not switched off by its config)."""
        return name not in self.unavailable and kernels.available(name)

    def attention_backend(self) -> str:
        if self._attention is None:
            self._attention = self._choose_attention()
        return self._attention

    def _choose_attention(self) -> str:
        chosen = self.config.attention_backend
        if chosen == "cpu" and not self.has_kernel("attention"):
            raise ValueError("attention_backend='cpu' needs the CPU attention kernel, which is unavailable: "
                             f"{self.unavailable.get('attention')}")
        if chosen is not None:
            return chosen
        return "cpu" if self._attention_fits() and self.has_kernel("attention") else "torch"

    def prepare_model(self, model, tp) -> list[str]:
        changes = []
        if self.attention_backend() == "cpu":
            changes.append(self._plan_prefill_attention(tp))
        if tp is not None:
            return changes  # DTensor weights: the TP plan's matmuls and collectives stay torch's
        if not self.has_kernel("linear") or self.config.cpu_linear == "torch":
            return changes
        int8 = pack_int8_linears(model, self.config.dtype)
        if int8:
            changes.append(f"{int8} int8 linears packed for the panel kernel")
        shapes = layer_shapes(model)
        if not shapes:  # every linear is an int8 one
            return changes
        self.linear_plan = plan_for(self.config.cpu_linear, self.config.dtype, shapes)
        if self.linear_plan is None:
            return changes
        plan = self.linear_plan
        weight_bytes = sum(m.weight.nbytes for m in model.modules() if isinstance(m, torch.nn.Linear))
        self.packed_linears = pack_linears(model, plan)
        both = f"; both layouts kept: {weight_bytes / 2**20:.0f} MiB more memory" if plan.panels and plan.onednn else ""
        log.info("CPU linears: %s (%s)%s", plan.describe(), plan.source, both)
        changes.append(f"{self.packed_linears} linears packed: {plan.describe()}{both}")
        experts, small_m = pack_experts(model, plan) if self.has_kernel("experts") else (0, 0)
        if experts:
            changes.append(f"the experts of {experts} MoE layers packed: {describe_experts(small_m)}")
        return changes

    def _plan_prefill_attention(self, tp) -> str:
        mc = self.model_config
        heads = mc.num_heads // tp.size if tp is not None else mc.num_heads
        kv_heads = tp.num_kv_heads_local if tp is not None else mc.num_kv_heads
        chosen = attention_plan.choose(self.config.cpu_prefill_attention, self.config.dtype, heads, kv_heads,
                                       mc.head_dim, self.config.block_size)
        self.prefill_attention = chosen
        return chosen

    def empty_kv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # A decode step reads each sequence's blocks, a few KiB apart in a cache of gigabytes: with 4 KiB
        # pages nearly every block read is a TLB miss (docs/benchmarks.md).
        return empty_on_huge_pages(shape, dtype)

    def compile_options(self) -> dict:
        options = super().compile_options()
        # Not under tensor parallelism: Inductor's C++ wrapper cannot call DTensor's collectives yet
        # ("arg type Any is not yet supported by custom_op_wrapper"), so those ranks keep its Python one.
        if self.config.compile_backend == "inductor" and self.config.cpp_wrapper and self.config.tensor_parallel_size == 1:
            options["cpp_wrapper"] = True
            # Compiled apart from the kernels, the wrapper builds at -O1: it only sequences calls.
            options["cpp_wrapper_build_separate"] = True
        if self.config.compile_backend == "inductor":
            # Inductor's ISA checks compile and load a test program per ISA, several seconds at every
            # start; /proc/cpuinfo, which it reads first, already says what this CPU runs. The checks
            # that ignore this (AVX-512 BF16, AMX) are remembered between starts instead.
            options["cpp.vec_isa_ok"] = True
            vec_isa_probes.remember()
        return options

    def stats(self) -> dict:
        plan = self.linear_plan
        return {**super().stats(), "kernels_unavailable": dict(self.unavailable), "packed_linears": self.packed_linears,
                "prefill_attention": self.prefill_attention,
                "linear": None if plan is None else {"layouts": [n for n, on in (("panels", plan.panels),
                                                                                  ("onednn", plan.onednn)) if on],
                                                     "small_m": plan.small_m, "float32_small_m": plan.float32_small_m,
                                                     "source": plan.source}}


def register_attention() -> None:
    """The one registration of the CPU attention kernels in `attention`'s dispatch, as backend "cpu"."""
    attention.register_backend("cpu", _paged_attention, torch.ops.toolkit.write_kv_cpu.default)


def _paged_attention(q, kv_cache, meta, scale):
    return torch.ops.toolkit.paged_attention_cpu.default(q, kv_cache, meta.query_start_loc, meta.seq_lens,
                                                         meta.block_tables, scale,
                                                         attention_plan.flash_min_for(q, kv_cache))
