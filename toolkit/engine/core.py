"""The engine core: the same phases every step, whatever runs underneath.

    schedule -> KV connector (saves, then loads) -> execute (submit to the executor) ->
    [sample / verify / propose: in the worker that holds the logits] -> scheduler update -> outputs

The loop is a batch queue whose depth the executor fixes at start (1 for one process or an SPMD
group, pp for pipeline stages; vLLM's `step` vs `step_with_batch_queue`): a turn submits a new plan
while the queue has room, and otherwise (or when nothing new could be scheduled) retires the oldest
plan with the one result every rank agrees on. Features are plan fields, connectors, executors or a
role's hooks (build.py chooses them once); the core asks none of them what it is.
"""

from __future__ import annotations

import logging
import time

from toolkit.config import EngineConfig
from toolkit.engine.build import build_engine
from toolkit.outputs import RequestOutput
from toolkit.sampling_params import SamplingParams

log = logging.getLogger("toolkit")


class Engine:
    def __init__(self, config: EngineConfig):
        parts = build_engine(config)
        self.config, self.model_config, self.parallel = parts.config, parts.model_config, parts.parallel
        self.tokenizer = parts.tokenizer
        self.scheduler, self.executor, self.outputs = parts.scheduler, parts.executor, parts.outputs
        self.worker, self.hooks, self.kv_tiers, self.speculator = parts.worker, parts.hooks, parts.kv_tiers, parts.speculator
        self.backend = parts.backend
        self.front = parts.front  # how a call's requests reach the job's engines and come back (toolkit/front_end.py)
        self.device, self.dtype, self.max_model_len = self.config.device, self.config.dtype, self.config.max_model_len
        self._log_kv_cache()

    # --- what an engine is made of (for callers and tests) ----------------------------------------

    runner = property(lambda self: self.worker.runner)
    sampler = property(lambda self: self.worker.sampler)
    disagg = property(lambda self: getattr(self.hooks, "disagg", None) and self.hooks)
    tp = property(lambda self: self.parallel.tp if self.parallel is not None else None)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.outputs.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.outputs.eos_token_ids = ids

    def stats(self) -> dict:
        from toolkit.engine.stats import engine_stats

        return engine_stats(self)

    def get_metrics(self) -> list:
        from toolkit.engine.stats import engine_metrics

        return engine_metrics(self)

    def pipeline_stats(self) -> list[dict] | None:
        """Pipeline parallelism: each stage of this replica's busy and idle time so far, and its idle
        fraction over all steps and decode-only ones (parallel.pipeline.StageStats), stage order; None
        without pipeline parallelism. A collective: every rank of the replica must call it."""
        return self.executor.all_stats()

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget the prefix cache (device and CPU tier; the disk tier is kept). False while requests run."""
        return self.scheduler.reset_prefix_cache()

    def request_output_len(self, request_id: str) -> int:
        """Tokens generated so far by a running sequence (the scheduler's count)."""
        return len(self.scheduler.get_request(request_id).output_token_ids)

    def _log_kv_cache(self) -> None:
        kv = self.runner.kv_spec
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %d bytes/token); "
                 "max concurrency at max_model_len %d: %.2f requests", kv.num_blocks, kv.block_size, kv.num_tokens,
                 kv.bytes / 2**20, kv.bytes_per_token, self.max_model_len, kv.num_tokens / self.max_model_len)

    # --- requests in ------------------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass prompts as {'prompt_token_ids': [...]}")
        return self.tokenizer(prompt)["input_ids"]

    def validate_prompt(self, prompt_token_ids: list[int], where: str = "prompt") -> None:
        if not prompt_token_ids:
            raise ValueError(f"{where} is empty")
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool)), None)
        if bad is not None:
            raise ValueError(f"{where}: token ids must be ints, got {type(bad).__name__} {bad!r}")
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(f"{where} has {len(prompt_token_ids)} tokens, more than max_model_len {self.max_model_len}")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"{where} has token ids outside the vocabulary [0, {self.model_config.vocab_size}): {bad[:5]}")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, priority: int = 0, arrival_time: float | None = None,
                    cache_salt: str | None = None) -> None:
        if request_id in self.outputs.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.validate()  # fields may have changed since the SamplingParams was built
        params.check_vocab(self.model_config.vocab_size)
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"request {request_id!r} has priority {priority} but scheduling_policy is "
                             f"{self.config.scheduling_policy!r}; pass scheduling_policy='priority'")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt of request {request_id!r} must be a string, got {type(cache_salt).__name__}")
        self.validate_prompt(prompt_token_ids, f"prompt of request {request_id!r}")
        # A disaggregated role keeps only its own (every rank is fed every request); others add all.
        self.hooks.add_request(self, request_id, prompt_token_ids, params, prompt, priority, arrival_time, cache_salt)

    # --- what the engine's hooks call (build.py's NoHooks; a disaggregated role) --------------------

    def admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
              priority: int = 0, arrival_time: float | None = None, cache_salt: str | None = None):
        """A request `add_request` checked, into this engine now (as its n sequences); the hooks decide
        when. Returns its RequestGroup (its sequences' ids, its metrics), None if it ended at once."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        for req, child_params in self.outputs.add(request_id, prompt_token_ids, params, prompt, priority, arrival,
                                                  cache_salt):
            self.worker.add_request(req.request_id, child_params)
            self.scheduler.add_request(req)
        return self.outputs.groups.get(request_id)

    @property
    def num_held(self) -> int:
        """User requests admitted into this engine and not finished (a role's own queues not counted)."""
        return len(self.outputs.groups)

    def holds(self, sequence_id: str) -> bool:
        """Whether the scheduler holds this sequence (waiting, preempted or running): one admitted can
        already have been rejected (it cannot fit the cache)."""
        return self.scheduler.holds(sequence_id)

    def flush_transfers(self) -> None:
        """The KV moves the scheduler's last update named (saves to the tiers, drops) to the connectors
        now, before anything reuses those blocks (the core does it when it goes idle)."""
        self.executor.transfer_kv(self.scheduler.pending_transfers())

    def serves(self, request_id: str) -> bool:
        """Whether step() will return this request's output here: always, except in a disaggregated
        job, where its decode instance does (toolkit/disaggregated.py)."""
        return self.hooks.serves(request_id)

    @property
    def num_unfinished_requests(self) -> int:
        """User requests this engine holds (a disaggregated decode instance: with those whose prefill
        has not come yet)."""
        return len(self.outputs.groups) + self.hooks.num_awaited

    def abort_request(self, request_id: str) -> None:
        from toolkit.scheduling import RequestStatus

        self.hooks.abort(self, request_id)  # a disaggregated role's requests not in this engine (yet)
        group = self.outputs.groups.get(request_id)
        for child in list(group.children) if group else ():
            if child in self.outputs.tracked:
                self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
                self.outputs.finish([self.outputs.tracked[child].request])

    def has_unfinished(self) -> bool:
        """Whether requests are in flight. With replicas that step together (expert parallelism, dp > 1)
        it is whether ANY replica still has some, agreed by every rank in one collective, so every
        replica's loop `while engine.has_unfinished(): engine.step()` runs the same steps and ends at
        the same one: there it must be called once per step, on every rank."""
        busy = self.executor.any_busy(self.hooks.has_unfinished(self, bool(self.outputs.groups)))
        if not busy:
            self.executor.idle()  # every rank of the replica sees no request left at the same step
        return busy

    # --- one step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One turn; returns the user requests that finished in it."""
        self.hooks.before_step(self)
        finished, plan = [], None
        if self.executor.has_room:
            plan = self.scheduler.schedule()
            finished += self.outputs.finish(plan.rejected)
            failed = self.executor.transfer_kv(plan.kv_transfer)
            if failed:  # those requests go back to waiting and recompute
                self.scheduler.transfers_failed(plan, failed)
            if self.executor.submits(plan):
                self.outputs.mark_scheduled(plan)
                self.executor.submit(plan)
                if self.executor.has_room:  # a pipeline fills its queue before it waits for a result
                    return self.hooks.after_step(self, finished)
        if self.executor.num_in_flight:
            finished += self._retire(*self.executor.take())
        elif self.scheduler.has_unfinished() and not (plan and (plan.rejected or plan.requeued)):
            raise RuntimeError("scheduler made no progress with requests pending (a bug: please report)")
        if not self.scheduler.has_unfinished():
            self.flush_transfers()
        return self.hooks.after_step(self, finished)

    def _retire(self, plan, result) -> list[RequestOutput]:
        """A computed plan's result into the scheduler and the outputs: the requests the step failed
        alone end first (with no token from it), then the others' tokens, logprobs and text."""
        failing = [self.outputs.tracked[rid].request for rid in result.failed if rid in self.outputs.tracked]
        for req in failing:
            self.outputs.fail(req, result.failed[req.request_id])
        finished = self.outputs.finish(failing)
        self.outputs.store_prompt_logprobs(plan, result.prompt_logprobs)
        before = self.outputs.before(result.sampled)
        done = self.scheduler.update(plan, result.sampled, result.drafts)
        done += self.outputs.append(result.logprobs, before)
        return finished + self.outputs.finish(done)
