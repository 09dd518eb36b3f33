"""The worker: one rank's model runner, its KV movement, and what is computed where the logits are.

An executor (toolkit/executor/) drives one worker per rank. Every worker prepares a plan's tensors
and runs its model (a pipeline stage's layers, a TP shard); the one that holds the logits (one
process, TP rank 0, a pipeline's last stage: `holds_logits`) also samples, verifies drafts, computes
prompt logprobs and proposes the next drafts, and returns all of it as one `StepResult`, which the
executor hands to every rank. Per-request state here (sampling parameters, the sampler's seeds, a
draft model's KV) is dropped from what the plan says was released, never by hand.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from toolkit.sampler import Sampler, logprob_entries
from toolkit.sampling_params import SamplingParams
from toolkit.scheduling import SchedulerOutput

log = logging.getLogger("toolkit")


@dataclass
class StepResult:
    """What one plan's step hands every rank's scheduler (picklable: it is broadcast once per step from
    where it is known): each sampling request's kept tokens and their logprob entries, the entries of
    the prompt positions that wanted logits (scheduled order), the next drafts of requests that go on,
    and the requests this step failed alone (id -> reason)."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list] = field(default_factory=dict)
    prompt_logprobs: list = field(default_factory=list)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    @classmethod
    def failing(cls, plan: SchedulerOutput, reason: str) -> "StepResult":
        return cls(failed={r.request_id: reason for r in plan.scheduled})


class Worker:
    def __init__(self, runner, sampler: Sampler, scheduler, kv_mover=None, speculator=None,
                 holds_logits: bool = True):
        """`scheduler` is this rank's (in lockstep with every other rank's): the worker reads its
        requests' tokens and block tables; `kv_mover` runs a plan's block copies on this rank's cache."""
        self.runner, self.sampler, self.scheduler = runner, sampler, scheduler
        self.kv_mover, self.speculator = kv_mover, speculator
        self.holds_logits = holds_logits
        self._params: dict[str, SamplingParams] = {}

    def add_request(self, request_id: str, params: SamplingParams) -> None:
        self._params[request_id] = params
        self.sampler.add_request(request_id, params)

    def transfer_kv(self, plan) -> list:
        """Run a plan's block copies on this rank; returns the loads that failed here."""
        return self.kv_mover.transfer(plan) if plan and self.kv_mover is not None else []

    def prepare(self, plan: SchedulerOutput):
        self._release(plan)
        return self.runner.prepare(plan.scheduled)

    def _release(self, plan: SchedulerOutput) -> None:
        for rid in plan.finished_ids + [r.request_id for r in plan.rejected]:
            self._params.pop(rid, None)
            self.sampler.remove_request(rid)
        if self.speculator is not None:
            self.speculator.release(plan.released)

    def forward(self, inputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's part of the model: logits, or a stage's hidden states."""
        return self.runner.execute(inputs) if hidden is None else self.runner.execute(inputs, hidden)

    def run(self, plan: SchedulerOutput) -> StepResult | None:
        """The whole step on this rank: its result where the logits are, else None."""
        inputs = self.prepare(plan)
        logits = self.forward(inputs)
        return self.sample(plan, inputs, logits) if self.holds_logits else None

    def run_dummy(self) -> None:
        self.runner.execute_dummy()

    def prepare_dummy(self):
        return self.runner.prepare_dummy()

    # --- where the logits are ---------------------------------------------------------------------

    def sample(self, plan: SchedulerOutput, inputs, logits: torch.Tensor) -> StepResult:
        """The tokens (and logprob entries) each sampling request keeps from this step's logits: one,
        or after a verify step its accepted drafts and one more; the prompt rows' entries; the drafts
        for the next step of every request that goes on."""
        prompt_entries = []
        if inputs.num_prompt_rows:
            num_sampled = logits.shape[0] - inputs.num_prompt_rows
            prompt_entries = self._prompt_logprob_entries(plan, logits[num_sampled:])
            logits = logits[:num_sampled]
        sampling = [r for r in plan.scheduled if r.samples]
        if not sampling:
            return StepResult(prompt_logprobs=prompt_entries)
        ids = [r.request_id for r in sampling]
        reqs = [self.scheduler.get_request(i) for i in ids]
        params = [self._params[i] for i in ids]
        if self.speculator is not None and any(r.num_draft_tokens for r in sampling):
            verified = self.speculator.verify(logits, plan, reqs, params)
            tokens, logprobs = verified.token_ids, verified.logprobs
        else:
            out = self.sampler(logits, ids, params, [r.prompt_token_ids for r in reqs],
                               [r.output_token_ids for r in reqs])
            tokens, logprobs = [[t] for t in out.token_ids], [[lp] for lp in out.logprobs]
        result = StepResult(dict(zip(ids, tokens)), dict(zip(ids, logprobs)), prompt_entries)
        if self.speculator is not None:
            self._propose(result, reqs, params)
        return result

    def _propose(self, result: StepResult, reqs, params) -> None:
        """The next drafts; if the proposer fails, the requests it was drafting for fail alone (the
        failure is known here and travels in the result, so every rank ends them alike)."""
        from toolkit.speculative.speculator import NextState

        states = [NextState(r, result.sampled[r.request_id]) for r in reqs]
        going = [(s, p) for s, p in zip(states, params) if s.goes_on()]
        if not going:
            return
        kv = self.scheduler.kv_cache
        try:
            result.drafts = self.speculator.propose(
                [s for s, _ in going], [p for _, p in going], [kv.block_table(s.request_id) for s, _ in going],
                self.scheduler.config.block_size, self.scheduler.config.max_model_len, self.scheduler.num_running)
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, torch.distributed.DistError):
                raise
            log.error("drafting for %d requests failed; they end with finish_reason='error'", len(going),
                      exc_info=exc)
            reason = f"drafting failed: {type(exc).__name__}: {exc}"
            result.failed.update({s.request_id: reason for s, _ in going})

    def _prompt_logprob_entries(self, plan: SchedulerOutput, logits: torch.Tensor) -> list:
        """Prompt logprob entries from this step's prompt rows (in scheduled order): the logits at
        position p give prompt token p + 1's entry."""
        targets, ks = [], []
        for r in plan.scheduled:
            if r.num_prompt_logits:
                first = r.start_position + 1
                targets += self.scheduler.get_request(r.request_id).prompt_token_ids[first: first + r.num_prompt_logits]
                ks += [self._params[r.request_id].prompt_logprobs] * r.num_prompt_logits
        return logprob_entries(logits, torch.tensor(targets, device=logits.device), ks)

    def retired(self, plan: SchedulerOutput, result: StepResult) -> None:
        """Every rank, as a plan retires: counters that every rank reports alike."""
        if self.speculator is not None:
            self.speculator.count(plan, result.sampled)
