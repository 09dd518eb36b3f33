"""The engine: one step = schedule -> prepare tensors -> forward -> sample -> update -> detokenize.

The engine owns the glue between the rooms: requests come in with their sampling parameters,
the scheduler decides which tokens run, the runner computes logits for the requests that sample,
the sampler picks tokens (after the step's KV transfers, when the memory hierarchy has tiers,
have run), the scheduler appends them and checks stop tokens and lengths, and the
detokenizer turns tokens into text and finds stop strings. Finished requests come out as
`RequestOutput`s.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from toolkit.parallel import setup_parallel
from toolkit.scheduling import Request, RequestStatus, Scheduler, SchedulerConfig, SchedulerOutput
from toolkit import backends
from toolkit.config import (EngineConfig, ModelConfig, UnsupportedModelError, check_device, check_sliding_window,
                            load_model_config)
from toolkit.detokenizer import IncrementalDetokenizer
from toolkit.inputs import MIN_TOKENS
from toolkit.kv_hierarchy import build_kv_hierarchy
from toolkit.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from toolkit.runner import ModelRunner
from toolkit.sampler import Sampler, logprob_entries
from toolkit.sampling_params import SamplingParams, child_seed
from toolkit.tokenizer import TOKENIZER_FILES, eos_token_ids, load_tokenizer

log = logging.getLogger("toolkit")

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class _Tracked:
    """What the engine keeps per scheduled sequence, beside the scheduler's Request."""

    request: Request
    parent_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0


@dataclass
class _Group:
    """One user request: its n sequences and the output they become."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    children: list[str] = field(default_factory=list)
    done: dict[int, CompletionOutput] = field(default_factory=dict)
    error: str | None = None
    num_cached_tokens: int = 0  # the first sequence's
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # filled by the first sequence's prefill


@dataclass
class _StepResult:
    """What a step's forward and sampling hand the scheduler (picklable: a pipeline's last stage sends
    it to every rank): each sampling request's tokens and their logprob entries, and the entries of
    the prompt positions that wanted logits, in scheduled order."""

    sampled: dict[str, list[int]]
    logprobs: dict[str, list]
    prompt_logprobs: list = field(default_factory=list)


class Engine:
    def __init__(self, config: EngineConfig):
        check_device(config)
        self.model_config: ModelConfig = _load_model_config(config)
        mc = self.model_config
        # Joins the process group when tp * dp * pp > 1 (or as one instance of a disaggregated job); checks
        # the sizes against the world, the heads and the layers first.
        disagg = None
        if config.disaggregated:
            from toolkit.parallel.disaggregated import DisaggLayout, setup_disaggregated

            layout = DisaggLayout(config.prefill_instances, config.decode_instances, config.tensor_parallel_size,
                                  config.prefill_tensor_parallel_size)
            self.parallel, disagg = setup_disaggregated(layout, config.device, mc)
            config = dataclasses.replace(config, tensor_parallel_size=disagg.instance.tp)
        else:
            self.parallel = setup_parallel(config.tensor_parallel_size, config.data_parallel_size, config.device, mc,
                                           expert_parallel=config.enable_expert_parallel,
                                           pp=config.pipeline_parallel_size,
                                           pp_layer_partition=config.pp_layer_partition)
        self.tp = self.parallel.tp if self.parallel is not None else None
        # Pipeline parallelism: this rank's stage; up to pp step plans in flight (_step_pipelined).
        self.pp = self.parallel.pp if self.parallel is not None else None
        self._in_flight: deque[SchedulerOutput] = deque()
        # Expert parallelism (MoE): this rank's experts; with dp > 1 the replicas step in lockstep (step()).
        self.ep = self.parallel.ep if self.parallel is not None else None
        self._lockstep = self.parallel.lockstep if self.parallel is not None else None
        if self.ep is not None and config.cuda_graphs:
            # The all-to-all's sizes depend on the routing, read on the host: no graph can replay it.
            config = dataclasses.replace(config, cuda_graphs=False)
        device = self.parallel.device if self.parallel is not None else torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        config = backends.runnable(config.resolve(mc, device))
        check_sliding_window(mc, config.max_model_len)
        # The device's kernels (built at once on CPU), its attention backend, its model changes.
        self.backend = backends.for_device(config, mc)
        self.config = config
        self.device, self.dtype, self.max_model_len = config.device, config.dtype, config.max_model_len
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or config.model)
        if self.tokenizer is None and config.tokenizer is not None and not config.skip_tokenizer_init:
            raise FileNotFoundError(f"tokenizer={config.tokenizer!r} has none of {', '.join(TOKENIZER_FILES)}")
        self.eos_token_ids = eos_token_ids(mc, self.tokenizer)
        self.runner = ModelRunner(config, mc, self.backend, self.tp, ep=self.ep, pp=self.pp)
        if self.pp is not None:  # no plan packs more tokens than the budget (padded to at least MIN_TOKENS)
            self.pp.receive_ahead(max(config.max_num_batched_tokens, MIN_TOKENS))
        kv = self.runner.kv_spec
        self.sampler = Sampler(config.seed)
        spec = config.speculative_config
        from toolkit.speculative.speculator import Speculator  # here: speculative/ imports the toolkit's sampler
        # Speculative decoding (speculative/): drafts proposed after each step, verified in the next.
        self.speculator = None if spec is None else Speculator(spec, config, mc, self.sampler, kv.num_blocks, self.tp)
        # CPU and disk tiers below the device cache (None when none is configured or none could be had).
        self.kv_tiers = build_kv_hierarchy(config, mc, self.runner.kv_caches, kv.bytes_per_token * kv.block_size,
                                           self.tp)
        # Disaggregated prefill/decode (toolkit/disaggregated.py): this instance's role, and its KV connector.
        self.disagg = None
        if disagg is not None:
            from toolkit.disaggregated import build_role

            self.disagg = build_role(disagg, config.block_size, self.runner.kv_caches, mc.num_kv_heads)
        # What carries out each step's plan of block copies, and the connector that plans them.
        self._kv_mover = self.kv_tiers or self.disagg
        preemption = config.preemption_mode
        if preemption == "swap" and (self.kv_tiers is None or not self.kv_tiers.connector.cpu_blocks):
            log.warning("preemption_mode='swap' has no CPU tier to swap to; preempting by recompute")
            preemption = "recompute"
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=kv.num_blocks,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                policy=config.scheduling_policy,
                num_lookahead_tokens=self.speculator.num_lookahead_tokens if self.speculator else 0,
                enable_prefix_caching=config.enable_prefix_caching,
                preemption_mode=preemption,
                max_plans_in_flight=config.pipeline_parallel_size,
            ),
            self._kv_mover.connector if self._kv_mover else None,
        )
        self._tracked: dict[str, _Tracked] = {}
        self._groups: dict[str, _Group] = {}
        self._log_kv_cache()

    def stats(self) -> dict:
        """What this engine built and where it stands: the runner's load and compile times, KV cache,
        backend choices, and the scheduler's queues (what benchmarks and progress displays read)."""
        stats = {**self.runner.stats(), "running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting,
                 "free_blocks": self.scheduler.num_free_blocks, "preemptions": self.scheduler.num_preemptions}
        stats["prefix_cache"] = vars(self.scheduler.prefix_cache_stats).copy()
        if self.kv_tiers is not None:
            stats["kv_tiers"] = self.kv_tiers.stats()
        if self.ep is not None:
            stats["expert_parallel"] = self._ep_stats()
        if self.pp is not None:
            stats["pipeline"] = self.pp.report()
        if self.disagg is not None:
            stats["disaggregated"] = self.disagg.stats()
        if self.speculator is not None:
            stats["spec_decode"] = self.speculator.stats.as_dict()
            draft = stats["draft_runner"] = self.speculator.runner_stats()
            if draft is not None:  # compile_s: every graph this engine compiled, the draft's included
                stats["compile_s"] += draft["compile_s"] + draft["greedy_loop_compile_s"]
        return stats

    def pipeline_stats(self) -> list[dict] | None:
        """Pipeline parallelism: each stage of this replica's busy and idle time so far, and its idle
        fraction over all steps and over decode-only ones (parallel.pipeline.StageStats), stage order;
        None without pipeline parallelism. A collective: every rank of the replica must call it."""
        if self.pp is None:
            return None
        by_stage = {}
        for entry in self.pp.all_stats():
            by_stage.setdefault(entry["stage"], entry)  # a stage's TP ranks wait alike: its first speaks
        return [by_stage[i] for i in sorted(by_stage)]

    def get_metrics(self) -> list:
        """vLLM's metric reader objects (toolkit/metrics.py), named toolkit:*."""
        from toolkit.metrics import Counter, Gauge

        prefix = self.scheduler.prefix_cache_stats
        metrics = [Gauge("toolkit:num_requests_running", value=self.scheduler.num_running),
                   Gauge("toolkit:num_requests_waiting", value=self.scheduler.num_waiting),
                   Counter("toolkit:prefix_cache_queries", value=prefix.queries),
                   Counter("toolkit:prefix_cache_hits", value=prefix.hits),
                   Counter("toolkit:prefix_cache_hits_tier", {"tier": "device"}, prefix.device_hits)]
        if self._kv_mover is not None:
            metrics += self._kv_mover.metrics()
        if self.speculator is not None:
            metrics += self.speculator.stats.metrics()
        metrics += self._moe_metrics(Counter)
        if self.pp is not None:
            stage, stats = {"stage": str(self.pp.stage.index)}, self.pp.stats
            metrics += [Counter("toolkit:pp_stage_busy_seconds", stage, stats.busy_s),
                        Counter("toolkit:pp_stage_idle_seconds", stage, stats.idle_s),
                        Counter("toolkit:pp_plans", stage, stats.plans)]
        if self.ep is not None:
            ep = self.ep.stats
            metrics += [Counter("toolkit:ep_all_to_all_bytes", {"direction": "dispatch"}, ep.dispatch_bytes),
                        Counter("toolkit:ep_all_to_all_bytes", {"direction": "combine"}, ep.combine_bytes),
                        Gauge("toolkit:ep_all_to_all_seconds", value=ep.all_to_all_s),
                        Counter("toolkit:ep_dummy_steps", value=self._lockstep.dummy_steps if self._lockstep else 0)]
        return metrics

    def _ep_stats(self) -> dict:
        """This rank's experts and its all-to-all traffic and time since start (parallel.EPStats), and,
        with replicas in lockstep, the steps they agreed on and the dummy forwards this replica ran."""
        ep = self.ep
        stats = {"experts": [ep.experts.start, ep.experts.stop], "ranks": ep.size, **ep.stats.as_dict()}
        if self._lockstep is not None:
            stats.update(lockstep_steps=self._lockstep.steps, dummy_steps=self._lockstep.dummy_steps)
        return stats

    def _moe_metrics(self, Counter) -> list:
        """toolkit:moe_expert_tokens{layer, expert}: (token, slot) pairs routed to each expert since start
        (under expert parallelism, those this rank's experts computed)."""
        from toolkit.models.moe import expert_token_counts

        return [Counter("toolkit:moe_expert_tokens", {"layer": str(layer), "expert": str(e)}, int(n))
                for layer, counts in expert_token_counts(self.runner.model) for e, n in enumerate(counts.tolist())]

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget the prefix cache (device and CPU tier; the disk tier is kept). False while requests run."""
        return self.scheduler.reset_prefix_cache()

    def request_output_len(self, request_id: str) -> int:
        """Tokens generated so far by a running sequence (the scheduler's count)."""
        return len(self.scheduler.get_request(request_id).output_token_ids)

    def _log_kv_cache(self) -> None:
        kv = self.runner.kv_spec
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %d bytes/token); "
            "max concurrency at max_model_len %d: %.2f requests",
            kv.num_blocks, kv.block_size, kv.num_tokens, kv.bytes / 2**20, kv.bytes_per_token,
            self.max_model_len, kv.num_tokens / self.max_model_len,
        )

    # --- requests in -----------------------------------------------------------------------

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
            raise ValueError(
                f"{where} has {len(prompt_token_ids)} tokens, more than max_model_len {self.max_model_len}"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"{where} has token ids outside the vocabulary [0, {self.model_config.vocab_size}): {bad[:5]}")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.validate()  # fields may have changed since the SamplingParams was built
        params.check_vocab(self.model_config.vocab_size)
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"request {request_id!r} has priority {priority} but scheduling_policy is "
                             f"{self.config.scheduling_policy!r}; pass scheduling_policy='priority'")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt of request {request_id!r} must be a string, got {type(cache_salt).__name__}")
        self.validate_prompt(prompt_token_ids, f"prompt of request {request_id!r}")
        if self.disagg is not None:  # every rank is fed every request; the role keeps its own
            self.disagg.add_request(self, request_id, prompt_token_ids, params, prompt, priority, arrival_time,
                                    cache_salt)
            return
        self._add_request(request_id, prompt_token_ids, params, prompt, priority, arrival_time, cache_salt)

    def _add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     prompt: str | None, priority: int, arrival_time: float | None, cache_salt: str | None) -> None:
        """A checked request into this engine's scheduler (as its n sequences)."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = _Group(request_id, prompt, list(prompt_token_ids), RequestMetrics(arrival_time=arrival))
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(prompt_token_ids)
        self._groups[request_id] = group
        max_tokens = params.max_tokens or self.max_model_len - len(prompt_token_ids)
        stop_ids = frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            # Each of the n sequences draws its own stream: a seeded request stays reproducible.
            child_params = params if params.seed is None or index == 0 else _with_seed(params, child_seed(params.seed, index))
            req = Request(
                request_id=child_id,
                prompt_token_ids=list(prompt_token_ids),
                max_tokens=max_tokens,
                min_tokens=params.min_tokens,
                stop_token_ids=stop_ids,
                priority=priority,
                arrival_time=arrival,
                cache_salt=cache_salt,
                # One sequence computes the prompt's logprobs; the others may still share cached blocks.
                wants_prompt_logits=index == 0 and params.prompt_logprobs is not None and len(prompt_token_ids) > 1,
            )
            group.children.append(child_id)
            self._tracked[child_id] = _Tracked(
                req,
                request_id,
                index,
                child_params,
                None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child_params),
                [] if params.logprobs is not None else None,
            )
            self.sampler.add_request(child_id, child_params)
            self.scheduler.add_request(req)

    def serves(self, request_id: str) -> bool:
        """Whether step() will return this request's output here: always, except in a disaggregated
        job, where its decode instance does (toolkit/disaggregated.py)."""
        return self.disagg is None or self.disagg.serves(request_id)

    @property
    def num_unfinished_requests(self) -> int:
        """User requests this engine holds (a disaggregated decode instance: with those whose prefill
        has not come yet)."""
        return len(self._groups) + (self.disagg.num_awaited if self.disagg is not None else 0)

    def abort_request(self, request_id: str) -> None:
        group = self._groups.get(request_id)
        for child in list(group.children) if group else ():
            if child in self._tracked:
                self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
                self._finish_child(self._tracked[child].request)

    def has_unfinished(self) -> bool:
        """Whether requests are in flight. With data-parallel replicas in lockstep (expert parallelism,
        dp > 1) it is whether ANY replica still has some, agreed by every rank in one collective, so
        every replica's loop `while engine.has_unfinished(): engine.step()` runs the same steps and ends
        at the same one: there it must be called once per step, on every rank."""
        if self.disagg is not None:
            return self.disagg.has_unfinished(self)
        if self._lockstep is None:
            busy = bool(self._groups)
            if not busy and self.pp is not None:
                self.pp.drain()  # every rank of the replica sees no request left at the same step
            return busy
        return self._lockstep.any_busy(bool(self._groups))

    # --- one step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns the user requests that finished in it.

        Replicas in lockstep (expert parallelism with dp > 1; see has_unfinished): a replica whose step
        ran no forward (nothing of its own scheduled) runs a one-token dummy forward instead, so every
        rank enters each MoE layer's all-to-all once per step (vLLM's dummy batch)."""
        if self.pp is not None:
            return self._step_pipelined()
        if self.disagg is not None:
            return self.disagg.step(self)
        if self._lockstep is None:
            return self._step()
        forwards = self.runner.num_forwards
        finished = self._step()
        if self.runner.num_forwards == forwards:
            self.runner.execute_dummy()
            self._lockstep.dummy_steps += 1
        return finished

    def _step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        finished: list[RequestOutput] = []
        for req in plan.rejected:
            finished += self._finish_child(req)
        requeued = self._transfer_kv(plan)
        if not plan.scheduled and requeued:
            return finished  # every scheduled request lost a load: they recompute from the next step
        if not plan.scheduled:
            self._check_progress(plan)
            return finished
        self._mark_scheduled(plan)
        if self.speculator is not None:
            self.speculator.forget(plan.preempted)
        try:
            result = self._run_model(plan)
        except Exception as exc:  # noqa: BLE001  one bad step must not poison the engine
            if not self._can_isolate(exc):
                raise
            return finished + self._fail_step(plan, exc)
        finished += self._retire(plan, result)
        if self.speculator is not None:
            finished += self._propose()
        if self.kv_tiers is not None and not self.scheduler.has_unfinished():
            # Idle now: the blocks the last update named go to the tiers before anything can reuse them.
            self.kv_tiers.transfer(self.scheduler.pending_transfers())
        return finished

    def _step_pipelined(self) -> list[RequestOutput]:
        """One turn of a pipeline stage (parallel/pipeline.py): while fewer than pp plans are in flight,
        schedule one more (over requests none of them holds) and run this stage's layers for it;
        otherwise retire the oldest plan with the tokens the last stage sends back. Every rank of the
        replica takes the same turns in the same order, so their schedulers stay in lockstep."""
        finished: list[RequestOutput] = []
        with self.pp.timed_step() as turn:
            plan = None
            if len(self._in_flight) < self.config.pipeline_parallel_size:
                plan = self.scheduler.schedule()
                for req in plan.rejected:
                    finished += self._finish_child(req)
                if plan.scheduled:
                    self._mark_scheduled(plan)
                    self._in_flight.append(plan)
                    turn.decode, turn.in_flight = _decode_only(plan), len(self._in_flight)
                    self.pp.stats.plans += 1
                    self._run_stage(plan)
                    return finished
            if not self._in_flight:
                self._check_progress(plan)
                return finished
            oldest = self._in_flight.popleft()
            turn.decode = _decode_only(oldest)
            return finished + self._retire(oldest, self.pp.take_result())

    def _run_stage(self, plan: SchedulerOutput) -> None:
        """This stage's part of a plan: the previous stage's hidden states in (or the embedding), its
        layers, then the hidden states on to the next stage, or, on the last stage, the sampled tokens
        out to every rank of the replica."""
        pp = self.pp
        inputs = self.runner.prepare(plan.scheduled)
        hidden = None
        if not pp.stage.is_first:
            hidden = pp.recv_hidden((inputs.input_ids.shape[0], self.model_config.hidden_size), self.dtype,
                                    self.device)
        start = time.perf_counter()
        out = self.runner.execute(inputs, hidden)
        pp.stats.compute_s += time.perf_counter() - start
        if not pp.stage.is_last:
            pp.send_hidden(out)
            return
        result = self._sample(plan, inputs, out)
        if pp.is_result_src:
            pp.post_result(result)

    def _check_progress(self, plan: SchedulerOutput | None) -> None:
        if self.scheduler.has_unfinished() and not (plan is not None and plan.rejected):
            raise RuntimeError("scheduler made no progress with requests pending (a bug: please report)")

    def _mark_scheduled(self, plan: SchedulerOutput) -> None:
        now = time.monotonic()
        for r in plan.scheduled:
            metrics = self._groups[self._tracked[r.request_id].parent_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now

    def _retire(self, plan: SchedulerOutput, result: _StepResult) -> list[RequestOutput]:
        """Hand a computed plan's tokens to the scheduler, then logprobs and text; returns the user
        requests that finished."""
        self._store_prompt_logprobs(plan, result.prompt_logprobs)
        sampled, now = result.sampled, time.monotonic()
        for rid in sampled:
            metrics = self._groups[self._tracked[rid].parent_id].metrics
            metrics.first_token_time = metrics.first_token_time or now
        before = {rid: self._tracked[rid].request.num_output_tokens for rid in sampled}
        done = self.scheduler.update(plan, sampled)
        done += self._append_outputs(sampled, result.logprobs, before)
        finished = []
        for req in done:
            finished += self._finish_child(req)
        return finished

    def _propose(self) -> list[RequestOutput]:
        """Drafts for the next step; if the proposer fails, the requests it was drafting for fail alone."""
        try:
            self.speculator.propose(self.scheduler, lambda rid: self._tracked[rid].params, self.max_model_len)
            return []
        except Exception as exc:  # noqa: BLE001
            if not self._can_isolate(exc):
                raise
            victims = self.scheduler.decoding_requests()
            log.error("drafting for %d requests failed; they end with finish_reason='error'", len(victims),
                      exc_info=exc)
            finished = []
            for req in victims:
                self._fail_request(req, f"drafting failed: {type(exc).__name__}: {exc}")
                finished += self._finish_child(req)
            return finished

    def _can_isolate(self, exc: Exception) -> bool:
        """Whether a failed step can be ended for its requests alone. Not under TP or PP: a rank that failed
        alone would leave the others' schedulers out of step, so the job ends (as any TP fault does).
        Not for a broken process group either."""
        return (self.tp is None and self.ep is None and self.pp is None
                and not isinstance(exc, torch.distributed.DistError))

    def _fail_step(self, plan: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """Fail the step's requests alone. The scheduler advances computed tokens and names cached
        blocks only in update(), which this step never reached, so nothing it half-wrote is reused."""
        log.error("a step of %d requests failed; they end with finish_reason='error'", len(plan.scheduled),
                  exc_info=exc)
        reason = f"the engine step failed: {type(exc).__name__}: {exc}"
        finished = []
        for scheduled in plan.scheduled:
            tracked = self._tracked.get(scheduled.request_id)
            if tracked is None:
                continue
            self._fail_request(tracked.request, reason)
            finished += self._finish_child(tracked.request)
        return finished

    def _fail_request(self, req: Request, reason: str) -> None:
        req.error = reason
        if req.status.is_finished:
            req.status = RequestStatus.FINISHED_ERROR
        else:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)

    def _transfer_kv(self, plan: SchedulerOutput) -> list[str]:
        """Run the step's block copies (tiers, swaps); returns the requests taken out of the step
        because a load failed (they go back to waiting and recompute)."""
        if not plan.kv_transfer:
            return []
        failed = self._kv_mover.transfer(plan.kv_transfer)
        requeued = self.scheduler.transfers_failed(plan, failed) if failed else []
        if self.speculator is not None and requeued:
            self.speculator.forget(requeued)
        return requeued

    def _run_model(self, plan: SchedulerOutput) -> _StepResult:
        inputs = self.runner.prepare(plan.scheduled)
        return self._sample(plan, inputs, self.runner.execute(inputs))

    def _sample(self, plan: SchedulerOutput, inputs, logits: torch.Tensor) -> _StepResult:
        """The tokens (and their logprob entries) each sampling request gets from this step's logits: one,
        or after a verify step its accepted drafts and one more; and the prompt rows' logprob entries."""
        prompt_entries = []
        if inputs.num_prompt_rows:
            num_sampled = logits.shape[0] - inputs.num_prompt_rows
            prompt_entries = self._prompt_logprob_entries(plan, logits[num_sampled:])
            logits = logits[:num_sampled]
        sampling = [r for r in plan.scheduled if r.samples]
        if not sampling:
            return _StepResult({}, {}, prompt_entries)
        ids = [r.request_id for r in sampling]
        reqs = [self._tracked[i].request for i in ids]
        params = [self._tracked[i].params for i in ids]
        if self.speculator is not None and any(r.num_draft_tokens for r in sampling):
            verified = self.speculator.verify(logits, plan, reqs, params)
            tokens, logprobs = verified.token_ids, verified.logprobs
        else:
            out = self.sampler(logits, ids, params, [r.prompt_token_ids for r in reqs],
                               [r.output_token_ids for r in reqs])
            token_ids = out.token_ids
            if self.tp is not None:
                # SPMD: every rank's scheduler must append the same tokens, so TP rank 0's choice wins.
                token_ids = self.tp.broadcast_tokens(token_ids)
            tokens, logprobs = [[t] for t in token_ids], [[lp] for lp in out.logprobs]
        return _StepResult(dict(zip(ids, tokens)), dict(zip(ids, logprobs)), prompt_entries)

    def _append_outputs(self, sampled: dict[str, list[int]], logprobs: dict[str, list],
                        before: dict[str, int]) -> list[Request]:
        """Logprobs and text for the tokens the scheduler appended (a stop token or a length limit may
        have cut a verified run); returns the requests a stop string has just finished. A stop string
        ends a run at the token that completes it, as it would have in plain decoding."""
        stopped = []
        for rid in sampled:
            tracked = self._tracked[rid]
            req = tracked.request
            new = req.output_token_ids[before[rid]:]
            try:
                kept, stop = self._detokenize(tracked, new)
            except Exception as exc:  # noqa: BLE001  e.g. a token id the tokenizer does not know
                self._fail_request(req, f"detokenizing tokens {new} failed: {type(exc).__name__}: {exc}")
                stopped.append(req)
                continue
            del req.output_token_ids[before[rid] + kept:]
            if tracked.logprobs is not None:
                for token, lp in zip(new[:kept], logprobs[rid]):
                    if lp is not None:
                        tracked.logprobs.append(self._with_text(lp))
                        tracked.cumulative_logprob += lp[token].logprob
            if stop is None:
                continue
            if req.status.is_finished:
                req.status = RequestStatus.FINISHED_STOPPED  # the stop string wins over a length cut
            else:
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
                stopped.append(req)
            req.stop_reason = stop
        return stopped

    def _prompt_logprob_entries(self, plan: SchedulerOutput, logits: torch.Tensor) -> list:
        """Prompt logprob entries from this step's prompt rows (in scheduled order): the logits at
        position p give prompt token p + 1's entry."""
        targets, ks = [], []
        for r in plan.scheduled:
            if r.num_prompt_logits:
                tracked = self._tracked[r.request_id]
                first = r.start_position + 1
                targets += tracked.request.prompt_token_ids[first: first + r.num_prompt_logits]
                ks += [tracked.params.prompt_logprobs] * r.num_prompt_logits
        return logprob_entries(logits, torch.tensor(targets, device=logits.device), ks)

    def _store_prompt_logprobs(self, plan: SchedulerOutput, entries: list) -> None:
        """Put a step's prompt logprob entries in their groups. A recompute after preemption writes the
        same entries again."""
        at = 0
        for r in plan.scheduled:
            if not r.num_prompt_logits:
                continue
            tracked, first, n = self._tracked[r.request_id], r.start_position + 1, r.num_prompt_logits
            self._groups[tracked.parent_id].prompt_logprobs[first: first + n] = map(self._with_text, entries[at: at + n])
            at += n
            if first + n == tracked.request.num_prompt_tokens:
                tracked.request.wants_prompt_logits = False  # all computed: a recompute may use the cache

    def _with_text(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        """vLLM's decoded_token: each token decoded alone, special tokens shown."""
        if self.tokenizer is not None:
            for token, lp in entry.items():
                lp.decoded_token = self.tokenizer.decode([token])
        return entry

    @staticmethod
    def _detokenize(tracked: _Tracked, tokens: list[int]) -> tuple[int, str | None]:
        """(how many of the tokens to keep, the stop string they completed or None)."""
        detokenizer = tracked.detokenizer
        if detokenizer is None:
            return len(tokens), None  # token ids only: no text, no stop strings
        if len(tokens) == 1:
            return 1, detokenizer.add_tokens(tokens)
        for n, token in enumerate(tokens, 1):
            stop = detokenizer.add_tokens([token])
            if stop is not None:
                return n, stop
        return len(tokens), None

    def _stop_reason(self, req: Request, params: SamplingParams) -> int | str | None:
        """vLLM's: the stop string or stop_token_ids entry that ended the request; None for EOS."""
        reason = req.stop_reason
        if isinstance(reason, int) and reason in self.eos_token_ids and reason not in (params.stop_token_ids or ()):
            return None
        return reason

    def _finish_child(self, req: Request) -> list[RequestOutput]:
        tracked = self._tracked.get(req.request_id)
        if tracked is None or not req.status.is_finished:
            return []
        del self._tracked[req.request_id]
        self.sampler.remove_request(req.request_id)
        if self.speculator is not None:
            self.speculator.forget([req.request_id])
        group = self._groups[tracked.parent_id]
        group.done[tracked.index] = CompletionOutput(
            index=tracked.index,
            text=tracked.detokenizer.output_text if tracked.detokenizer else "",
            token_ids=list(req.output_token_ids),
            cumulative_logprob=tracked.cumulative_logprob if tracked.logprobs is not None else None,
            logprobs=tracked.logprobs,
            finish_reason=FINISH_REASONS[req.status],
            stop_reason=self._stop_reason(req, tracked.params),
        )
        group.error = group.error or req.error
        if tracked.index == 0:
            group.num_cached_tokens = max(0, req.num_cached_tokens)
        if len(group.done) < len(group.children):
            return []
        del self._groups[group.request_id]
        group.metrics.finished_time = time.monotonic()
        return [
            RequestOutput(
                request_id=group.request_id,
                prompt=group.prompt,
                prompt_token_ids=group.prompt_token_ids,
                outputs=[group.done[i] for i in sorted(group.done)],
                finished=True,
                metrics=group.metrics,
                error=group.error,
                num_cached_tokens=group.num_cached_tokens,
                prompt_logprobs=group.prompt_logprobs,
            )
        ]


def _decode_only(plan: SchedulerOutput) -> bool:
    return all(len(r.token_ids) == 1 and r.samples for r in plan.scheduled)


def _load_model_config(config: EngineConfig) -> ModelConfig:
    try:
        return load_model_config(config.model)
    except UnsupportedModelError as e:
        if not config.trust_remote_code:
            raise
        raise UnsupportedModelError(f"{e}; trust_remote_code=True cannot help: the toolkit never runs a "
                                    "checkpoint's own code, only the architectures it implements") from None


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)
