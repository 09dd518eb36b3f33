"""SPMD over the ranks of a tensor-parallel group, and expert parallelism's replicas.

Every rank runs every plan (their schedulers are in lockstep: each is fed the same requests and
appends the same tokens); TP rank 0 holds the logits' result and broadcasts it once per step. A
failure on one rank cannot be isolated (the others' collectives would wait for it), so it ends
the job as any TP fault does. Under expert parallelism with dp > 1 the replicas step together
(parallel.Lockstep): while any replica has requests, every replica runs one forward per step, a
one-token dummy batch when it has nothing of its own, so every rank enters each MoE layer's
all-to-all once per step (vLLM's dummy batch).
"""

from __future__ import annotations

import torch.distributed as dist

from toolkit.executor.base import Executor
from toolkit.worker import StepResult


class SPMDExecutor(Executor):
    def __init__(self, worker, parallel):
        super().__init__(worker)
        self.tp, self.ep, self.lockstep = parallel.tp, parallel.ep, parallel.lockstep

    def _agree_any(self, flags: list[bool]) -> list[bool]:
        return self.tp.agree_any(flags) if self.tp is not None else flags

    def submits(self, plan) -> bool:
        return self.lockstep is not None or bool(plan.scheduled)

    def _start(self, plan) -> StepResult:
        if not plan.scheduled:
            self.worker.run_dummy()
            self.lockstep.dummy_steps += 1
            return StepResult()
        result = self.worker.run(plan)
        if self.tp is None:
            return result
        box = [result]
        dist.broadcast_object_list(box, group=self.tp.group, group_src=0)
        return box[0]

    def any_busy(self, busy: bool) -> bool:
        return busy if self.lockstep is None else self.lockstep.any_busy(busy)
