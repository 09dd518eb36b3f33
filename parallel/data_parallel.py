"""Data parallelism: dp independent replicas (each pp x tp ranks with its own engine), requests split.

Every rank sees the whole prompt list and computes the same split, so no request list is ever sent.
The split balances tokens, not counts: a request costs its prompt plus the tokens it may generate,
because one long request can take as long as many short ones. Each replica runs its share through
its own engine; the outputs are gathered on global rank 0, which returns them in input order.
"""

from __future__ import annotations

import torch.distributed as dist


def request_cost(prompt_len: int, max_tokens: int | None, n: int, max_model_len: int) -> int:
    """Tokens a request may take: its prompt and up to max_tokens per sequence, n sequences."""
    new = max_tokens if max_tokens is not None else max_model_len - prompt_len
    return n * (prompt_len + new)


def split_by_tokens(costs: list[int], num_replicas: int) -> list[list[int]]:
    """Request indices per replica, each replica's list in input order.

    Longest first onto the least-loaded replica (ties to the lower replica and the earlier request),
    a deterministic greedy that keeps the largest load within one request of the best split.
    """
    loads = [0] * num_replicas
    shares: list[list[int]] = [[] for _ in range(num_replicas)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        replica = min(range(num_replicas), key=lambda r: (loads[r], r))
        shares[replica].append(i)
        loads[replica] += costs[i]
    return [sorted(share) for share in shares]


def my_share(state, costs: list[int]) -> list[int]:
    """The indices this rank's replica serves (all of them without data parallelism)."""
    if state is None or state.dp_size == 1:
        return list(range(len(costs)))
    return split_by_tokens(costs, state.dp_size)[state.dp_rank]


def gather_replicas(state, obj) -> list | None:
    """One picklable object from each replica (its first rank: pipeline stage 0, TP rank 0), in replica
    order, on global rank 0; None on every other rank. Every rank of a replica holds the same results
    (TP ranks sample alike, a pipeline's last stage sends its tokens to all): one copy is sent."""
    if state.dp_size == 1:
        return [obj] if state.is_main else None
    mine = obj if state.rank % state.replica_size == 0 else None
    parts = [None] * state.world_size if state.is_main else None
    dist.gather_object(mine, parts, dst=0, group=state.gather_group)
    if not state.is_main:
        return None
    return parts[:: state.replica_size]  # global ranks dp * pp * tp: each replica's first rank


class Lockstep:
    """Data-parallel replicas that must step together: with expert parallelism every rank of every
    replica enters each MoE layer's all-to-all, so each replica runs the same number of forwards.

    Once per step (`Engine.has_unfinished`) every rank says whether its replica still has work, and
    all of them learn whether any replica does (one all-reduce of one int over a CPU group); a replica
    with nothing scheduled then runs a one-token dummy forward (`Engine.step`), as vLLM's DP ranks do,
    and the job's loops end on all replicas at the same step, when none has work left."""

    def __init__(self, group):
        self.group = group
        self.steps = 0  # agreements so far
        self.dummy_steps = 0  # forwards this replica ran with nothing of its own to compute

    def any_busy(self, busy: bool) -> bool:
        import torch

        flag = torch.tensor([int(busy)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.steps += 1
        return bool(flag.item())
