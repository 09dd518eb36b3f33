"""Executors own processes and devices: each takes a plan, runs this rank's part of it on its worker,
and gives every rank of the replica that plan's one `StepResult`, broadcast once from where it is known.

- `LocalExecutor` (local.py): one process, one device.
- `SPMDExecutor` (spmd.py): the ranks of a tensor-parallel group (and expert parallelism's replicas,
  which step in lockstep, running a dummy batch when they have nothing).
- `PipelineExecutor` (pipeline.py): this rank's stage of a pipeline, up to pp plans in flight.

The engine core chooses one at start (`build_executor`) and its queue depth with it; it never asks
which one it has.
"""

from toolkit.executor.base import Executor, build_executor

__all__ = ["Executor", "build_executor"]
