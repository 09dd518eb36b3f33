"""Speculative decoding in the worker that holds the logits: verify a step's drafts, propose the next.

`Speculator` is what a worker holds when `speculative_config` is set. On the rank that holds the
logits (one process, TP rank 0, a pipeline's last stage) a step's sampling requests are verified
(`verify`: the rejection sampler), and each request that goes on gets its next drafts at once, from
its tokens as the update will leave them (`propose`: n-gram lookup or the draft model, which lives
on that rank only). The drafts travel to every rank in the step's one result, and the scheduler
feeds them after the request's last token; the step computes logits at all 1 + k positions in the
same compiled graph as any other step. Its counters are vLLM's spec-decode metrics, counted on every
rank from the retired plans (`count`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from toolkit.scheduling import Request, SchedulerOutput
from toolkit.speculative.config import SpeculativeConfig
from toolkit.speculative.ngram import NgramProposer
from toolkit.speculative.rejection import RejectionSampler, Verified
from toolkit.metrics import Counter, Vector
from toolkit.sampler import Sampler
from toolkit.sampling_params import SamplingParams

log = logging.getLogger("toolkit")


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # requests x steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verify step: the accepted drafts plus the target's own token (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def metrics(self) -> list:
        return [Counter("toolkit:spec_decode_num_drafts", value=self.num_drafts),
                Counter("toolkit:spec_decode_num_draft_tokens", value=self.num_draft_tokens),
                Counter("toolkit:spec_decode_num_accepted_tokens", value=self.num_accepted_tokens),
                Vector("toolkit:spec_decode_num_accepted_tokens_per_pos", values=list(self.accepted_per_pos))]

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos),
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length}


class Speculator:
    def __init__(self, spec: SpeculativeConfig, config, model_config, sampler: Sampler, num_blocks: int,
                 drafts_here: bool = True):
        """`config` is the target's resolved EngineConfig; the draft model gets the same dtype, device,
        block size, context length and compile settings, and the target's block count. `drafts_here`:
        whether this rank holds the logits (a pipeline's last stage, TP rank 0): only there is a draft
        model loaded, drafts proposed and verified; every rank counts the statistics."""
        self.spec = spec
        self.rejection = RejectionSampler(sampler)
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * spec.k)
        self.draft = None
        self.ngram = None
        if spec.method == "ngram":
            self.ngram = NgramProposer(spec.k, spec.prompt_lookup_min, spec.prompt_lookup_max)
        elif drafts_here:
            self.draft = _draft_proposer(spec, config, model_config, sampler, num_blocks)
        self._draft_probs: dict[str, torch.Tensor | None] = {}

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots the scheduler reserves past each sampling chunk for the draft model's own KV."""
        return self.spec.k if self.spec.method != "ngram" else 0

    def runner_stats(self) -> dict | None:
        if self.draft is None:
            return None
        loop = self.draft.greedy_loop
        stats = self.draft.runner.stats()
        stats.update(greedy_loop_graphs=loop.graphs if loop else 0,
                     greedy_loop_compile_s=loop.compile_seconds if loop else 0.0)
        return stats

    def release(self, request_ids) -> None:
        """Requests whose blocks were freed (finished, preempted, requeued): their drafts' state goes."""
        for rid in request_ids:
            self._draft_probs.pop(rid, None)
            if self.draft is not None:
                self.draft.reset(rid)

    # --- where the logits are: drafts for the next step -------------------------------------------

    def propose(self, states: list["NextState"], params: list[SamplingParams], tables: list[list[int]],
                block_size: int, max_model_len: int, num_running: int) -> dict[str, list[int]]:
        """Drafts for the requests this step sampled, from their tokens as the update will leave them
        (`states`); none above disable_by_batch_size. Returns request id -> drafts (non-empty only)."""
        limit = self.spec.disable_by_batch_size
        if not states or (limit is not None and num_running > limit):
            return {}
        # Never draft past what plain decoding could still produce: a verify step appends up to k + 1.
        limits = [max(0, min(self.spec.k, r.max_tokens - r.num_output_tokens - 1, max_model_len - r.num_tokens - 1))
                  for r in states]
        if not any(limits):
            return {}
        if self.ngram is not None:
            drafts = self.ngram.propose([r.all_token_ids for r in states], limits)
            probs = [None] * len(states)
        else:
            # The draft writes its KV up to position L + limit - 2, into slots the scheduler reserved.
            limits = [max(0, min(limit, len(t) * block_size - r.num_tokens + 1))
                      for r, t, limit in zip(states, tables, limits)]
            drafts, probs = self.draft.propose(states, limits, tables, params)
        out = {}
        for r, d, q in zip(states, drafts, probs):
            self._draft_probs[r.request_id] = q
            if d:
                out[r.request_id] = list(d)
        return out

    # --- where the logits are: verify ---------------------------------------------------------------

    def verify(self, logits: torch.Tensor, plan: SchedulerOutput, requests: list[Request],
               params: list[SamplingParams]) -> Verified:
        """The tokens each sampling request keeps; `logits` has 1 + num_draft_tokens rows per request."""
        sampling = [s for s in plan.scheduled if s.samples]
        drafts = [s.token_ids[len(s.token_ids) - s.num_draft_tokens:] if s.num_draft_tokens else [] for s in sampling]
        probs = []
        for s, d in zip(sampling, drafts):
            q = self._draft_probs.get(s.request_id) if d else None
            probs.append(None if q is None else q[: len(d)])  # the budget may have cut the drafts
        return self.rejection(logits, [s.request_id for s in sampling], params,
                              [r.prompt_token_ids for r in requests], [r.output_token_ids for r in requests],
                              drafts, probs)

    def count(self, plan: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """vLLM's spec-decode counters from a retired plan (every rank: the result says what was kept)."""
        for s in plan.scheduled:
            if s.num_draft_tokens and s.request_id in sampled:
                accepted = len(sampled[s.request_id]) - 1
                self.stats.num_drafts += 1
                self.stats.num_draft_tokens += s.num_draft_tokens
                self.stats.num_accepted_tokens += accepted
                for j in range(accepted):
                    self.stats.accepted_per_pos[j] += 1


class NextState:
    """A request as this step's update will leave it, its new tokens appended (and no further ones
    computed): what a proposer reads, where the logits are, before every rank's update has run."""

    __slots__ = ("request", "new")

    def __init__(self, request: Request, new: list[int]):
        self.request, self.new = request, new

    request_id = property(lambda self: self.request.request_id)
    prompt_token_ids = property(lambda self: self.request.prompt_token_ids)
    max_tokens = property(lambda self: self.request.max_tokens)
    output_token_ids = property(lambda self: self.request.output_token_ids + self.new)
    all_token_ids = property(lambda self: self.request.all_token_ids + self.new)
    num_output_tokens = property(lambda self: self.request.num_output_tokens + len(self.new))
    num_tokens = property(lambda self: self.request.num_tokens + len(self.new))
    num_computed_tokens = property(lambda self: self.num_tokens - 1)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        return self.all_token_ids[start:end]

    def goes_on(self) -> bool:
        """Whether it can still decode after the update (no stop token, below its length limits)."""
        r = self.request
        if any(t in r.stop_token_ids for t in self.new) and self.num_output_tokens >= r.min_tokens:
            return False
        return self.num_output_tokens < r.max_tokens


def _draft_proposer(spec: SpeculativeConfig, config, model_config, sampler: Sampler, num_blocks: int):
    from toolkit.speculative.draft import DraftModelProposer
    from toolkit import backends
    from toolkit.config import load_model_config
    from toolkit.runner import ModelRunner

    draft_mc = load_model_config(spec.model)
    spec.check_draft_vocabulary(draft_mc.vocab_size, model_config.vocab_size)
    if draft_mc.max_position_embeddings < config.max_model_len:
        raise ValueError(f"speculative_config.model: the draft's max_position_embeddings "
                         f"({draft_mc.max_position_embeddings}) is below max_model_len {config.max_model_len}")
    # Whole, on the one rank that holds the target's logits (a draft is small): no TP, stages or EP.
    draft_config = replace(config, model=spec.model, speculative_config=None, tensor_parallel_size=1,
                           data_parallel_size=1, pipeline_parallel_size=1, pp_layer_partition=None,
                           enable_expert_parallel=False)
    runner = ModelRunner(draft_config, draft_mc, backends.for_device(draft_config, draft_mc), None,
                         num_blocks=num_blocks)
    log.info("draft model %s: %.1fM parameters, %d layers, KV cache of %d blocks (the target's)",
             spec.model, draft_mc.num_parameters / 1e6, draft_mc.num_layers, num_blocks)
    return DraftModelProposer(runner, sampler, spec.k)
