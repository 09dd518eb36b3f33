"""A scheduled step as tensors: the packed tokens, their positions and KV slots, the attention
metadata, and which rows are sampled (`build`).

One path for every step kind. The per-request work is plain Python over the scheduler's lists and
the tensors are made in a handful of calls: a decode step's host work is counted in library calls,
since each one runs in the cold caches the step's weight stream leaves behind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.attention import AttentionMetadata
from toolkit.scheduling import ScheduledRequest

# Compiled steps whose token count must stay backed (a real size, not an unbacked one) pad it to at
# least this, since dynamo specializes size 1: the torch attention backend's traced decode attention
# and DTensor's sharding rules (tensor parallel) reason about it.
MIN_TOKENS = 2


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T_padded] int64
    positions: torch.Tensor  # [T_padded] int64
    meta: AttentionMetadata
    # [S + P] int64: the last packed token of each request that samples (and its drafts), then the
    # prompt positions whose logits a request wants (ScheduledRequest.num_prompt_logits)
    logits_indices: torch.Tensor
    num_tokens: int  # T before padding
    decode_only: bool = False  # every request feeds one token and samples
    num_prompt_rows: int = 0  # P: the last P logits rows are prompt positions, after every sampled row


def build(scheduled: list[ScheduledRequest], *, block_size: int, num_blocks: int, backend: str, device: torch.device,
          pad_tokens: bool = False, rows_are_tokens: bool = False) -> StepInputs:
    """The tensors of one step. `pad_tokens`: at least MIN_TOKENS packed tokens. `rows_are_tokens` (the
    torch backend, compiled; implies padding): a decode-only step gets one attention row per token,
    padding included, as the backend's traced decode attention reads them."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    starts = [0]
    tables: list[list[int]] = []
    sampled: list[int] = []
    prompt_rows: list[int] = []  # go after every sampled row: a sampler reads the same rows with or without them
    for r in scheduled:
        start, n = r.start_position, len(r.token_ids)
        end = start + n
        table = r.block_table[: (end + block_size - 1) // block_size]
        if len(table) * block_size < end or (table and not 0 <= min(table) <= max(table) < num_blocks):
            # The compiled graphs write the cache through these slots without bounds checks.
            raise RuntimeError(f"request {r.request_id}'s block table {table} does not hold positions up to {end} "
                               f"in [0, {num_blocks}) blocks: a scheduler bug, please report")
        ids += r.token_ids
        if n == 1:
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            positions += range(start, end)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        seq_lens.append(end)
        starts.append(starts[-1] + n)
        tables.append(table)
        if r.samples:
            # A verify step samples after its last token and after each draft (speculative/).
            sampled += range(starts[-1] - 1 - r.num_draft_tokens, starts[-1])
        prompt_rows += range(starts[-2], starts[-2] + r.num_prompt_logits)
    num_tokens = len(ids)
    decode_only = num_tokens == len(scheduled) and len(sampled) == num_tokens
    padding = max(0, MIN_TOKENS - num_tokens) if pad_tokens or rows_are_tokens else 0
    if padding:
        ids += [0] * padding
        positions += [0] * padding
        slots += [-1] * padding  # not written
        if decode_only and rows_are_tokens:
            # A padding row attends to slot 0 of block 0 (always allocated) and is never read.
            starts += [starts[-1] + i for i in range(1, padding + 1)]
            seq_lens += [1] * padding
            tables += [[0]] * padding
    width = max(map(len, tables), default=0)
    # Every tensor its own, none a view of another: a compiled graph guards on a view's base sizes.
    as_int64 = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        slot_mapping=as_int64(slots),
        backend=backend,
        decode_only=decode_only,
    )
    return StepInputs(as_int64(ids), as_int64(positions), meta, as_int64(sampled + prompt_rows), num_tokens,
                      decode_only, len(prompt_rows))


def mark_dynamic_sizes(inputs: StepInputs, tokens_backed: bool, rows_are_tokens: bool) -> None:
    """Batch sizes of 0 or 1 and coincidentally equal sizes would each cost a recompile (dynamo
    specializes 0/1 and "duck-sizes" equal dims); unbacked sizes make one graph serve them all, with
    no padding: a batch-1 decode computes one row.

    With `tokens_backed` (see `build`'s padding) the packed token count stays backed; with
    `rows_are_tokens`, in a decode-only step so do the row sizes, so the graph knows they are equal.
    """
    from torch._dynamo.decorators import mark_unbacked

    meta = inputs.meta
    per_row = () if rows_are_tokens and inputs.decode_only else (meta.query_start_loc, meta.seq_lens, meta.block_tables)
    per_token = () if tokens_backed or rows_are_tokens else (inputs.input_ids, inputs.positions, meta.slot_mapping)
    for t in (*per_row, *per_token, inputs.logits_indices):
        mark_unbacked(t, 0)
    mark_unbacked(meta.block_tables, 1)


def mark_dynamic_hidden(hidden: torch.Tensor, tokens_backed: bool) -> None:
    """A pipeline stage's incoming hidden states [T, H]: T is a token count, dynamic like the packed
    tokens' (unbacked unless the step keeps its token count backed)."""
    from torch._dynamo.decorators import mark_unbacked

    if not tokens_backed:
        mark_unbacked(hidden, 0)
