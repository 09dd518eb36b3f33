"""The rejection sampler: which draft tokens a verify step keeps, so that the output is distributed
exactly as plain sampling from the target with the request's own sampling parameters.

A request with k drafts d_1..d_k gets k+1 target rows (the logits after its last token and after
each draft). Row j's distribution p_j is the one plain sampling would use there: penalties count the
output so far plus d_1..d_{j-1}, then temperature, top-k, top-p, min-p (toolkit/sampler.py). The
draft's q_j went through the same processing (speculative/draft.py).

- Draft-model drafts, sampled request: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the
  first rejection draw from norm(max(0, p_j - q_j)) and stop; if all k pass, draw a bonus token from
  p_{k+1}. This is the speculative sampling of Leviathan et al. and Chen et al. (2023), whose output
  token at each position has exactly the target's distribution.
- Greedy requests, and n-gram drafts (q one-hot): row j's plain sample t_j (the argmax, or the
  inverse transform of the position's own uniform) is computed, d_j is kept while d_j == t_j, and the
  first t_j that differs (or t_{k+1}) ends the run. For a one-hot q this *is* the rule above:
  P(t_j = d_j) = p_j(d_j) = min(1, p_j(d_j) / 1), and t_j given t_j != d_j is distributed as p_j
  without d_j, renormalized: norm(max(0, p_j - onehot(d_j))). It also draws exactly the tokens plain
  sampling would have drawn at those positions (their noise is keyed by seed and position), so a
  seeded request gives the same output with n-gram speculation as without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.outputs import Logprob
from toolkit.sampler import (STREAM_ACCEPT, STREAM_RESIDUAL, Sampler, gather_logprobs, sample_rows,
                             uses_penalties)
from toolkit.sampling_params import SamplingParams


@dataclass
class Verified:
    token_ids: list[list[int]]  # per request: its accepted drafts, then one token of the target's
    logprobs: list[list[dict[int, Logprob] | None]]  # per request and kept token (None entries: not asked for)

    def num_accepted(self, i: int) -> int:
        return len(self.token_ids[i]) - 1


class RejectionSampler:
    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
                 prompt_token_ids: list[list[int]], output_token_ids: list[list[int]], drafts: list[list[int]],
                 draft_probs: list[torch.Tensor | None]) -> Verified:
        """`logits`: [sum(1 + len(drafts[i])), V], request i's rows in order. `draft_probs[i]`: q as
        [len(drafts[i]), V] for a draft model's drafts, None for one-hot drafts (n-gram) or none."""
        raw = logits if logits.dtype == torch.float32 else logits.to(torch.float32)
        rows = _Rows(request_ids, params, prompt_token_ids, output_token_ids, drafts)
        if raw.shape[0] != len(rows.ids):
            raise ValueError(f"{raw.shape[0]} logits rows for {len(rows.ids)} verify positions")
        tested = [i for i, q in enumerate(draft_probs) if q is not None and drafts[i] and not params[i].is_greedy]
        plain = self._plain(raw, rows, tested, drafts)
        accepted, residual = self._probability_test(raw, rows, tested, drafts, draft_probs)
        token_ids, kept_rows = [], []
        for i, draft in enumerate(drafts):
            first = rows.first[i]
            if i in accepted:
                n = _leading_true(accepted[i])
                last = residual[i][n] if n < len(draft) else plain[first + n]
            else:
                n = _leading_true([plain[first + j] == d for j, d in enumerate(draft)])
                last = plain[first + n]
            token_ids.append(draft[:n] + [last])
            kept_rows.append(range(first, first + n + 1))
        return Verified(token_ids, self._logprobs(raw, rows, token_ids, kept_rows))

    def _plain(self, raw, rows, tested, drafts) -> list[int | None]:
        """Plain sampling's token at every row that needs it: all rows but a tested request's draft
        rows (those are decided by the probability test; only its bonus row samples plainly)."""
        skip = {rows.first[i] + j for i in tested for j in range(len(drafts[i]))}
        if not skip:
            return self.sampler.sample(raw, rows.ids, rows.params, rows.prompts, rows.outputs, rows.positions).tolist()
        index = [r for r in range(len(rows.ids)) if r not in skip]
        sub = _Rows.select(rows, index)
        plain: list[int | None] = [None] * len(rows.ids)
        sampled = self.sampler.sample(raw[index], sub.ids, sub.params, sub.prompts, sub.outputs, sub.positions)
        for r, token in zip(index, sampled.tolist()):
            plain[r] = token
        return plain

    def _probability_test(self, raw, rows, tested, drafts, draft_probs):
        """For the requests in `tested`: {i: accept flag per draft}, {i: residual sample per draft}."""
        if not tested:
            return {}, {}
        index = [rows.first[i] + j for i in tested for j in range(len(drafts[i]))]
        sub = _Rows.select(rows, index)
        p = self.sampler.probabilities(raw[index], sub.params, sub.prompts, sub.outputs)
        q = torch.cat([draft_probs[i] for i in tested]).to(p.device, torch.float32)
        d = torch.tensor([t for i in tested for t in drafts[i]], device=p.device).unsqueeze(1)
        p_d, q_d = p.gather(1, d).squeeze(1), q.gather(1, d).squeeze(1)
        positions = sub.positions
        u = self.sampler.random_rows(sub.ids, sub.params, positions, STREAM_ACCEPT, p.device).squeeze(1)
        accept = (u * q_d < p_d).tolist()  # u < p/q without dividing by a q that may round to 0
        leftover = (p - q).clamp_(min=0)
        # Where p <= q everywhere (p == q up to rounding) rejection has probability 0; p stands in.
        empty = leftover.sum(dim=1, keepdim=True) <= 0
        leftover = torch.where(empty, p, leftover)
        residual = sample_rows(leftover, self.sampler.random_rows(sub.ids, sub.params, positions, STREAM_RESIDUAL,
                                                                 p.device)).tolist()
        out_accept, out_residual, at = {}, {}, 0
        for i in tested:
            k = len(drafts[i])
            out_accept[i], out_residual[i] = accept[at: at + k], residual[at: at + k]
            at += k
        return out_accept, out_residual

    @staticmethod
    def _logprobs(raw, rows, token_ids, kept_rows):
        wanted = [i for i, p in enumerate(rows.request_params) if p.logprobs is not None]
        result = [[None] * len(tokens) for tokens in token_ids]
        if not wanted:
            return result
        index = [r for i in wanted for r in kept_rows[i]]
        tokens = torch.tensor([t for i in wanted for t in token_ids[i]], device=raw.device)
        entries = gather_logprobs(raw[index], tokens, [rows.request_params[i] for i in wanted for _ in kept_rows[i]])
        at = 0
        for i in wanted:
            result[i] = entries[at: at + len(token_ids[i])]
            at += len(token_ids[i])
        return result


class _Rows:
    """The verify rows of a batch: request i's row j samples output position len(outputs[i]) + j, and
    its penalties see d_1..d_j-1 as output (copied only for requests with penalties: nothing else
    reads the lists)."""

    FIELDS = ("ids", "params", "prompts", "outputs", "positions")

    def __init__(self, request_ids, params, prompts, outputs, drafts):
        self.request_params = params
        self.ids, self.params, self.prompts, self.outputs, self.positions, self.first = [], [], [], [], [], []
        for rid, p, prompt, out, draft in zip(request_ids, params, prompts, outputs, drafts):
            self.first.append(len(self.ids))
            penalized = uses_penalties(p)
            for j in range(len(draft) + 1):
                self.ids.append(rid)
                self.params.append(p)
                self.prompts.append(prompt)
                self.outputs.append(out + draft[:j] if j and penalized else out)
                self.positions.append(len(out) + j)

    @staticmethod
    def select(rows: "_Rows", index: list[int]) -> "_Rows":
        sub = _Rows([], [], [], [], [])
        for name in _Rows.FIELDS:
            setattr(sub, name, [getattr(rows, name)[r] for r in index])
        return sub


def _leading_true(flags) -> int:
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n
