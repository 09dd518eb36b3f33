"""Per-request block tables over a BlockPool, and prefix caching: finding a request's longest cached
prefix, sharing those blocks, and naming its own blocks as they become full and computed."""

from __future__ import annotations

from .block_hash import BlockHash, extend_block_hashes
from .block_pool import BlockPool
from .request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        if block_size < 1:
            raise ValueError(f"KVCacheManager needs block_size >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self._tables: dict[str, list[int]] = {}
        self._num_named: dict[str, int] = {}  # leading blocks of a table that carry their name

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """The names of the request's full blocks (extended as its tokens grow)."""
        return extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)

    def max_cached_blocks(self, request: Request) -> int:
        """At least the last token is computed, so its logits exist: a hit covers whole blocks before it."""
        return (request.num_tokens - 1) // self.block_size

    def cached_prefix(self, request: Request) -> list[int]:
        """The device blocks of the request's longest cached prefix (not taken yet)."""
        if not self.enable_caching:
            return []
        return self.block_pool.lookup(self.block_hashes(request)[:self.max_cached_blocks(request)])

    def allocate_slots(self, request: Request, num_new_tokens: int, cached: list[int] = ()) -> list[int] | None:
        """Grow the request's table to cover num_computed_tokens + num_new_tokens tokens; `cached` (a
        new request only) are its prefix-hit blocks, shared rather than allocated.

        Returns the whole table, or None (taking nothing) when the pool has too few free blocks.
        """
        table = self._tables.get(request.request_id)
        if cached and table:
            raise ValueError(f"request {request.request_id!r} already has blocks; cached blocks start a table")
        table = table or list(cached)
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(table)
        # Taking a hit that sits in the free queue uses up a free block as surely as allocating one.
        if max(needed, 0) + self.block_pool.num_free_among(cached) > self.block_pool.num_free:
            return None
        self.block_pool.touch(cached)
        if needed > 0:
            table += self.block_pool.allocate(needed)
        self._tables[request.request_id] = table
        if cached:
            self._num_named[request.request_id] = len(cached)
        return list(table)

    def cache_computed_blocks(self, request: Request) -> list[tuple[int, BlockHash]]:
        """Name the request's blocks that are now full and computed; returns those that took a new
        name (a tier may want a copy of them)."""
        if not self.enable_caching:
            return []
        table = self._tables.get(request.request_id, [])
        start = self._num_named.get(request.request_id, 0)
        end = min(request.num_computed_tokens // self.block_size, len(table))
        if end <= start:
            return []
        hashes = self.block_hashes(request)
        named = [(table[i], hashes[i]) for i in range(start, end) if self.block_pool.cache(table[i], hashes[i])]
        self._num_named[request.request_id] = end
        return named

    def free(self, request: Request) -> None:
        self._num_named.pop(request.request_id, None)
        self.block_pool.free(reversed(self._tables.pop(request.request_id, [])))

    def block_table(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, []))

    def owned_blocks(self) -> dict[str, list[int]]:
        """Every request's table (copies): what an invariant check or a debugger wants to see."""
        return {request_id: list(table) for request_id, table in self._tables.items()}
