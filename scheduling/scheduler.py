"""Continuous batching in tokens, not phases (the vLLM V1 idea).

Every request has `num_computed_tokens`; a step gives each scheduled request some new tokens. A prefill
chunk, a decode (1 token) and a recompute after preemption (computed tokens reset to 0) are the same
operation, bounded by a per-step token budget and by the free KV blocks.

Speculative decoding adds one more: a decoding request with draft tokens (`Request.spec_token_ids`)
is scheduled for 1 + k tokens, its last token then the drafts, all in one step; `update` then counts
as computed only the drafts the model accepted, so the KV slots of rejected ones are written again
by the next step. `num_lookahead_tokens` reserves KV slots beyond a sampling chunk for a draft model,
which writes its own KV for the drafts it proposes after the step, into the same block tables.

Prefix caching makes a prefix hit one more: a new request starts with `num_computed_tokens` at its
longest cached prefix, on the device (shared blocks) or in a KV connector's tiers (blocks loaded by
the step's `kv_transfer` plan before its forward), and only the rest is scheduled.

Several plans may be in flight at once (`max_plans_in_flight`, for pipeline stages): a request
scheduled in a plan whose `update` has not come is neither scheduled again nor preempted, and each
plan takes at most 1/depth of the live requests and 1/depth of the token budget, so the plans in
flight stay about equal and hold one step's tokens between them (a prompt's chunks spread over the
plans instead of making one much longer than the next, which would idle the stages in turn).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .kv_transfer import BlockCopy, KVConnectorScheduler, KVTransferPlan
from .request import Request, RequestStatus

POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"
    num_lookahead_tokens: int = 0
    enable_prefix_caching: bool = False
    preemption_mode: str = "recompute"  # "swap" needs a connector with a CPU tier (kv_tiers.py)
    # Step plans that may be in flight at once (pipeline parallelism: one per stage). Each plan then takes
    # at most 1/depth of the live requests and of max_num_batched_tokens, so the plans in flight stay
    # about the same size.
    max_plans_in_flight: int = 1

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "max_plans_in_flight"):
            value = getattr(self, name)
            # bool is an int subclass; True as a block count is a bug, not a 1.
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be a positive integer (>= 1), got {value!r}")
        if not isinstance(self.num_lookahead_tokens, int) or self.num_lookahead_tokens < 0:
            raise ValueError(f"SchedulerConfig.num_lookahead_tokens must be an integer >= 0, "
                             f"got {self.num_lookahead_tokens!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"SchedulerConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"SchedulerConfig.preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    samples: bool
    num_draft_tokens: int = 0  # the last this many of token_ids are drafts to verify
    num_prompt_logits: int = 0  # the first this many of token_ids also want logits: their next token is a prompt token


    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)
    kv_transfer: KVTransferPlan | None = None  # block copies to run before the forward (kv_transfer.py)
    # Requests that ended since the last plan, and those a failed KV load sent back to waiting: per-request
    # state outside the scheduler (the sampler's, a draft proposer's) is dropped from these, not by hand.
    finished_ids: list[str] = field(default_factory=list)
    requeued: list[str] = field(default_factory=list)

    @property
    def released(self) -> list[str]:
        """Requests whose blocks were freed since the last plan (finished, preempted or requeued)."""
        return self.finished_ids + self.preempted + self.requeued


@dataclass
class PrefixCacheStats:
    """In tokens, since the scheduler started: prompt tokens looked up at admission, and those found
    cached on the device or in a connector's tiers (vLLM's prefix_cache_queries / _hits)."""

    queries: int = 0
    hits: int = 0
    device_hits: int = 0
    external_hits: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, connector: KVConnectorScheduler | None = None):
        self.config = config
        self.connector = connector
        if config.preemption_mode == "swap" and not hasattr(connector, "swap_out"):
            raise ValueError("preemption_mode='swap' needs a KV connector with a CPU tier to swap to")
        self.kv_cache = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.prefix_cache_stats = PrefixCacheStats()
        self._admissions: dict[str, tuple[int, int, int]] = {}  # this step's (queried, device, external) tokens
        self._first_admitted: set[str] = set()  # requests whose num_cached_tokens this step's admission set
        self._requests: dict[str, Request] = {}  # live requests only: waiting, preempted or running
        self._keys: dict[str, tuple] = {}  # service order: a smaller key is admitted first and preempted last
        self._waiting: list[tuple[tuple, Request]] = []  # a heap on the key
        self._running: list[Request] = []  # sorted by key
        self._rejected: list[Request] = []  # failed alone, to report in the next SchedulerOutput
        # Scheduled in a plan whose update() has not come yet (several plans in flight: pipeline
        # parallelism). Such a request is neither scheduled again nor preempted until it has.
        self._in_step: set[str] = set()
        self._finished_ids: list[str] = []  # since the last plan (SchedulerOutput.finished_ids)
        self._arrivals = itertools.count()
        self.num_preemptions = 0  # since start

    # ---- requests in and out ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        if request.status is not RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id!r} is added with status {request.status.name}")
        error = self._rejection_reason(request)
        if error is not None:
            request.status = RequestStatus.FINISHED_ERROR
            request.error = error
            self._rejected.append(request)
            if self.connector is not None:  # it ends here, holding no block (a prefill instance says so)
                self.connector.request_finished(request, [])
            return
        key = (request.arrival_time, next(self._arrivals))
        if self.config.policy == "priority":
            key = (request.priority,) + key
        self._keys[request.request_id] = key
        self._requests[request.request_id] = request
        heapq.heappush(self._waiting, (key, request))

    def _rejection_reason(self, request: Request) -> str | None:
        """Why the request can never run, even with the whole cache to itself, or None."""
        prompt, max_len = request.num_prompt_tokens, self.config.max_model_len
        if prompt == 0:
            return "the prompt is empty; a request needs at least 1 prompt token"
        if prompt > max_len:
            return (
                f"the prompt has {prompt} tokens but max_model_len is {max_len}; "
                f"shorten the prompt or raise max_model_len"
            )
        if request.max_tokens < 1:
            return f"max_tokens must be at least 1, got {request.max_tokens}"
        # A request may need KV for every token it can ever hold, so it must fit in the cache alone:
        # that is what guarantees the oldest running request always makes progress (no deadlock).
        total = min(prompt + request.max_tokens, max_len)
        needed = self.kv_cache.num_blocks_for(total)
        if needed <= self.config.num_blocks:
            return None
        capped = f", capped at max_model_len {max_len}" if total < prompt + request.max_tokens else ""
        return (
            f"request needs {needed} KV blocks (prompt {prompt} + max_tokens {request.max_tokens} tokens"
            f"{capped}, at block size {self.config.block_size}) but the cache has only "
            f"{self.config.num_blocks}; raise the KV memory or lower max_tokens"
        )

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request early (abort, or a stop string found by the engine). Unknown or finished ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"finish_request needs a finished status, got {status.name}")
        request = self._requests.get(request_id)
        if request is None:
            return
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting = [entry for entry in self._waiting if entry[1] is not request]
            heapq.heapify(self._waiting)
        self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if self.connector is not None:
            self.connector.request_finished(request, self.kv_cache.block_table(request.request_id))
        self.kv_cache.free(request)
        del self._requests[request.request_id]
        del self._keys[request.request_id]
        self._in_step.discard(request.request_id)
        self._finished_ids.append(request.request_id)

    def has_unfinished(self) -> bool:
        # Pending rejections count: the engine must call schedule() once more to report them.
        return bool(self._requests or self._rejected)

    def decoding_requests(self) -> list[Request]:
        """Running requests whose next step is a decode (one token to feed): the ones drafts are for."""
        return [r for r in self._running if r.num_tokens - r.num_computed_tokens == 1]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block on the device and in the CPU tier (benchmarks, tests); False,
        changing nothing, while requests hold blocks."""
        if self._requests or not self.kv_cache.block_pool.reset():
            return False
        if hasattr(self.connector, "reset"):
            self.connector.reset()
        return True

    def holds(self, request_id: str) -> bool:
        """Whether the request is live here (waiting, preempted or running)."""
        return request_id in self._requests

    def get_request(self, request_id: str) -> Request:
        """A live (waiting, preempted or running) request; finished ones have left the scheduler."""
        return self._requests[request_id]

    @property
    def num_in_step(self) -> int:
        """Requests scheduled in plans still in flight (awaiting their update())."""
        return len(self._in_step)

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache.num_free_blocks

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(rejected=self._rejected, finished_ids=self._finished_ids)
        self._rejected, self._finished_ids = [], []
        budget = plan_budget = -(-self.config.max_num_batched_tokens // self.config.max_plans_in_flight)
        ready = [r for r in self._running if r.request_id not in self._in_step]
        decodes = [r for r in ready if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in ready if r.num_tokens - r.num_computed_tokens > 1]
        cap = self._plan_cap()
        for request in decodes + prefills:
            if budget == 0 or len(out.scheduled) >= cap:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step to make room for an older request
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            num_drafts = min(len(request.spec_token_ids), budget - num_new) if num_new == 1 else 0
            block_table, refund, num_drafts = self._allocate_or_preempt(request, num_new, out, num_drafts)
            budget += refund
            if block_table is not None:
                out.scheduled.append(self._scheduled(request, num_new, block_table, num_drafts))
                budget -= num_new + num_drafts
        # After a preemption blocks are short, and the head of the waiting queue is now the request
        # just preempted, which must not run in the step that preempted it.
        if not out.preempted:
            budget = self._admit_waiting(budget, out, cap)
        out.num_batched_tokens = plan_budget - budget
        self._in_step.update(scheduled.request_id for scheduled in out.scheduled)
        if self.connector is not None:
            self.connector.blocks_evicted(self.kv_cache.block_pool.drain_evicted())
            out.kv_transfer = self.connector.build_plan()
        else:
            self.kv_cache.block_pool.drain_evicted()
        return out

    def _plan_cap(self) -> int:
        """Requests one plan may take: all, or with several plans in flight 1/depth of the live ones."""
        depth = self.config.max_plans_in_flight
        return self.config.max_num_seqs if depth == 1 else max(1, -(-len(self._requests) // depth))

    def _allocate_or_preempt(
        self, request: Request, num_new: int, out: SchedulerOutput, num_drafts: int = 0
    ) -> tuple[list[int] | None, int, int]:
        """Blocks for the request's new tokens, preempting the last-served running requests until they fit.

        Returns (block table or None when the request itself was preempted, tokens refunded to the budget
        by victims that had already been scheduled in this step, drafts kept).
        """
        refund = 0
        while True:
            block_table, kept = self._allocate(request, num_new, num_drafts)
            if block_table is not None:
                return block_table, refund, kept
            # The last-served request not awaiting a plan in flight (its KV is being written there).
            victim = next(r for r in reversed(self._running) if r.request_id not in self._in_step)
            if victim is request and self._in_step:
                return None, refund, 0  # rather than preempt itself, wait for a plan in flight to return
            if victim is request and len(self._running) == 1:
                # add_request only admits requests that fit the whole cache; reaching here is a bug,
                # and raising beats preempting the request forever.
                raise RuntimeError(f"request {request.request_id!r} cannot get KV blocks even alone in the cache")
            refund += self._preempt(victim, out)
            if victim is request:
                return None, refund, 0

    def _allocate(self, request: Request, num_new: int, num_drafts: int = 0,
                  cached: list[int] = ()) -> tuple[list[int] | None, int]:
        """(block table or None, drafts kept) for num_new tokens, their drafts and a draft model's
        lookahead slots. Speculation gives way first: lookahead slots, then the drafts, are dropped
        before the caller preempts anyone for them (a step without drafts costs less than a recompute)."""
        full = num_new + num_drafts
        for num_slots, kept in dict.fromkeys([(full + self._lookahead(request, full), num_drafts), (full, num_drafts),
                                               (num_new, 0)]):
            block_table = self.kv_cache.allocate_slots(request, num_slots, cached)
            if block_table is not None:
                return block_table, kept
        return None, 0

    def _lookahead(self, request: Request, num_new: int) -> int:
        """Slots beyond the chunk for a draft model's KV, when the request decodes after it (the chunk
        samples, or recomputes all but the last token after a preemption); never past what the request
        can ever hold, so a request that fits the cache alone still does."""
        end = request.num_computed_tokens + num_new
        if self.config.num_lookahead_tokens == 0 or end < request.num_tokens - 1:
            return 0
        cap = min(request.max_num_tokens, self.config.max_model_len)
        return max(0, min(self.config.num_lookahead_tokens, cap - end))

    def _preempt(self, victim: Request, out: SchedulerOutput) -> int:
        """Preempt by recompute, or by swapping its KV out to the CPU tier; returns the tokens the victim
        had been given in this step, if any."""
        if self.config.preemption_mode == "swap" and victim.num_computed_tokens > 0:
            table = self.kv_cache.block_table(victim.request_id)
            self.connector.swap_out(victim, table[:self.kv_cache.num_blocks_for(victim.num_computed_tokens)])
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim.request_id)
        return self._requeue(victim, out)

    def _requeue(self, request: Request, out: SchedulerOutput) -> int:
        """Free a running request's blocks and put it back in the waiting queue (its service key kept,
        so under fcfs it returns ahead of everything that arrived after it)."""
        self._running.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        self._in_step.discard(request.request_id)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        heapq.heappush(self._waiting, (self._keys[request.request_id], request))
        for i, scheduled in enumerate(out.scheduled):
            if scheduled.request_id == request.request_id:
                del out.scheduled[i]
                return scheduled.num_new_tokens
        return 0

    def _admit_waiting(self, budget: int, out: SchedulerOutput, cap: int) -> int:
        in_flight = self._prompt_blocks_in_flight()
        deferred = []
        while (self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs
               and len(out.scheduled) < cap):
            request = self._waiting[0][1]
            if in_flight and self._next_block_in_flight(request, in_flight):
                # A running request is computing this prompt's next block: wait a step or two and
                # share it, rather than compute the same KV twice (the requests behind may go first).
                deferred.append(heapq.heappop(self._waiting))
                continue
            admitted = self._admit(request, budget)
            if admitted is None:
                break  # no later request may jump the head of the line, or it could starve
            block_table, num_new = admitted
            heapq.heappop(self._waiting)
            request.status = RequestStatus.RUNNING
            bisect.insort(self._running, request, key=lambda r: self._keys[r.request_id])
            out.scheduled.append(self._scheduled(request, num_new, block_table))
            budget -= num_new
            if in_flight is not None:
                in_flight.update(self._uncomputed_prompt_blocks(request))
        for entry in deferred:
            heapq.heappush(self._waiting, entry)
        return budget

    def _prompt_blocks_in_flight(self) -> set | None:
        """Names of the full prompt blocks running requests have still to compute (None without caching)."""
        if not self.config.enable_prefix_caching or not self._waiting:
            return None  # (nobody to defer: no need to walk the running requests every step)
        return {h for r in self._running if r.num_computed_tokens < r.num_prompt_tokens
                for h in self._uncomputed_prompt_blocks(r)}

    def _uncomputed_prompt_blocks(self, request: Request) -> list:
        hashes = self.kv_cache.block_hashes(request)
        return hashes[request.num_computed_tokens // self.config.block_size:
                      request.num_prompt_tokens // self.config.block_size]

    def _next_block_in_flight(self, request: Request, in_flight: set) -> bool:
        if request.wants_prompt_logits or self._held_tokens(request):
            return False  # it reads no cached block, so it gains nothing by waiting for one
        hit = len(self.kv_cache.cached_prefix(request))
        return hit < self.kv_cache.max_cached_blocks(request) and self.kv_cache.block_hashes(request)[hit] in in_flight

    def _admit(self, request: Request, budget: int) -> tuple[list[int], int] | None:
        """(block table, tokens to compute) for a waiting request, starting after whatever of it is
        already somewhere: its own KV held by the connector (swapped out, or prefilled by another
        instance), or its longest cached prefix on the device or in the
        connector's tiers (a prompt prefilled elsewhere: both, its held KV loaded after the prefix
        found here). None (taking nothing) when the blocks are short."""
        held = self._held_tokens(request)
        looks_up = not held or self.connector.held_after_prefix(request.request_id)
        cached, num_external, hashes = [], 0, []
        if looks_up and self.config.enable_prefix_caching and not request.wants_prompt_logits:
            cached = self.kv_cache.cached_prefix(request)
            if self.connector is not None:
                hashes = self.kv_cache.block_hashes(request)[len(cached):self.kv_cache.max_cached_blocks(request)]
                num_external = self.connector.num_matched_blocks(request, hashes)
        local = len(cached) + num_external  # blocks found here
        found = max(held, local * self.config.block_size)
        request.num_computed_tokens = found
        num_new = min(request.num_tokens - found, budget)
        block_table, _ = self._allocate(request, num_new, cached=cached)
        if block_table is None:
            request.num_computed_tokens = 0
            return None
        if num_external:
            self.connector.blocks_allocated(request, block_table[len(cached):local], hashes[:num_external])
        if held:  # the blocks found here are not loaded again
            self.connector.load_held(request, [-1] * local + block_table[local:self.kv_cache.num_blocks_for(held)])
        if looks_up and not request.wants_prompt_logits:
            self._admissions[request.request_id] = (request.num_tokens, len(cached) * self.config.block_size,
                                                    num_external * self.config.block_size)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = found
            self._first_admitted.add(request.request_id)
        return block_table, num_new

    def _held_tokens(self, request: Request) -> int:
        """Tokens of the request's own KV a connector holds (swapped out, or prefilled elsewhere)."""
        return self.connector.held_tokens(request.request_id) if self.connector is not None else 0

    def pending_transfers(self) -> KVTransferPlan | None:
        """Transfers planned since the last schedule() (blocks named by the last update, to be written
        through to a tier), for an engine that goes idle: no later step would carry them."""
        return self.connector.build_plan() if self.connector is not None else None

    def transfers_failed(self, output: SchedulerOutput, failed: list[BlockCopy]) -> list[str]:
        """The worker could not load these blocks: take every request that reads one out of the step
        and back to the waiting queue, where it recomputes those tokens. Returns their ids."""
        self.connector.transfers_failed(failed)
        bad = {copy.block_id for copy in failed}
        requeued, dropped = [], set()
        for scheduled in list(output.scheduled):
            if bad.isdisjoint(scheduled.block_table):
                continue
            dropped.update(scheduled.block_table)
            request = self._requests[scheduled.request_id]
            self._admissions.pop(request.request_id, None)
            if request.request_id in self._first_admitted:
                # The count was this admission's, which lost its load: the next admission counts instead.
                # (A request admitted before keeps the count of its first admission, as in vLLM.)
                request.num_cached_tokens = -1
            output.num_batched_tokens -= self._requeue(request, output)
            requeued.append(request.request_id)
        output.requeued += requeued
        # Their other loads arrived for nothing: the request recomputes, so no hit either side counts.
        self.connector.loads_dropped([c for c in output.kv_transfer.loads
                                      if c.block_id in dropped and c.block_id not in bad])
        return requeued

    @staticmethod
    def _scheduled(request: Request, num_new: int, block_table: list[int], num_drafts: int = 0) -> ScheduledRequest:
        start = request.num_computed_tokens
        token_ids = request.token_ids_slice(start, start + num_new)
        if num_drafts:
            token_ids = token_ids + request.spec_token_ids[:num_drafts]
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids,
            start_position=start,
            block_table=block_table,
            samples=start + num_new == request.num_tokens,
            num_draft_tokens=num_drafts,
            num_prompt_logits=max(0, min(start + num_new, request.num_prompt_tokens - 1) - start)
            if request.wants_prompt_logits else 0,
        )

    # ---- after the model ran ------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]],
               drafts: dict[str, list[int]] | None = None) -> list[Request]:
        """Advance the scheduled requests, append sampled tokens, run stop checks; returns the requests
        that finished (stopped or length) here. `drafts`: the next step's speculative tokens of requests
        that go on (proposed where the logits were, from the tokens this update appends)."""
        self._count_admissions()
        finished = []
        for scheduled in output.scheduled:
            self._in_step.discard(scheduled.request_id)
            request = self._requests.get(scheduled.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished by the engine (abort, stop string) between schedule and update
            if request.num_computed_tokens != scheduled.start_position:
                raise RuntimeError(
                    f"request {request.request_id!r} has {request.num_computed_tokens} computed tokens but the "
                    f"output starts at {scheduled.start_position}: update() called twice or on a stale output?"
                )
            request.spec_token_ids = []  # verified (or not scheduled) now; the next step gets new ones
            request.num_computed_tokens += scheduled.num_new_tokens - scheduled.num_draft_tokens
            if not scheduled.samples:
                self._name_computed_blocks(request)
                continue
            if scheduled.request_id not in sampled:
                raise KeyError(f"request {scheduled.request_id!r} was scheduled to sample but has no sampled token")
            tokens = sampled[scheduled.request_id]
            if not 1 <= len(tokens) <= scheduled.num_draft_tokens + 1:
                raise ValueError(f"request {scheduled.request_id!r} verified {scheduled.num_draft_tokens} drafts "
                                 f"but got {len(tokens)} tokens (1 to {scheduled.num_draft_tokens + 1} expected)")
            # Accepted drafts were computed in this step, at their final positions.
            request.num_computed_tokens += len(tokens) - 1
            status = self._append_and_check(request, tokens)
            self._name_computed_blocks(request)
            if status is not None:
                self._running.remove(request)
                self._finish(request, status)
                finished.append(request)
            elif drafts:
                request.spec_token_ids = list(drafts.get(request.request_id, ()))
        return finished

    def _name_computed_blocks(self, request: Request) -> None:
        named = self.kv_cache.cache_computed_blocks(request)
        if named and self.connector is not None:
            self.connector.blocks_computed(request, named)

    def _count_admissions(self) -> None:
        stats = self.prefix_cache_stats
        for queried, device, external in self._admissions.values():
            stats.queries += queried
            stats.device_hits += device
            stats.external_hits += external
            stats.hits += device + external
        self._admissions.clear()
        self._first_admitted.clear()

    def _append_and_check(self, request: Request, token_ids: list[int]) -> RequestStatus | None:
        """Append tokens until one finishes the request; tokens after it (speculative extras) are dropped."""
        for token_id in token_ids:
            request.append_output_token(token_id)
            if token_id in request.stop_token_ids and request.num_output_tokens >= request.min_tokens:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
                return RequestStatus.FINISHED_LENGTH
        return None
