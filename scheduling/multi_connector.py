"""Several KV connectors at once, scheduler side (vLLM's MultiConnector idea): the CPU and disk tiers
beside a disaggregated role's remote handoff, so a decode instance keeps its own prefix cache, tiers
and swap while it receives prompts' KV, and a prefill instance writes through to its disk tier while
it sends.

Each connector plans copies of its own tiers only (`tiers`: the names its `BlockCopy`s carry), so a
step's plan is the concatenation of theirs and a failed or dropped copy goes back to the connector
whose tier it names. A prefix match is the first connector's that finds one (the tiers; a role's
connectors match no cached block); a request's held KV (swapped out, or prefilled elsewhere) is the
one connector's that holds it; everything the scheduler reports about blocks and requests goes to all.
Nothing here imports torch.
"""

from __future__ import annotations

from .block_hash import BlockHash
from .kv_transfer import BlockCopy, KVConnectorScheduler, KVTransferPlan
from .request import Request


def plan_for(plan: KVTransferPlan, tiers: tuple[str, ...]) -> KVTransferPlan:
    """The copies of `plan` that name one of `tiers`, in their order."""
    return KVTransferPlan(saves=[c for c in plan.saves if c.tier in tiers],
                          loads=[c for c in plan.loads if c.tier in tiers],
                          deletes=[c for c in plan.deletes if c.tier in tiers])


class MultiConnector(KVConnectorScheduler):
    def __init__(self, connectors: list[KVConnectorScheduler]):
        self.connectors = connectors
        self.tiers = tuple(t for c in connectors for t in c.tiers)
        self._matched: dict[str, KVConnectorScheduler] = {}  # request id -> the connector its prefix hit is in
        # Swap preemption and reset_prefix_cache go to the connector that has them (the tiers).
        for name in ("swap_out", "reset"):
            owner = next((c for c in connectors if hasattr(c, name)), None)
            if owner is not None:
                setattr(self, name, getattr(owner, name))

    def num_matched_blocks(self, request: Request, hashes: list[BlockHash]) -> int:
        self._matched.pop(request.request_id, None)
        for c in self.connectors:
            n = c.num_matched_blocks(request, hashes)
            if n:
                self._matched[request.request_id] = c
                return n
        return 0

    def blocks_allocated(self, request: Request, block_ids: list[int], hashes: list[BlockHash]) -> None:
        self._matched.pop(request.request_id).blocks_allocated(request, block_ids, hashes)

    def blocks_evicted(self, evicted: list[tuple[int, BlockHash]]) -> None:
        for c in self.connectors:
            c.blocks_evicted(evicted)

    def blocks_computed(self, request: Request, blocks: list[tuple[int, BlockHash]]) -> None:
        for c in self.connectors:
            c.blocks_computed(request, blocks)

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        self._matched.pop(request.request_id, None)
        for c in self.connectors:
            c.request_finished(request, block_ids)

    def _holder(self, request_id: str) -> KVConnectorScheduler | None:
        return next((c for c in self.connectors if c.held_tokens(request_id)), None)

    def held_tokens(self, request_id: str) -> int:
        holder = self._holder(request_id)
        return holder.held_tokens(request_id) if holder is not None else 0

    def held_after_prefix(self, request_id: str) -> bool:
        holder = self._holder(request_id)
        return holder is not None and holder.held_after_prefix(request_id)

    def load_held(self, request: Request, block_ids: list[int]) -> None:
        self._holder(request.request_id).load_held(request, block_ids)

    def build_plan(self) -> KVTransferPlan:
        plan = KVTransferPlan()
        for c in self.connectors:
            part = c.build_plan()
            plan.saves += part.saves
            plan.loads += part.loads
            plan.deletes += part.deletes
        return plan

    def transfers_failed(self, copies: list[BlockCopy]) -> None:
        for c in self.connectors:
            mine = [copy for copy in copies if copy.tier in c.tiers]
            if mine:
                c.transfers_failed(mine)

    def loads_dropped(self, copies: list[BlockCopy]) -> None:
        for c in self.connectors:
            mine = [copy for copy in copies if copy.tier in c.tiers]
            if mine:
                c.loads_dropped(mine)
