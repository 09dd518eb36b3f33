"""The parallel degrees of a job as one validated object (torchtitan's ParallelDims).

`ParallelDims(dp, pp, tp, expert_parallel)` says how the world is laid out: tp innermost (a TP group
is consecutive ranks, one node's devices), then the pipeline stages of a replica, then the replicas,
so global rank = (dp_rank * pp + pp_rank) * tp + tp_rank. Expert parallelism has no dimension of its
own: its group is every rank of one pipeline stage in every replica (dp x tp ranks; the world when
pp = 1), as vLLM's. `validate` checks everything a layout can get wrong against the launch and the
model before any process group is joined or any weight read, so a bad configuration fails on every
rank at once with the same message; `parallel.distributed.build_parallel` then builds every group
from the validated object, once.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

log = logging.getLogger("toolkit")


class ParallelConfigError(ValueError):
    """The parallel sizes do not fit the launch (world size) or the model (head counts)."""


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    expert_parallel: bool = False
    pp_layer_partition: str | None = None  # "4,4,5,3": layers per stage; None: an even split

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def ep(self) -> int:
        """Ranks one MoE layer's experts are split over (1 without expert parallelism)."""
        return self.dp * self.tp if self.expert_parallel else 1

    @property
    def replica_size(self) -> int:
        return self.pp * self.tp

    def rank(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return (dp_rank * self.pp + pp_rank) * self.tp + tp_rank

    def replica_ranks(self, replica: int) -> list[int]:
        """Every rank of one data-parallel replica: its stages' TP groups, in stage order."""
        return list(range(replica * self.replica_size, (replica + 1) * self.replica_size))

    def stage_ranks(self, stage: int) -> list[int]:
        """Every rank holding pipeline stage `stage`, in every replica: expert parallelism's group."""
        return [self.rank(d, stage, t) for d in range(self.dp) for t in range(self.tp)]

    def describe(self) -> str:
        return f"dp {self.dp} x pp {self.pp} x tp {self.tp}"

    def check_world(self, world_size: int) -> None:
        """The degrees are positive integers whose product is the launch's world size."""
        for name, size in (("tensor_parallel_size", self.tp), ("data_parallel_size", self.dp),
                           ("pipeline_parallel_size", self.pp)):
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ParallelConfigError(f"{name} must be an integer >= 1, got {size!r}")
        need = self.world_size
        if need == world_size:
            return
        pp_part = f" x pipeline_parallel_size {self.pp}" if self.pp > 1 else ""
        product = f"tp x dp{' x pp' if self.pp > 1 else ''} = {need} processes"
        hint = (f"launch {product}, or choose sizes whose product is {world_size}"
                if "LOCAL_RANK" in os.environ  # inside torchrun
                else f"start it with torchrun --nproc-per-node {need} (or `toolkit generate --tp/--dp/--pp`, "
                "which does that by itself)")
        raise ParallelConfigError(f"tensor_parallel_size {self.tp} x data_parallel_size {self.dp}{pp_part} = "
                                  f"{need} processes, but this launch has a world size of {world_size}: {hint}")

    def validate(self, model_config, world_size: int) -> tuple[ParallelDims, list[int]]:
        """Check the layout against the launch and the model: the stages' layers, the world, the
        experts over the expert group, the heads over tp. Returns the dims to run (expert parallelism
        dropped, with a warning, for a model without routed experts) and the layers per stage."""
        from toolkit.parallel.expert_parallel import check_expert_parallel, num_experts
        from toolkit.parallel.pipeline import head_layers, layer_partition

        dims = self
        if dims.expert_parallel and num_experts(model_config) is None:
            log.warning("enable_expert_parallel: %s has no routed experts; ignored",
                        getattr(model_config, "path", "the model"))
            dims = replace(dims, expert_parallel=False)
        stage_sizes = layer_partition(model_config.num_layers, dims.pp, dims.pp_layer_partition,
                                      head_layers(model_config) if dims.pp > 1 else 0.0)
        if dims.world_size == 1 and world_size == 1:
            return dims, stage_sizes
        dims.check_world(world_size)
        from toolkit.parallel.tensor_parallel import check_tensor_parallel  # DTensor: imported where it is used

        if dims.expert_parallel:
            check_expert_parallel(model_config, dims.ep)
        check_tensor_parallel(model_config, dims.tp, expert_parallel=dims.expert_parallel)
        return dims, stage_sizes
