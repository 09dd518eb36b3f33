"""This rank's stage of a pipeline (parallel/pipeline.py): up to pp plans in flight.

Submitting a plan runs this stage's layers for it: the previous stage's hidden states in (the first
stage embeds), this stage's out to the next, and on the last stage the worker's result (sampled and
verified tokens, next drafts) out to every rank of the replica by one asynchronous broadcast from its
TP rank 0. Taking the oldest plan waits for that result. Every rank of the replica submits and takes
in the same order, so the point-to-point messages and broadcasts match without any handshake. Each
stage moves its own layers' KV for the connector (tiers, swap), and a load that failed on any stage
fails on all. Under expert parallelism with dp > 1 (each stage's experts split over that stage's
ranks in every replica) the replicas submit in lockstep, an empty plan as a dummy batch through
every stage.
"""

from __future__ import annotations

import time

from toolkit.executor.base import Executor
from toolkit.inputs import MIN_TOKENS
from toolkit.worker import StepResult


class PipelineExecutor(Executor):
    def __init__(self, worker, parallel):
        super().__init__(worker)
        self.pp, self.lockstep = parallel.pp, parallel.lockstep
        self.depth = self.pp.stage.size
        config = worker.runner.config
        # No plan packs more tokens than the budget (padded to at least MIN_TOKENS).
        self.pp.receive_ahead(max(config.max_num_batched_tokens, MIN_TOKENS))
        self._hidden = (worker.runner.model_config.hidden_size, config.dtype, worker.runner.device)

    def _agree_any(self, flags: list[bool]) -> list[bool]:
        return self.pp.agree_any(flags)

    def submits(self, plan) -> bool:
        return self.lockstep is not None or bool(plan.scheduled)

    def _start(self, plan) -> None:
        began = time.perf_counter()
        pp, stage = self.pp, self.pp.stage
        dummy = not plan.scheduled
        if not dummy:
            pp.expect_result()  # its receive posted now, so the result moves as soon as it is sent
        inputs = self.worker.prepare_dummy() if dummy else self.worker.prepare(plan)
        hidden = None
        if not stage.is_first:
            size, dtype, device = self._hidden
            hidden = pp.recv_hidden((inputs.input_ids.shape[0], size), dtype, device)
        start = time.perf_counter()
        out = self.worker.forward(inputs, hidden)
        pp.stats.compute_s += time.perf_counter() - start
        if dummy and self.lockstep is not None:
            self.lockstep.dummy_steps += 1
        if not dummy:
            pp.stats.plans += 1
        if not stage.is_last:
            pp.send_hidden(out)
        elif not dummy and pp.is_result_src:
            pp.post_result(self.worker.sample(plan, inputs, out))
        pp.end_turn(_decode_only(plan), len(self._queue) + 1, began)

    def _finish(self, plan, pending) -> StepResult:
        began = time.perf_counter()
        result = StepResult() if not plan.scheduled else self.pp.take_result()
        self.pp.end_turn(_decode_only(plan), len(self._queue), began)
        return result

    def any_busy(self, busy: bool) -> bool:
        return busy if self.lockstep is None else self.lockstep.any_busy(busy)

    def idle(self) -> None:
        self.pp.drain()

    def stats(self) -> dict:
        return {"pipeline": self.pp.report()}

    def all_stats(self) -> list[dict]:
        """Each stage's report, stage order (a collective over the replica: every rank calls it)."""
        by_stage = {}
        for entry in self.pp.all_stats():
            by_stage.setdefault(entry["stage"], entry)  # a stage's TP ranks wait alike: its first speaks
        return [by_stage[i] for i in sorted(by_stage)]

    def metrics(self) -> list:
        from toolkit.metrics import Counter

        stage, stats = {"stage": str(self.pp.stage.index)}, self.pp.stats
        return [Counter("toolkit:pp_stage_busy_seconds", stage, stats.busy_s),
                Counter("toolkit:pp_stage_idle_seconds", stage, stats.idle_s),
                Counter("toolkit:pp_plans", stage, stats.plans)]


def _decode_only(plan) -> bool:
    return bool(plan.scheduled) and all(len(r.token_ids) == 1 and r.samples for r in plan.scheduled)
