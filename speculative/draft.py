"""Draft-model proposals: a small model sharing the target's vocabulary drafts k tokens per request,
autoregressively and batched over requests, run by the engine's own runner code (compiled like the
target) over its own paged KV cache.

The draft's cache has the target's block count and block size and is addressed through the target's
block tables, so no second allocator exists: a request's block i holds its tokens i*B..(i+1)*B-1 in
both caches. The scheduler reserves `k` lookahead slots beyond each sampling chunk for the draft's
writes. What the draft's cache holds is tracked per request as a count of valid leading positions:
a proposal first feeds every token not yet in it (the prompt on the first proposal, afterwards the
one or two tokens the last verify step added), then feeds its own drafts one by one; positions at
or past the target's `num_computed_tokens` are trusted only up to that count, so rejected drafts'
KV is simply overwritten next time.
"""

from __future__ import annotations

import torch

from scheduling import Request, ScheduledRequest
from toolkit.sampler import STREAM_DRAFT, Sampler, argmax_rows, uses_penalties
from toolkit.sampling_params import SamplingParams


class DraftModelProposer:
    def __init__(self, runner, sampler: Sampler, num_tokens: int):
        self.runner = runner  # a toolkit ModelRunner over the draft checkpoint
        self.sampler = sampler
        self.num_tokens = num_tokens
        self._valid: dict[str, int] = {}  # request id -> leading positions of its draft KV that are valid

    def reset(self, request_id: str) -> None:
        """The request's blocks were freed (finished or preempted): its draft KV is gone."""
        self._valid.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[Request], limits: list[int], tables: list[list[int]],
                params: list[SamplingParams]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Up to limits[i] drafts per request, and q ([n, V], float32) for each request that samples
        (None for greedy ones: their drafts are the draft's argmax and q is not needed)."""
        drafts: list[list[int]] = [[] for _ in requests]
        q_rows: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, limit in enumerate(limits) if limit > 0]
        scheduled = []
        for i in active:
            r = requests[i]
            start = min(self._valid.get(r.request_id, 0), r.num_computed_tokens)
            scheduled.append(ScheduledRequest(r.request_id, r.token_ids_slice(start, r.num_tokens), start, tables[i],
                                              samples=True))
        while active:
            logits = self.runner.execute(self.runner.prepare(scheduled))
            tokens, q = self._sample(logits, [requests[i] for i in active], [params[i] for i in active],
                                     [drafts[i] for i in active])
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                if not params[i].is_greedy:
                    q_rows[i].append(q[row])
            active = [i for i in active if len(drafts[i]) < limits[i]]
            scheduled = [ScheduledRequest(requests[i].request_id, [drafts[i][-1]],
                                          requests[i].num_tokens + len(drafts[i]) - 1, tables[i], samples=True)
                         for i in active]
        for r, limit in zip(requests, limits):
            if limit > 0:
                # It fed everything up to the last token, then every draft but the last.
                self._valid[r.request_id] = r.num_tokens + limit - 1
        return drafts, [torch.stack(rows) if rows else None for rows in q_rows]

    def _sample(self, logits, requests, params, drafts):
        ids = [r.request_id for r in requests]
        prompts = [r.prompt_token_ids for r in requests]
        # Penalties see the drafts so far as output; only they read the lists, so only they get copies.
        outputs = [r.output_token_ids + d if uses_penalties(p) else r.output_token_ids
                   for r, d, p in zip(requests, drafts, params)]
        positions = [r.num_output_tokens + len(d) for r, d in zip(requests, drafts)]
        if all(p.is_greedy for p in params):
            # The draft's argmax after the request's penalties; q is not needed to verify greedy drafts.
            return self.sampler.sample(logits, ids, params, prompts, outputs, positions).tolist(), None
        q = self.sampler.probabilities(logits, params, prompts, outputs)
        noise = self.sampler.random_rows(q, ids, params, positions, STREAM_DRAFT, "exponential")
        sampled = argmax_rows(q / noise)
        greedy = torch.tensor([p.is_greedy for p in params], device=q.device)
        return torch.where(greedy, argmax_rows(q), sampled).tolist(), q
