"""Pearson's chi-square goodness-of-fit test against an exact distribution (no scipy here: the
chi-square survival function is the regularized upper incomplete gamma function, which torch has)."""

from __future__ import annotations

import torch

# A sampler that is right fails this test once in ALPHA**-1 runs; with fixed seeds it is deterministic.
ALPHA = 1e-3


def chi_square_p_value(counts, probabilities, min_expected: float = 5.0) -> float:
    """p-value of observing `counts` (per category) under `probabilities`. Categories expected fewer
    than `min_expected` times are pooled into one, as the chi-square approximation requires."""
    counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
    probabilities = torch.as_tensor(probabilities, dtype=torch.float64).flatten()
    assert abs(float(probabilities.sum()) - 1) < 1e-6, "the exact distribution must sum to 1"
    expected = probabilities * counts.sum()
    if (counts[expected == 0] > 0).any():
        return 0.0  # a category of probability 0 was observed: no distribution test needed
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum().view(1)]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum().view(1)]) if small.any() else expected
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    statistic = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))
