"""Process groups and the device mesh: one process per device, every parallel dimension named.

The processes are started by torchrun (or by `parallel.launch`, which re-launches through the same
`torch.distributed.run`), so rank, world size and the rendezvous come from the environment that
torchrun sets. This module checks the requested sizes against that world, and the model's head
counts against the tensor-parallel size, before any collective or weight read: a bad configuration
fails on every rank at once with the same message, instead of one rank waiting for another forever.

Mesh: `init_device_mesh(device, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))`: tp innermost,
so a TP group is consecutive ranks (one node's devices), then the pipeline stages of a replica
(parallel/pipeline.py), then the replicas. Global rank = (dp_rank * pp + pp_rank) * tp + tp_rank.
Expert parallelism has no mesh dimension of its own: its group is every rank (tp x dp, as vLLM's),
or with pipeline stages every rank of one stage in every replica (dp x tp of that stage).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

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


class ParallelConfigError(ValueError):
    """The parallel sizes do not fit the launch (world size) or the model (head counts)."""


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
    sizes = (("tensor_parallel_size", tp), ("data_parallel_size", dp), ("pipeline_parallel_size", pp))
    for name, size in sizes:
        if not isinstance(size, int) or size < 1:
            raise ParallelConfigError(f"{name} must be an integer >= 1, got {size!r}")
    need = tp * dp * pp
    if need != world_size:
        product = f"tp x dp{' x pp' if pp > 1 else ''} = {need} processes"
        hint = (
            f"launch {product}, or choose sizes whose product is {world_size}"
            if "LOCAL_RANK" in os.environ  # inside torchrun
            else f"start it with torchrun --nproc-per-node {need} (or `toolkit generate --tp/--dp/--pp`, "
            "which does that by itself)"
        )
        pp_part = f" x pipeline_parallel_size {pp}" if pp > 1 else ""
        raise ParallelConfigError(
            f"tensor_parallel_size {tp} x data_parallel_size {dp}{pp_part} = {need} processes, "
            f"but this launch has a world size of {world_size}: {hint}"
        )


def setup_parallel(tp: int, dp: int, device: str | torch.device | None, model_config,
                   expert_parallel: bool = False, pp: int = 1, pp_layer_partition: str | None = None,
                   ) -> ParallelState | None:
    """Join the process group and build the mesh; None for a plain single-process run.

    `model_config` is checked against tp first (heads divisible, see `check_tensor_parallel`), with
    `expert_parallel` its experts against tp x dp, and with pp > 1 its layers against the stages
    (`layer_partition`), so those errors are raised before anything is loaded or any peer is waited for.
    """
    from toolkit.parallel.expert_parallel import check_expert_parallel, num_experts
    from toolkit.parallel.pipeline import layer_partition
    from toolkit.parallel.tensor_parallel import TensorParallel, check_tensor_parallel

    world = launched_world_size()
    if expert_parallel and num_experts(model_config) is None:
        log.warning("enable_expert_parallel: %s has no routed experts; ignored",
                    getattr(model_config, "path", "the model"))
        expert_parallel = False
    stage_sizes = layer_partition(model_config.num_layers, pp, pp_layer_partition)
    if tp * dp * pp == 1 and world == 1:
        return None
    check_sizes(tp, dp, world, pp)
    if expert_parallel:
        check_expert_parallel(model_config, tp * dp)
    check_tensor_parallel(model_config, tp, expert_parallel=expert_parallel)
    device = local_device(device)
    _init_process_group(device, world)
    mesh = init_device_mesh(device.type, (dp, pp, tp), mesh_dim_names=MESH_DIM_NAMES)
    _log_rank0_only()
    tp_helper = TensorParallel(mesh["tp"], model_config, device, expert_parallel=expert_parallel) if tp > 1 else None
    gather_group = dist.new_group(backend="gloo", timeout=GATHER_TIMEOUT) if dp > 1 else None
    ep, lockstep = None, None
    if expert_parallel:
        from toolkit.parallel.data_parallel import Lockstep
        from toolkit.parallel.expert_parallel import ExpertParallel

        ep = ExpertParallel(model_config, tp_group=tp_helper.group if tp_helper else None,
                            tp_rank=mesh.get_local_rank("tp"), tp_size=tp, group=_expert_group(mesh, dp, pp, tp))
        # Every rank enters each MoE layer's all-to-all once per step: the replicas step together.
        lockstep = Lockstep(dist.new_group(backend="gloo", timeout=dist_timeout())) if dp > 1 else None
    pipeline = _pipeline(mesh, stage_sizes, model_config, tp, dp) if pp > 1 else None
    state = ParallelState(mesh, device, tp_helper, gather_group, ep, lockstep, pipeline)
    log.info(
        "parallel: world %d = dp %d x pp %d x tp %d%s, backend %s, device %s, collective timeout %.0f s",
        world, dp, pp, tp, f", experts over {ep.size} ranks ({ep.num_local_experts} each)" if ep else "",
        dist.get_backend(), device.type, dist_timeout().total_seconds(),
    )
    if pipeline is not None:
        log.info("pipeline: layers per stage %s", ",".join(map(str, stage_sizes)))
    return state


def _expert_group(mesh: DeviceMesh, dp: int, pp: int, tp: int):
    """Expert parallelism's group: every rank (dp x tp), or with pipeline stages every rank of this
    rank's stage in every replica (a stage's MoE layers are only there)."""
    if pp == 1:
        return None  # the world
    mine = None
    for stage in range(pp):  # every rank builds every stage's group, in the same order
        ranks = [(d * pp + stage) * tp + t for d in range(dp) for t in range(tp)]
        group = dist.new_group(ranks, backend="gloo" if mesh.device_type == "cpu" else None, timeout=dist_timeout())
        if stage == mesh.get_local_rank("pp"):
            mine = group
    return mine


def _pipeline(mesh: DeviceMesh, stage_sizes: list[int], model_config, tp: int, dp: int):
    from toolkit.parallel.pipeline import PipelineParallel, StageSplit

    pp = len(stage_sizes)
    stage = StageSplit.of(mesh.get_local_rank("pp"), stage_sizes, bool(model_config.tie_word_embeddings))
    replicas = [list(range(d * pp * tp, (d + 1) * pp * tp)) for d in range(dp)]
    return PipelineParallel(mesh, stage, replicas, dist_timeout(), tp)


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


def _log_rank0_only() -> None:
    """One line per event: ranks other than 0 keep only errors (every rank would say the same)."""
    if dist.get_rank() != 0:
        logging.getLogger("toolkit").setLevel(logging.ERROR)


def shutdown() -> None:
    """Leave the process group (at the end of a job; safe to call when none was joined)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
