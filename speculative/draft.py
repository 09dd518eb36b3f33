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

import time

import torch

from toolkit.scheduling import Request, ScheduledRequest
from toolkit.sampler import STREAM_DRAFT, Sampler, argmax_rows, sample_rows, uses_logits_processors, uses_penalties
from toolkit.sampling_params import SamplingParams


class DraftModelProposer:
    def __init__(self, runner, sampler: Sampler, num_tokens: int):
        self.runner = runner  # a toolkit ModelRunner over the draft checkpoint
        self.sampler = sampler
        self.num_tokens = num_tokens
        self._valid: dict[str, int] = {}  # request id -> leading positions of its draft KV that are valid
        # Greedy drafts 2..k in one call (one compiled graph of k - 1 unrolled draft forwards): at
        # batch 1 a draft forward is mostly per-call cost, which this pays once instead of k - 1 times.
        self.greedy_loop = GreedyDraftLoop(runner, num_tokens - 1) if num_tokens > 1 else None

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
            if drafts[active[0]] and self.greedy_loop is not None and _plain_greedy(params, active):
                self.greedy_loop.run(requests, limits, tables, drafts, active)
                break
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
        sampled = sample_rows(q, self.sampler.random_rows(ids, params, positions, STREAM_DRAFT, q.device))
        greedy = torch.tensor([p.is_greedy for p in params], device=q.device)
        return torch.where(greedy, argmax_rows(q), sampled).tolist(), q


def _plain_greedy(params: list[SamplingParams], rows: list[int]) -> bool:
    # The loop takes the raw argmax: a request with a logit bias or allowed ids must go through the sampler.
    return all(params[i].is_greedy and not uses_penalties(params[i]) and not uses_logits_processors(params[i])
               for i in rows)


class GreedyDraftLoop:
    """Drafts 2..k of greedy requests without penalties in one call: `steps` = k - 1 draft forwards
    unrolled in one function (compiled with the draft's step options unless enforce_eager), each
    feeding the previous argmax at the next position. A request that may draft fewer stops writing
    KV once it has its drafts: its later rows repeat its last position with slot -1 (never written)
    and are dropped."""

    def __init__(self, runner, steps: int):
        self.runner, self.steps = runner, steps
        self.graphs = 0  # compiled for this loop (one serves every batch size)
        self.compile_seconds = 0.0
        block_size, backend = runner.config.block_size, runner.attention_backend
        model = runner.model

        def greedy_draft_loop(tokens, positions, limits, block_tables, kv_caches):
            from toolkit.attention import AttentionMetadata

            rows = tokens.shape[0]
            starts = torch.arange(rows + 1, dtype=torch.int32, device=tokens.device)
            index = torch.arange(rows, dtype=torch.int64, device=tokens.device)
            out = []
            for j in range(steps):
                # Feed draft j + 1 at positions + j while the request still needs draft j + 2.
                live = limits > j + 1
                pos = positions + torch.clamp(limits - 2, max=j)
                block = block_tables.gather(1, (pos // block_size).unsqueeze(1)).squeeze(1).to(torch.int64)
                slots = torch.where(live, block * block_size + pos % block_size, -1)
                meta = AttentionMetadata(starts, (pos + 1).to(torch.int32), block_tables, slots, backend,
                                         decode_only=True)
                tokens = model(tokens, pos, kv_caches, meta, index).argmax(dim=-1)
                out.append(tokens)
            return torch.stack(out, dim=1)

        self._fn = greedy_draft_loop
        if not runner.config.enforce_eager:
            from toolkit.transforms import compile_function

            self._fn = compile_function(greedy_draft_loop, runner.config, runner.backend)

    @torch.inference_mode()
    def run(self, requests, limits, tables, drafts, active) -> None:
        """Appends drafts 2..limits[i] to drafts[i] for the requests in `active` (each has its first)."""
        device = self.runner.device
        width = max(len(tables[i]) for i in active)
        as_tensor = lambda values, dtype: torch.tensor(values, dtype=dtype, device=device)  # noqa: E731
        tokens = as_tensor([drafts[i][-1] for i in active], torch.int64)
        positions = as_tensor([requests[i].num_tokens for i in active], torch.int64)  # where draft 1 is fed
        limit = as_tensor([limits[i] for i in active], torch.int64)
        block_tables = as_tensor([tables[i] + [0] * (width - len(tables[i])) for i in active], torch.int32)
        if not self.runner.config.enforce_eager:
            from torch._dynamo.decorators import mark_unbacked

            for t in (tokens, positions, limit, block_tables):
                mark_unbacked(t, 0)
            mark_unbacked(block_tables, 1)
        from toolkit.runner import num_compiled_graphs

        before, start = num_compiled_graphs(), time.perf_counter()
        out = self._fn(tokens, positions, limit, block_tables, self.runner.kv_caches).tolist()
        if num_compiled_graphs() > before:
            self.graphs += num_compiled_graphs() - before
            self.compile_seconds += time.perf_counter() - start
        for row, i in enumerate(active):
            drafts[i] += out[row][: limits[i] - 1]
