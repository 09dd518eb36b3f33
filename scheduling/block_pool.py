"""The physical KV blocks: a free list and a reference count per block."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids 0..num_blocks-1.

    Reference counts rather than an owned/free flag, so that prefix caching can later let several
    requests share one block: a block returns to the free list only when its last user frees it.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"BlockPool needs num_blocks >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with reference count 1, or None (allocating nothing) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for block_id in blocks:
            self._ref_counts[block_id] = 1
        return blocks

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                # A double free would put the block on the free list twice and hand it to two requests.
                raise ValueError(f"block {block_id} is freed but is not allocated")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)
