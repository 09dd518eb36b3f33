"""Per-request block tables over a BlockPool."""

from __future__ import annotations

from .block_pool import BlockPool
from .request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1:
            raise ValueError(f"KVCacheManager needs block_size >= 1, got {block_size}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Grow the request's table to cover num_computed_tokens + num_new_tokens tokens.

        Returns the whole table, or None (allocating nothing) when the pool has too few free blocks.
        """
        table = self._tables.get(request.request_id, [])
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(table)
        if needed > 0:
            new_blocks = self.block_pool.allocate(needed)
            if new_blocks is None:
                return None
            table = table + new_blocks
            self._tables[request.request_id] = table
        return list(table)

    def free(self, request: Request) -> None:
        self.block_pool.free(self._tables.pop(request.request_id, []))

    def block_table(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, []))

    def owned_blocks(self) -> dict[str, list[int]]:
        """Every request's table (copies): what an invariant check or a debugger wants to see."""
        return {request_id: list(table) for request_id, table in self._tables.items()}
