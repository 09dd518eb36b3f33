"""Parallelism: the degrees (`dims.py`: one `ParallelDims`, validated once), process groups and the device mesh, DTensor tensor-parallel plans, data-parallel
request sharding (and the replicas' lockstep under expert parallelism), expert parallelism (the
all-to-all dispatcher of MoE layers), pipeline stages (`pipeline.py`: the layer partition, the
model cut to one stage, the stages' point-to-point links), the prefill/decode layout and KV data
plane (`disaggregated.py`), and a launcher that re-runs a command through torch.distributed.run.

Leaf package: imports torch and torch.distributed only (it reads the model config's head counts
and the model's module names, but never imports toolkit).
"""

from toolkit.parallel.data_parallel import (Lockstep, gather_replicas, my_share, request_cost,
                                            split_by_tokens)
from toolkit.parallel.dims import ParallelDims
from toolkit.parallel.distributed import (
    MESH_DIM_NAMES,
    TIMEOUT_ENV,
    ParallelConfigError,
    ParallelState,
    is_main_process,
    launched_world_size,
    processes_per_device,
    build_parallel,
    setup_parallel,
    shutdown,
)
from toolkit.parallel.launch import launched_by_torchrun, maybe_relaunch, relaunch

# parallel.tensor_parallel (TensorParallel, the DTensor plans) is not imported here: importing
# DTensor's op registry costs seconds, which a single-process run should not pay. Nor is
# parallel.expert_parallel (ExpertParallel, the toolkit::ep_moe op): only setup_parallel needs it.

__all__ = [
    "MESH_DIM_NAMES", "TIMEOUT_ENV", "Lockstep", "ParallelConfigError", "ParallelDims", "ParallelState",
    "build_parallel", "gather_replicas",
    "is_main_process", "launched_by_torchrun", "launched_world_size", "maybe_relaunch", "my_share",
    "processes_per_device", "relaunch", "request_cost", "setup_parallel", "shutdown", "split_by_tokens",
]
