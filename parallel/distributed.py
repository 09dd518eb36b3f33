"""Process groups and the device mesh: one process per device, every parallel dimension named.

The processes are started by torchrun (or by `parallel.launch`, which re-launches through the same
`torch.distributed.run`), so rank, world size and the rendezvous come from the environment that
torchrun sets. The degrees are one `ParallelDims` (parallel/dims.py), validated against that world
and the model before any collective or weight read (a bad configuration fails on every rank at once
with the same message, instead of one rank waiting for another forever); `build_parallel` then joins
the process group and builds every group from it, once.

Mesh: `init_device_mesh(device, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))`: tp innermost,
so a TP group is consecutive ranks (one node's devices), then the pipeline stages of a replica
(parallel/pipeline.py), then the replicas. Global rank = (dp_rank * pp + pp_rank) * tp + tp_rank.
Expert parallelism has no mesh dimension of its own: its group is every rank (tp x dp, as vLLM's),
or with pipeline stages every rank of one stage in every replica (dp x tp of that stage).
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from toolkit.parallel.dims import ParallelConfigError, ParallelDims

log = logging.getLogger("toolkit")

MESH_DIM_NAMES = ("dp", "pp", "tp")
TIMEOUT_ENV = "TOOLKIT_DIST_TIMEOUT"
# A collective waiting longer than this on a silent peer fails the job rather than hanging it.
# (A peer that dies closes its sockets and fails its peers at once; the timeout is for hung ones.)
# It must exceed the longest gap between two collectives, e.g. one rank's torch.compile.
DEFAULT_TIMEOUT_S = 600.0
# Data-parallel replicas meet only once, to gather their outputs on rank 0, and one may finish its
# share hours after another: that one collective gets its own group with a day-long timeout.
GATHER_TIMEOUT = timedelta(hours=24)


@dataclass
class ParallelState:
    """This process's place in the mesh, and the tensor-parallel helper of its replica."""

    mesh: DeviceMesh
    device: torch.device
    tp: object | None  # parallel.TensorParallel when tp > 1, else None
    gather_group: dist.ProcessGroup | None  # CPU (gloo) group for the outputs, when dp > 1
    ep: object | None = None  # parallel.ExpertParallel with enable_expert_parallel (MoE models), else None
    # parallel.Lockstep when replicas must step together (dp > 1 with expert parallelism), else None
    lockstep: object | None = None
    pp: object | None = None  # parallel.pipeline.PipelineParallel when pp > 1, else None
    dims: ParallelDims = ParallelDims()  # the validated degrees this state was built from

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size()

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def tp_size(self) -> int:
        return self.mesh["tp"].size()

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank("tp")

    @property
    def pp_size(self) -> int:
        return self.mesh["pp"].size()

    @property
    def replica_size(self) -> int:
        """Ranks per data-parallel replica: its pipeline stages times its TP ranks."""
        return self.pp_size * self.tp_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_world_size() -> int:
    """Processes in this launch: torchrun's WORLD_SIZE, 1 when not launched by torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    """True on global rank 0 and in a single-process run: the process that writes outputs."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def processes_per_device(device: torch.device) -> int:
    """Processes sharing this process's memory pool: a GPU is its own, a CPU host is shared by all
    of the node's processes (torchrun's LOCAL_WORLD_SIZE), so a memory fraction is split among them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1


def dist_timeout() -> timedelta:
    raw = os.environ.get(TIMEOUT_ENV)
    try:
        seconds = DEFAULT_TIMEOUT_S if raw is None else float(raw)
    except ValueError:
        raise ParallelConfigError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if seconds <= 0:
        raise ParallelConfigError(f"{TIMEOUT_ENV} must be > 0 seconds, got {raw!r}")
    return timedelta(seconds=seconds)


def check_sizes(tp: int, dp: int, world_size: int, pp: int = 1) -> None:
    ParallelDims(dp=dp, pp=pp, tp=tp).check_world(world_size)


def setup_parallel(tp: int, dp: int, device: str | torch.device | None, model_config,
                   expert_parallel: bool = False, pp: int = 1, pp_layer_partition: str | None = None,
                   ) -> ParallelState | None:
    """Join the process group and build the mesh; None for a plain single-process run.
    (`build_parallel` over `ParallelDims(dp, pp, tp, expert_parallel, pp_layer_partition)`.)"""
    dims = ParallelDims(dp=dp, pp=pp, tp=tp, expert_parallel=expert_parallel, pp_layer_partition=pp_layer_partition)
    return build_parallel(dims, device, model_config)


def build_parallel(dims: ParallelDims, device: str | torch.device | None, model_config) -> ParallelState | None:
    """Validate `dims` against the launch and `model_config` (heads over tp, experts over the expert
    group, layers over the stages: `ParallelDims.validate`) before anything is loaded or any peer is
    waited for, then join the process group and build every group once. None for a single process."""
    world = launched_world_size()
    dims, stage_sizes = dims.validate(model_config, world)
    if dims.world_size == 1 and world == 1:
        return None
    device = local_device(device)
    _init_process_group(device, world)
    mesh = init_device_mesh(device.type, (dims.dp, dims.pp, dims.tp), mesh_dim_names=MESH_DIM_NAMES)
    _log_rank0_only()
    state = ParallelState(mesh, device, tp=None, gather_group=None, dims=dims)
    if dims.tp > 1:
        from toolkit.parallel.tensor_parallel import TensorParallel

        state.tp = TensorParallel(mesh["tp"], model_config, device, expert_parallel=dims.expert_parallel)
    if dims.dp > 1:
        state.gather_group = dist.new_group(backend="gloo", timeout=GATHER_TIMEOUT)
    if dims.expert_parallel:
        _expert_parallel(state, dims, model_config)
    if dims.pp > 1:
        state.pp = _pipeline(state, dims, stage_sizes, model_config)
    ep = state.ep
    log.info(
        "parallel: world %d = %s, backend %s, device %s, collective timeout %.0f s%s",
        world, dims.describe(), dist.get_backend(), device.type, dist_timeout().total_seconds(),
        f", experts over {ep.size} ranks ({ep.num_local_experts} each)" if ep else "",
    )
    if state.pp is not None:
        log.info("pipeline: layers per stage %s", ",".join(map(str, stage_sizes)))
    return state


def _expert_parallel(state: ParallelState, dims: ParallelDims, model_config) -> None:
    """Expert parallelism's group: every rank of this rank's pipeline stage in every replica (dp x tp;
    the world when pp = 1), and the replicas' lockstep: every rank enters each MoE layer's all-to-all
    once per step, so with dp > 1 the replicas step together."""
    from toolkit.parallel.data_parallel import Lockstep
    from toolkit.parallel.expert_parallel import ExpertParallel

    group = None  # the world
    if dims.pp > 1:
        for stage in range(dims.pp):  # every rank builds every stage's group, in the same order
            g = dist.new_group(dims.stage_ranks(stage), backend="gloo" if state.device.type == "cpu" else None,
                               timeout=dist_timeout())
            if stage == state.mesh.get_local_rank("pp"):
                group = g
    tp_group = state.tp.group if state.tp is not None else None
    state.ep = ExpertParallel(model_config, tp_group=tp_group, tp_rank=state.tp_rank, tp_size=dims.tp, group=group)
    if dims.dp > 1:
        state.lockstep = Lockstep(dist.new_group(backend="gloo", timeout=dist_timeout()))


def _pipeline(state: ParallelState, dims: ParallelDims, stage_sizes: list[int], model_config):
    from toolkit.parallel.pipeline import PipelineParallel, StageSplit, replica_groups

    stage = StageSplit.of(state.mesh.get_local_rank("pp"), stage_sizes, bool(model_config.tie_word_embeddings))
    groups = replica_groups([dims.replica_ranks(d) for d in range(dims.dp)], dist_timeout())
    return PipelineParallel(state.mesh, stage, groups, dims.tp)


def local_device(device: str | torch.device | None) -> torch.device:
    """This process's device: cuda:LOCAL_RANK on GPUs (one process per device), else the CPU."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)  # NCCL and the object collectives use the current device
    return device


def _init_process_group(device: torch.device, world: int) -> None:
    if dist.is_initialized():
        # A second LLM in the same job reuses the group; it must be the same world.
        if dist.get_world_size() != world:
            raise ParallelConfigError(
                f"the process group has {dist.get_world_size()} ranks but WORLD_SIZE is {world}"
            )
        return
    if "MASTER_ADDR" not in os.environ:
        raise ParallelConfigError(
            f"WORLD_SIZE is {world} but MASTER_ADDR is not set: start the job with torchrun "
            "(or parallel.launch), which sets the rendezvous environment"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=dist_timeout())
    atexit.register(shutdown)  # a script that never calls shutdown() still leaves the groups alive


def _log_rank0_only() -> None:
    """One line per event: ranks other than 0 keep only errors (every rank would say the same)."""
    if dist.get_rank() != 0:
        logging.getLogger("toolkit").setLevel(logging.ERROR)


# Long enough for gloo's worker threads to take the GIL once each (they need it for microseconds).
_RELEASE_S = 0.05


def shutdown() -> None:
    """Leave the process group (at the end of a job; safe to call when none was joined, and called at
    exit by itself).

    Then wait a moment with the GIL released: a gloo worker thread frees each finished collective's
    tensors after the caller's wait has returned, and freeing a tensor Python also held takes the GIL.
    A thread still waiting for it when the interpreter tears down is made to exit inside a C++
    destructor, which aborts the process ("terminate called without an active exception"), after the
    job's work was done; a job that built several engines in turn hit it about one run in two."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(_RELEASE_S)
