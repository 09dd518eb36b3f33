"""Names for full KV blocks: a hash chained over the parent block's hash, the block's token ids and
extra keys (a tenant's `cache_salt`, on the first block only: the chain carries it to every later one).

Two blocks with the same name hold the same KV, whoever computed them, so a block can be shared by
name (prefix caching) and looked up in a slower tier or another process (the disk tier), which is why
the hash is hashlib's (stable across processes and runs) and not Python's `hash`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra:
        h.update(b"\x01")
        h.update(extra)
    return h.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None = None) -> list[BlockHash]:
    """Append the names of the full blocks of token_ids not yet named; returns the same list."""
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[index - 1] if index else None
        extra = cache_salt.encode() if cache_salt and index == 0 else b""
        hashes.append(hash_block(parent, token_ids[index * block_size:(index + 1) * block_size], extra))
    return hashes
