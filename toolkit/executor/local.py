"""One process, one device: the plan runs at once, and a step that fails fails its requests alone."""

from __future__ import annotations

import logging

from toolkit.executor.base import Executor, is_dist_error
from toolkit.worker import StepResult

log = logging.getLogger("toolkit")


class LocalExecutor(Executor):
    def _start(self, plan) -> StepResult:
        try:
            return self.worker.run(plan)
        except Exception as exc:  # noqa: BLE001  one bad step must not poison the engine
            if is_dist_error(exc):
                raise
            # The scheduler advances computed tokens and names cached blocks only in update(), which
            # gets no tokens for these requests, so nothing the step half-wrote is reused.
            log.error("a step of %d requests failed; they end with finish_reason='error'", len(plan.scheduled),
                      exc_info=exc)
            return StepResult.failing(plan, f"the engine step failed: {type(exc).__name__}: {exc}")
