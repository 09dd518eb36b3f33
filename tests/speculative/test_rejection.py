"""The rejection sampler's output is distributed as the target's, whatever the draft's distribution.

Many requests verify in one batched call, each with its own drafts drawn from a deliberately different
q; the frequencies of the tokens kept at each position are tested against the exact p with Pearson's
chi-square (goodness_of_fit.py). Each test also shows that it can fail: a sampler that keeps every
draft (the draft's distribution) is rejected by the same test on the same data.
"""

from __future__ import annotations

import pytest
import torch

from toolkit.speculative import RejectionSampler
from tests.speculative.goodness_of_fit import ALPHA, chi_square_p_value
from toolkit.sampler import Sampler
from toolkit.sampling_params import SamplingParams

V = 6
N = 12000  # requests in the batch


def distributions(seed: int, rows: int, sharpness: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (sharpness * torch.randn(rows, V, generator=g)).softmax(-1)


def run(p: torch.Tensor, q: torch.Tensor | None, params: SamplingParams, *, seed: int = 0, seeded: bool = False):
    """p: [k+1, V] the target's rows, q: [k, V] the draft's (None: drafts are one-hot from a fixed
    table of draws); every request verifies its own drafts drawn from q. Returns the kept tokens."""
    k = p.shape[0] - 1
    g = torch.Generator().manual_seed(seed + 100)
    source = q if q is not None else distributions(seed + 7, k)
    drafts = torch.multinomial(source.repeat(N, 1), 1, generator=g).view(N, k).tolist()
    sampler = Sampler(seed)
    ids = [f"r{i}" for i in range(N)]
    all_params = [SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                 seed=i if seeded else None) for i in range(N)]
    for rid, sp in zip(ids, all_params):
        sampler.add_request(rid, sp)
    logits = p.log().repeat(N, 1)  # the sampler's processing of log p at temperature 1 is p itself
    verified = RejectionSampler(sampler)(logits, ids, all_params, [[0]] * N, [[]] * N, drafts,
                                         [q if q is not None else None] * N)
    return verified.token_ids, drafts


def position_counts(token_ids, position: int) -> tuple[torch.Tensor, int]:
    kept = [t[position] for t in token_ids if len(t) > position]
    return torch.bincount(torch.tensor(kept), minlength=V), len(kept)


@pytest.mark.parametrize("draft", ["draft_model", "one_hot"])
@pytest.mark.parametrize("seeded", [False, True])
def test_every_position_is_distributed_as_the_target(draft, seeded):
    p = distributions(1, 3)
    q = distributions(2, 2) if draft == "draft_model" else None
    token_ids, drafts = run(p, q, SamplingParams(temperature=1.0), seeded=seeded)
    for position in range(3):
        counts, n = position_counts(token_ids, position)
        assert n > 500  # enough reached position 2 (both drafts kept) to test it
        assert chi_square_p_value(counts, p[position]) > ALPHA, f"position {position}: {counts.tolist()} vs {p[position]}"
    # The test has power: the drafts themselves (as if all were kept) are q, which it rejects.
    draft_counts = torch.bincount(torch.tensor([d[0] for d in drafts]), minlength=V)
    assert chi_square_p_value(draft_counts, p[0]) < 1e-6
    # And acceptance runs at its theoretical rate: sum_x min(p(x), q(x)) for a draft model, p(d) for one-hot.
    accepted = sum(len(t) > 1 for t in token_ids) / N
    source = q[0] if q is not None else distributions(7, 2)[0]
    rate = float(torch.minimum(p[0], source).sum()) if q is not None else float((p[0] * source).sum())
    assert abs(accepted - rate) < 4 * (rate * (1 - rate) / N) ** 0.5 + 1e-3


def test_p_is_the_distribution_after_the_requests_own_sampling_parameters():
    p_raw = distributions(3, 3, sharpness=1.0)
    q = distributions(4, 2)
    params = SamplingParams(temperature=0.7, top_k=3)
    token_ids, _ = run(p_raw, q, params)
    # The exact distribution plain sampling uses: temperature, then only the 3 most likely tokens.
    scaled = (p_raw.log() / 0.7)
    top3 = scaled.topk(3, dim=-1).indices
    exact = torch.full_like(scaled, float("-inf")).scatter(1, top3, scaled.gather(1, top3)).softmax(-1)
    for position in range(3):
        counts, n = position_counts(token_ids, position)
        assert chi_square_p_value(counts, exact[position]) > ALPHA, f"position {position}"
        assert counts[exact[position] == 0].sum() == 0
    wrong = p_raw[0]  # the unprocessed distribution is rejected by the same data
    assert chi_square_p_value(position_counts(token_ids, 0)[0], wrong) < 1e-6


def test_greedy_keeps_drafts_while_they_are_the_targets_argmax():
    p = distributions(5, 4)
    best = p.argmax(-1).tolist()
    sampler = Sampler(0)
    greedy = SamplingParams(temperature=0)
    drafts = [best[:3], [best[0], (best[1] + 1) % V, best[2]], [(best[0] + 1) % V, best[1], best[2]]]
    verified = RejectionSampler(sampler)(p.log().repeat(3, 1), ["a", "b", "c"], [greedy] * 3, [[0]] * 3, [[]] * 3,
                                         drafts, [distributions(6, 3), None, None])
    assert verified.token_ids == [best, best[:2], best[:1]]


def test_seeded_requests_keep_the_same_tokens_whatever_the_batch():
    p, q = distributions(1, 3), distributions(2, 2)
    sampler = Sampler(0)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (11, 12, 13)]
    for rid, sp in zip("abc", params):
        sampler.add_request(rid, sp)
    rs = RejectionSampler(sampler)
    drafts = [[1, 2], [3, 4], [0, 5]]
    alone = [rs(p.log(), [rid], [sp], [[0]], [[]], [d], [q]).token_ids[0]
             for rid, sp, d in zip("abc", params, drafts)]
    together = rs(p.log().repeat(3, 1), ["c", "a", "b"], [params[2], params[0], params[1]], [[0]] * 3,
                  [[]] * 3, [drafts[2], drafts[0], drafts[1]], [q] * 3).token_ids
    assert together == [alone[2], alone[0], alone[1]]
