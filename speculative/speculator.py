"""Speculative decoding inside the engine: propose after a step, verify in the next one.

`Speculator` is what the engine holds when `speculative_config` is set. After each step it gives
every decoding request its drafts (`propose`: n-gram lookup or the draft model), which the scheduler
feeds after the request's last token; the step computes logits at all 1 + k positions in the same
compiled graph as any other step, and `verify` keeps what the rejection sampler accepts. Its counters
are vLLM's spec-decode metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from toolkit.scheduling import Request, Scheduler, SchedulerOutput
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
    def __init__(self, spec: SpeculativeConfig, config, model_config, sampler: Sampler, num_blocks: int, tp=None):
        """`config` is the target's resolved EngineConfig; the draft model gets the same dtype, device,
        block size, context length and compile settings, and the target's block count."""
        self.spec, self.tp = spec, tp
        self.rejection = RejectionSampler(sampler)
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * spec.k)
        self.draft = None
        self.ngram = None
        if spec.method == "ngram":
            self.ngram = NgramProposer(spec.k, spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            self.draft = _draft_proposer(spec, config, model_config, sampler, num_blocks)
        self._draft_probs: dict[str, torch.Tensor | None] = {}

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots the scheduler reserves past each sampling chunk for the draft model's own KV."""
        return self.spec.k if self.draft is not None else 0

    def runner_stats(self) -> dict | None:
        if self.draft is None:
            return None
        loop = self.draft.greedy_loop
        stats = self.draft.runner.stats()
        stats.update(greedy_loop_graphs=loop.graphs if loop else 0,
                     greedy_loop_compile_s=loop.compile_seconds if loop else 0.0)
        return stats

    # --- after a step: drafts for the next one ----------------------------------------------------

    def forget(self, request_ids) -> None:
        """Requests whose blocks were freed (preempted or finished)."""
        for rid in request_ids:
            self._draft_probs.pop(rid, None)
            if self.draft is not None:
                self.draft.reset(rid)

    def propose(self, scheduler: Scheduler, params_of, max_model_len: int) -> None:
        """Set `spec_token_ids` of every decoding request (none above disable_by_batch_size)."""
        limit = self.spec.disable_by_batch_size
        if limit is not None and scheduler.num_running > limit:
            return
        requests = scheduler.decoding_requests()
        if not requests:
            return
        # Never draft past what plain decoding could still produce: a verify step appends up to k + 1.
        limits = [max(0, min(self.spec.k, r.max_tokens - r.num_output_tokens - 1, max_model_len - r.num_tokens - 1))
                  for r in requests]
        if not any(limits):
            return
        if self.ngram is not None:
            drafts = self.ngram.propose([r.all_token_ids for r in requests], limits)
            probs = [None] * len(requests)
        else:
            tables = [scheduler.kv_cache.block_table(r.request_id) for r in requests]
            # The draft writes its KV up to position L + limit - 2, into slots the scheduler reserved.
            block = scheduler.config.block_size
            limits = [max(0, min(limit, len(t) * block - r.num_tokens + 1)) for r, t, limit in zip(requests, tables, limits)]
            drafts, probs = self.draft.propose(requests, limits, tables, [params_of(r.request_id) for r in requests])
        if self.tp is not None:
            drafts = self._broadcast(drafts, limits)
        for r, d, q in zip(requests, drafts, probs):
            r.spec_token_ids = d
            self._draft_probs[r.request_id] = q

    def _broadcast(self, drafts: list[list[int]], limits: list[int]) -> list[list[int]]:
        """TP rank 0's token lists on every rank (padded to `limits`, which every rank computes alike)."""
        flat = [d[j] if j < len(d) else -1 for d, limit in zip(drafts, limits) for j in range(limit)]
        flat = self.tp.broadcast_tokens(flat)
        out, at = [], 0
        for limit in limits:
            out.append([t for t in flat[at: at + limit] if t >= 0])
            at += limit
        return out

    # --- in a step: verify ------------------------------------------------------------------------

    def verify(self, logits: torch.Tensor, plan: SchedulerOutput, requests: list[Request],
               params: list[SamplingParams]) -> Verified:
        """The tokens each sampling request keeps; `logits` has 1 + num_draft_tokens rows per request."""
        sampling = [s for s in plan.scheduled if s.samples]
        drafts = [s.token_ids[len(s.token_ids) - s.num_draft_tokens:] if s.num_draft_tokens else [] for s in sampling]
        probs = []
        for s, d in zip(sampling, drafts):
            q = self._draft_probs.get(s.request_id) if d else None
            probs.append(None if q is None else q[: len(d)])  # the budget may have cut the drafts
        verified = self.rejection(logits, [s.request_id for s in sampling], params,
                                  [r.prompt_token_ids for r in requests], [r.output_token_ids for r in requests],
                                  drafts, probs)
        if self.tp is not None:
            verified.token_ids = self._broadcast(verified.token_ids, [len(d) + 1 for d in drafts])
        for i, d in enumerate(drafts):
            if d:
                accepted = verified.num_accepted(i)
                self.stats.num_drafts += 1
                self.stats.num_draft_tokens += len(d)
                self.stats.num_accepted_tokens += accepted
                for j in range(accepted):
                    self.stats.accepted_per_pos[j] += 1
        return verified


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
    # Replicated under tensor parallelism: a draft is small, and every rank drafts the same tokens.
    draft_config = replace(config, model=spec.model, speculative_config=None, tensor_parallel_size=1,
                           data_parallel_size=1)
    runner = ModelRunner(draft_config, draft_mc, backends.for_device(draft_config, draft_mc), None,
                         num_blocks=num_blocks)
    log.info("draft model %s: %.1fM parameters, %d layers, KV cache of %d blocks (the target's)",
             spec.model, draft_mc.num_parameters / 1e6, draft_mc.num_layers, num_blocks)
    return DraftModelProposer(runner, sampler, spec.k)
