"""The per-step description of a packed (varlen) batch that the attention ops read."""

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each request's new tokens sit in the packed batch and where its KV lives.

    query_start_loc: int32 [B+1]; request i's new tokens are q[query_start_loc[i]:query_start_loc[i+1]].
    seq_lens:        int32 [B]; tokens in context for request i AFTER this step (computed before + new).
    block_tables:    int32 [B, max_blocks]; request i's physical KV blocks in order, padded with 0s.
    slot_mapping:    int64 [T]; cache slot of each packed token (block_id * block_size + offset),
                     -1 for padding tokens, which are not written.
    backend:         "torch" (reference, any device), "triton", or one a device backend registered
                     (`ops.register_backend`; the CPU kernels are "cpu").
    decode_only:     every row is one decode token (q row i is request i's). The torch backend then
                     traces decode attention (`decode_torch.py`) into a compiled graph instead of
                     calling the general opaque op; other backends serve every step kind alike.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    backend: str = "torch"
    decode_only: bool = False
