"""Disaggregated prefill and decode, the scheduler's side: two KV connectors on the transfer interface
(kv_transfer.py), one for each role. Nothing here imports torch; the bytes move in
parallel/disaggregated.py.

A prefill instance runs each request it is given as a prompt of all but the last token with one
sampled token (thrown away): that computes exactly the KV the decode instance needs. When such a
request ends, `PrefillConnector.request_finished` plans its blocks' saves (tier "remote", keyed by
the request); the step's saves read them before anything in the step writes them, so the blocks are
freed at once, as for any finished request, and never stranded. A request that failed on the
prefill side (rejected, or its step failed) is reported as such instead (`outcomes`), and the decode
instance computes its prompt itself.

A decode instance admits a request whose KV has arrived like a swapped-out one coming back: the
connector holds `num_tokens` of its KV (`held_tokens`), the scheduler allocates its blocks, and the
step's plan loads them (tier "remote") before the forward, which computes the last prompt token
and samples the first output token: from there the request is an ordinary decoding one. A request
that ends before its KV was loaded (aborted, rejected, failed) gets a `delete` (the worker receives
the message and drops it), so the prefill side's send always completes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .block_hash import BlockHash
from .kv_transfer import BlockCopy, KVConnectorScheduler, KVTransferPlan
from .request import Request, RequestStatus

REMOTE = "remote"  # the tier name of a block that goes to, or comes from, another instance


@dataclass
class HandoffStats:
    requests: int = 0  # sent (prefill side) or loaded (decode side)
    blocks: int = 0
    failed: int = 0  # prefill side: requests that ended without KV to send
    dropped: int = 0  # decode side: arrived KV received and thrown away (the request ended first)
    max_backlog: int = 0  # prefill side: the most requests held at once (computing or staged), seen by its first rank
    door_waits: int = 0  # prefill side: steps at which requests waited for room (prefill_backlog)
    aborted: int = 0  # requests aborted before their KV left (prefill) or arrived (decode)


@dataclass
class _Pending:
    saves: list[BlockCopy] = field(default_factory=list)
    outcomes: list[tuple[str, bool]] = field(default_factory=list)


class PrefillConnector(KVConnectorScheduler):
    """Plans the sends of the requests a prefill instance finishes: every request it runs is a handoff,
    but those it was told to keep (served there whole)."""

    tiers = (REMOTE,)

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.handoff_stats = HandoffStats()
        self._pending = _Pending()
        self._kept: set[str] = set()

    def keep(self, request_ids) -> None:
        """These requests (a whole request's sequences) are served here: their KV goes nowhere."""
        self._kept.update(request_ids)

    def num_matched_blocks(self, request: Request, hashes: list[BlockHash]) -> int:
        return 0

    def blocks_allocated(self, request: Request, block_ids: list[int], hashes: list[BlockHash]) -> None:
        raise AssertionError("a prefill connector matches no block")

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        if request.request_id in self._kept:
            self._kept.discard(request.request_id)
            return
        # A handoff request ends by length after its one thrown-away token; anything else failed here.
        ok = request.status is RequestStatus.FINISHED_LENGTH
        if ok:
            blocks = block_ids[:-(-request.num_prompt_tokens // self.block_size)]
            self._pending.saves += [BlockCopy(b, REMOTE, request.request_id, i) for i, b in enumerate(blocks)]
            self.handoff_stats.requests += 1
            self.handoff_stats.blocks += len(blocks)
        else:
            self.handoff_stats.failed += 1
        self._pending.outcomes.append((request.request_id, ok))

    def build_plan(self) -> KVTransferPlan:
        saves, self._pending.saves = self._pending.saves, []
        return KVTransferPlan(saves=saves)

    def refuse(self, request_id: str) -> None:
        """A request aborted before it was computed: its decode instance is told it has no KV coming."""
        self._pending.outcomes.append((request_id, False))
        self.handoff_stats.aborted += 1

    @property
    def has_outcomes(self) -> bool:
        return bool(self._pending.outcomes)

    def take_outcomes(self) -> list[tuple[str, bool]]:
        """(request id, whether its KV is being sent) of the requests ended since the last call: what
        the decode instances are told once the step's plan has been carried out."""
        outcomes, self._pending.outcomes = self._pending.outcomes, []
        return outcomes

    def transfers_failed(self, copies: list[BlockCopy]) -> None:
        raise AssertionError("a prefill connector loads nothing")

    def stats(self) -> dict:
        return vars(self.handoff_stats).copy()


class DecodeConnector(KVConnectorScheduler):
    """Holds the prompts' KV that prefill instances have sent (or are sending) until the scheduler
    admits their requests."""

    tiers = (REMOTE,)

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.handoff_stats = HandoffStats()
        self._held: dict[str, int] = {}  # request id -> tokens of KV waiting at the prefill instance
        self._plan = KVTransferPlan()

    def arrived(self, request_id: str, num_tokens: int) -> None:
        """The prefill side has computed (and is sending) the first `num_tokens` tokens' KV."""
        self._held[request_id] = num_tokens

    def held_tokens(self, request_id: str) -> int:
        return self._held.get(request_id, 0)

    def held_after_prefix(self, request_id: str) -> bool:
        return True  # the prompt's KV: a prefix found here is the same, and its sent blocks are dropped

    def load_held(self, request: Request, block_ids: list[int]) -> None:
        """Loads of every sent block in order (`slot`: its index in the message); a block id of -1
        is one found here (a prefix hit), received and dropped."""
        self._held.pop(request.request_id)
        self._plan.loads += [BlockCopy(b, REMOTE, request.request_id, i) for i, b in enumerate(block_ids)]
        self.handoff_stats.requests += 1
        self.handoff_stats.blocks += sum(b >= 0 for b in block_ids)

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        held = self._held.pop(request.request_id, None)
        if held is not None:
            self.discard(request.request_id, held)

    def discard(self, request_id: str, num_tokens: int) -> None:
        """A request that ended before its KV was loaded: the message is still received (and dropped,
        a delete whose `slot` is its block count), so the sender's send completes."""
        self._plan.deletes.append(BlockCopy(-1, REMOTE, request_id, -(-num_tokens // self.block_size)))
        self.handoff_stats.dropped += 1

    def num_matched_blocks(self, request: Request, hashes: list[BlockHash]) -> int:
        return 0

    def blocks_allocated(self, request: Request, block_ids: list[int], hashes: list[BlockHash]) -> None:
        raise AssertionError("a decode connector matches no cached block")

    def build_plan(self) -> KVTransferPlan:
        plan, self._plan = self._plan, KVTransferPlan()
        return plan

    def transfers_failed(self, copies: list[BlockCopy]) -> None:
        raise AssertionError("a failed receive ends the job (the process group is broken)")

    def stats(self) -> dict:
        return vars(self.handoff_stats).copy()
