"""N-gram (prompt lookup) proposals: where the sequence's last n tokens appeared before, the tokens
that followed them then are proposed now.

For each n from `max_n` down to `min_n` the search compares every earlier window of the sequence
with its suffix at once (numpy over all positions): the longest n that matches wins, and among its
matches the latest, whose continuation is the most recent context. A draft is q one-hot, so the
rejection sampler accepts it with the target's own probability of the token.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_tokens: int, min_n: int, max_n: int):
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n

    def propose(self, sequences: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        """Up to min(num_tokens, max_tokens[i]) draft tokens for each sequence (prompt + output)."""
        return [self.propose_one(np.asarray(seq, dtype=np.int64), min(self.num_tokens, limit)) if limit > 0 else []
                for seq, limit in zip(sequences, max_tokens)]

    def propose_one(self, tokens: np.ndarray, k: int) -> list[int]:
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows that start at 0..length-1-n: each is followed by at least one token, and the
            # suffix itself (starting at length-n) is not among them.
            windows = sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start: start + k].tolist()
        return []
