"""What every executor does: a queue of submitted plans, each retired with the result every rank agrees on."""

from __future__ import annotations

from collections import deque

import torch

from toolkit.worker import StepResult


class Executor:
    depth = 1  # plans in flight at most (the engine core's batch queue)

    def __init__(self, worker):
        self.worker = worker
        self._queue: deque = deque()  # (plan, whatever the subclass keeps until the plan retires)

    @property
    def num_in_flight(self) -> int:
        return len(self._queue)

    @property
    def has_room(self) -> bool:
        return len(self._queue) < self.depth

    def transfer_kv(self, kv_plan) -> list:
        """Run a plan's block copies (scheduling.KVTransferPlan) on this rank; returns the loads that
        failed on any rank of the replica (each rank moves its own share of the KV: all drop the same)."""
        failed = self.worker.transfer_kv(kv_plan)
        if not kv_plan or not kv_plan.loads:
            return failed
        bad = {id(c) for c in failed}
        flags = self._agree_any([id(c) in bad for c in kv_plan.loads])
        return [c for c, flag in zip(kv_plan.loads, flags) if flag]

    def _agree_any(self, flags: list[bool]) -> list[bool]:
        return flags

    def submits(self, plan) -> bool:
        """Whether this turn starts a step: when the plan holds requests (replicas in lockstep: always)."""
        return bool(plan.scheduled)

    def submit(self, plan) -> None:
        self._queue.append((plan, self._start(plan)))

    def take(self):
        """(plan, StepResult) of the oldest plan in flight, on every rank of the replica."""
        plan, pending = self._queue.popleft()
        result = self._finish(plan, pending)
        self.worker.retired(plan, result)
        return plan, result

    def _start(self, plan):
        raise NotImplementedError

    def _finish(self, plan, pending) -> StepResult:
        return pending

    def any_busy(self, busy: bool) -> bool:
        """Whether any replica that steps with this one still has requests (one without: `busy`)."""
        return busy

    def idle(self) -> None:
        """Nothing is in flight and nothing is left (every rank at the same step)."""

    def stats(self) -> dict:
        return {}

    def all_stats(self) -> list[dict] | None:
        """Each pipeline stage's report, stage order (a collective over the replica); None without stages."""
        return None

    def metrics(self) -> list:
        return []


def build_executor(worker, parallel, config) -> Executor:
    """The executor of this rank's layout: pipeline stages, an SPMD group, or one process."""
    if parallel is not None and parallel.pp is not None:
        from toolkit.executor.pipeline import PipelineExecutor

        return PipelineExecutor(worker, parallel)
    if parallel is not None and (parallel.tp is not None or parallel.ep is not None):
        from toolkit.executor.spmd import SPMDExecutor

        return SPMDExecutor(worker, parallel)
    from toolkit.executor.local import LocalExecutor

    return LocalExecutor(worker)


def is_dist_error(exc: BaseException) -> bool:
    return isinstance(exc, torch.distributed.DistError)
