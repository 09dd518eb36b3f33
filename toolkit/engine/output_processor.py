"""The output processor: what the engine core's results become for a user, outside the core.

It keeps, per user request, its n sequences (a group) and per sequence its sampling parameters, its
detokenizer and its logprobs; it turns each retired step's tokens into text, finds stop strings
(ending a run of verified drafts at the token that completes one, as plain decoding would), puts
decoded text on logprob entries, and assembles a group's `RequestOutput` once every sequence is done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from toolkit.detokenizer import IncrementalDetokenizer
from toolkit.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from toolkit.sampling_params import SamplingParams, child_seed
from toolkit.scheduling import Request, RequestStatus

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Tracked:
    """What is kept per scheduled sequence, beside the scheduler's Request."""

    request: Request
    parent_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0


@dataclass
class Group:
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


class OutputProcessor:
    def __init__(self, scheduler, tokenizer, eos_token_ids: frozenset[int], max_model_len: int):
        self.scheduler, self.tokenizer = scheduler, tokenizer
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.tracked: dict[str, Tracked] = {}
        self.groups: dict[str, Group] = {}

    # --- requests in ------------------------------------------------------------------------------

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None,
            priority: int, arrival: float, cache_salt: str | None) -> list[tuple[Request, SamplingParams]]:
        """A user request as its n sequences: returns each one's scheduler Request and parameters."""
        group = Group(request_id, prompt, list(prompt_token_ids), RequestMetrics(arrival_time=arrival))
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(prompt_token_ids)
        self.groups[request_id] = group
        max_tokens = params.max_tokens or self.max_model_len - len(prompt_token_ids)
        stop_ids = frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        children = []
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            # Each of the n sequences draws its own stream: a seeded request stays reproducible.
            child_params = params if params.seed is None or index == 0 else _with_seed(params, child_seed(params.seed, index))
            req = Request(
                request_id=child_id, prompt_token_ids=list(prompt_token_ids), max_tokens=max_tokens,
                min_tokens=params.min_tokens, stop_token_ids=stop_ids, priority=priority, arrival_time=arrival,
                cache_salt=cache_salt,
                # One sequence computes the prompt's logprobs; the others may still share cached blocks.
                wants_prompt_logits=index == 0 and params.prompt_logprobs is not None and len(prompt_token_ids) > 1,
            )
            group.children.append(child_id)
            detokenizer = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                                                                     child_params)
            self.tracked[child_id] = Tracked(req, request_id, index, child_params, detokenizer,
                                             [] if params.logprobs is not None else None)
            children.append((req, child_params))
        return children

    def mark_scheduled(self, plan) -> None:
        now = time.monotonic()
        for r in plan.scheduled:
            metrics = self.groups[self.tracked[r.request_id].parent_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now

    # --- a retired step ---------------------------------------------------------------------------

    def store_prompt_logprobs(self, plan, entries: list) -> None:
        """Put a step's prompt logprob entries in their groups. A recompute after preemption writes the
        same entries again."""
        at = 0
        for r in plan.scheduled:
            tracked, first, n = self.tracked.get(r.request_id), r.start_position + 1, r.num_prompt_logits
            at += n
            if not n or tracked is None:  # none wanted, or the request failed in this step
                continue
            self.groups[tracked.parent_id].prompt_logprobs[first: first + n] = map(self._with_text,
                                                                                entries[at - n: at])
            if first + n == tracked.request.num_prompt_tokens:
                tracked.request.wants_prompt_logits = False  # all computed: a recompute may use the cache

    def before(self, sampled: dict[str, list[int]]) -> dict[str, int]:
        """Each sampling sequence's output length before the scheduler appends (first-token times set)."""
        now = time.monotonic()
        out = {}
        for rid in sampled:
            tracked = self.tracked.get(rid)
            if tracked is not None:
                metrics = self.groups[tracked.parent_id].metrics
                metrics.first_token_time = metrics.first_token_time or now
                out[rid] = tracked.request.num_output_tokens
        return out

    def append(self, logprobs: dict[str, list], before: dict[str, int]) -> list[Request]:
        """Logprobs and text for the tokens the scheduler appended (a stop token or a length limit may
        have cut a verified run); returns the requests a stop string has just finished. A stop string
        ends a run at the token that completes it, as it would have in plain decoding."""
        stopped = []
        for rid, start in before.items():
            tracked = self.tracked[rid]
            req = tracked.request
            new = req.output_token_ids[start:]
            try:
                kept, stop = _detokenize(tracked, new)
            except Exception as exc:  # noqa: BLE001  e.g. a token id the tokenizer does not know
                self.fail(req, f"detokenizing tokens {new} failed: {type(exc).__name__}: {exc}")
                stopped.append(req)
                continue
            del req.output_token_ids[start + kept:]
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

    def fail(self, req: Request, reason: str) -> None:
        req.error = reason
        if req.status.is_finished:
            req.status = RequestStatus.FINISHED_ERROR
        else:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)

    def _with_text(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        """vLLM's decoded_token: each token decoded alone, special tokens shown."""
        if self.tokenizer is not None:
            for token, lp in entry.items():
                lp.decoded_token = self.tokenizer.decode([token])
        return entry

    # --- requests out -----------------------------------------------------------------------------

    def partial(self, request_id: str) -> list[CompletionOutput]:
        """A running user request's sequences as they stand after the last retired step (a server
        streams the growth of these): text, token ids and logprobs so far, finish_reason set on the
        sequences already done. Views of live state, not copies: read them before the next step."""
        group = self.groups[request_id]
        out = []
        for index, child in enumerate(group.children):
            if index in group.done:
                out.append(group.done[index])
                continue
            tracked = self.tracked[child]
            text = tracked.detokenizer.output_text if tracked.detokenizer else ""
            out.append(CompletionOutput(index, text, tracked.request.output_token_ids, logprobs=tracked.logprobs))
        return out

    def finish(self, requests) -> list[RequestOutput]:
        """The user requests that these finished sequences complete."""
        out = []
        for req in requests:
            out += self._finish_child(req)
        return out

    def _finish_child(self, req: Request) -> list[RequestOutput]:
        tracked = self.tracked.get(req.request_id)
        if tracked is None or not req.status.is_finished:
            return []
        del self.tracked[req.request_id]
        group = self.groups[tracked.parent_id]
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
        del self.groups[group.request_id]
        group.metrics.finished_time = time.monotonic()
        return [RequestOutput(request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
                              outputs=[group.done[i] for i in sorted(group.done)], finished=True,
                              metrics=group.metrics, error=group.error, num_cached_tokens=group.num_cached_tokens,
                              prompt_logprobs=group.prompt_logprobs)]

    def _stop_reason(self, req: Request, params: SamplingParams) -> int | str | None:
        """vLLM's: the stop string or stop_token_ids entry that ended the request; None for EOS."""
        reason = req.stop_reason
        if isinstance(reason, int) and reason in self.eos_token_ids and reason not in (params.stop_token_ids or ()):
            return None
        return reason


def _detokenize(tracked: Tracked, tokens: list[int]) -> tuple[int, str | None]:
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


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)
