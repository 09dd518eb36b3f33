"""The physical KV blocks: reference counts, and the free blocks in the order they are handed out.

With prefix caching a full block that is computed gets a name (its block hash) and keeps it after its
last user frees it: it stays in the free queue as an *evictable* block that a later request with the
same prefix can take back (`touch`) instead of computing it again. The free queue is an ordered dict:
a block taken back or allocated leaves it in O(1), the front is evicted first. Blocks without a name
go to the front (nothing is lost reusing them), named ones to the back (least recently used first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from .block_hash import BlockHash


class BlockPool:
    """Hands out block ids 0..num_blocks-1; a block is free when its reference count is 0."""

    def __init__(self, num_blocks: int, enable_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(f"BlockPool needs num_blocks >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}
        self._evicted: list[tuple[int, BlockHash]] = []  # since the last drain_evicted()

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: never used, freed, or cached and evictable."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash_of.get(block_id)

    def lookup(self, hashes: Iterable[BlockHash]) -> list[int]:
        """The cached blocks of the longest prefix of hashes (not taken: see touch)."""
        blocks = []
        for block_hash in hashes:
            block_id = self._block_of.get(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def num_free_among(self, block_ids: Iterable[int]) -> int:
        return sum(1 for b in block_ids if self._ref_counts[b] == 0)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take cached blocks for one more user (a prefix hit); free ones stop being evictable."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def allocate(self, n: int) -> list[int] | None:
        """n blocks with reference count 1, or None (allocating nothing) when fewer are free.
        A cached block handed out loses its name; `drain_evicted` reports it (a tier may keep a copy)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            return None
        blocks = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block_hash = self._hash_of.pop(block_id, None)
            if block_hash is not None:
                del self._block_of[block_hash]
                self._evicted.append((block_id, block_hash))
            self._ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one user of each block; callers pass a request's table tail first, so that its tail
        blocks (the least likely to be shared) are evicted before its head."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                # A double free would put the block on the free list twice and hand it to two requests.
                raise ValueError(f"block {block_id} is freed but is not allocated")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None
                if block_id not in self._hash_of:
                    self._free.move_to_end(block_id, last=False)

    def cache(self, block_id: int, block_hash: BlockHash) -> bool:
        """Name a full, computed block; False (and no name) when caching is off, the block has a name
        already, or another block holds the same KV under this name."""
        if not self.enable_caching or block_id in self._hash_of or block_hash in self._block_of:
            return False
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        return True

    def uncache(self, block_id: int) -> None:
        """Forget a block's name (its KV could not be trusted: a failed load)."""
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:
            del self._block_of[block_hash]
            if self._ref_counts[block_id] == 0:
                self._free.move_to_end(block_id, last=False)

    def reset(self) -> bool:
        """Forget every name (nothing is cached any more); False, changing nothing, while blocks are in use."""
        if any(self._ref_counts):
            return False
        self._hash_of.clear()
        self._block_of.clear()
        self._evicted.clear()
        self._free = OrderedDict.fromkeys(range(self.num_blocks))
        return True

    def drain_evicted(self) -> list[tuple[int, BlockHash]]:
        """(block id, its former name) for every cached block allocated since the last call."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def free_block_ids(self) -> list[int]:
        """The free queue in eviction order (for invariant checks and debugging)."""
        return list(self._free)
