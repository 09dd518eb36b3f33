"""The n-gram proposer against the definition, written the slow way."""

from __future__ import annotations

import random

from toolkit.speculative import NgramProposer


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix n-gram (min_n <= n <= max_n) found earlier, its latest occurrence: what followed."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start: start + n] == suffix:
                return tokens[start + n: start + n + k]
    return []


def test_examples():
    p = NgramProposer(3, 1, 3)
    # "4 5" occurred before, followed by 6 7 8.
    assert p.propose([[1, 4, 5, 6, 7, 8, 2, 4, 5]], [3]) == [[6, 7, 8]]
    # The latest of two matches wins; the limit cuts the draft; no match gives none.
    assert p.propose([[9, 1, 2, 9, 3, 4, 9]], [1]) == [[3]]
    assert p.propose([[1, 2, 3]], [3]) == [[]]
    assert p.propose([[5]], [3]) == [[]]
    assert p.propose([[1, 1, 1]], [0]) == [[]]
    # The continuation can run up to the end of the sequence (it may be shorter than k).
    assert p.propose([[7, 8, 7]], [3]) == [[8, 7]]


def test_matches_the_definition_on_random_sequences():
    rng = random.Random(0)
    for _ in range(400):
        k, min_n = rng.randint(1, 5), rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        tokens = [rng.randint(0, 4) for _ in range(rng.randint(1, 60))]
        got = NgramProposer(k, min_n, max_n).propose([tokens], [k])[0]
        assert got == reference(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)
