"""The KV transfer interface, scheduler side: moving whole KV blocks between the device cache and
somewhere else (a CPU or disk tier here; another instance, for disaggregated prefill and decode).

The idea is vLLM's KV connector, in our own words. The scheduler asks a connector how many more
blocks of a new request's prefix it can bring in, tells it which device blocks it allocated for
them, which cached blocks it is evicting and which blocks became computed; the connector answers
with one `KVTransferPlan` per step, a field of the step plan (`SchedulerOutput.kv_transfer`). The
worker side (`attention/kv_transfer.py`) carries the plan out on the device, in this order:

1. `saves`: device -> outside. They read the device cache before anything in the step writes it, so
   a block evicted and handed to another request in the same step is still whole when it is read.
2. `loads`: outside -> device, into blocks allocated for them in this step, before the forward.
3. `deletes`: entries the connector dropped (bounded tiers), whenever convenient.

A load can fail (a torn or corrupt file, another process removed it): the worker reports it and the
scheduler takes the request out of the step and recomputes those tokens (`Scheduler.transfers_failed`).
Nothing here imports torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from .block_hash import BlockHash
from .request import Request


@dataclass(frozen=True)
class BlockCopy:
    """One block moved between the device cache and an entry of a tier."""

    block_id: int  # the device block
    tier: str  # "cpu" or "disk" (another connector names its own)
    key: str  # the entry's name: a block hash in hex, or a swapped request's block
    slot: int = -1  # the CPU tier's slot for the entry


@dataclass
class KVTransferPlan:
    saves: list[BlockCopy] = field(default_factory=list)
    loads: list[BlockCopy] = field(default_factory=list)
    deletes: list[BlockCopy] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.deletes)


class KVConnectorScheduler(ABC):
    """What the scheduler asks of a KV connector; every method but the first four has a default."""

    tiers: tuple[str, ...] = ()  # the tier names of the copies it plans (several connectors: multi_connector.py)

    @abstractmethod
    def num_matched_blocks(self, request: Request, hashes: list[BlockHash]) -> int:
        """How many leading blocks of `hashes` (the request's blocks after its device-cached prefix)
        the connector can load."""

    @abstractmethod
    def blocks_allocated(self, request: Request, block_ids: list[int], hashes: list[BlockHash]) -> None:
        """The scheduler gave these device blocks to the matched blocks: plan their loads."""

    @abstractmethod
    def build_plan(self) -> KVTransferPlan:
        """This step's transfers; called once at the end of every schedule()."""

    @abstractmethod
    def transfers_failed(self, copies: list[BlockCopy]) -> None:
        """The worker could not carry these out: forget the entries they came from."""

    def loads_dropped(self, copies: list[BlockCopy]) -> None:
        """These loads arrived, but for requests the step dropped because another of their loads failed
        (they recompute): not hits, though their entries are sound."""

    def blocks_evicted(self, evicted: list[tuple[int, BlockHash]]) -> None:
        """Cached device blocks handed to new owners in this step (their KV is still whole until the
        step's saves have run)."""

    def blocks_computed(self, request: Request, blocks: list[tuple[int, BlockHash]]) -> None:
        """Full blocks of the request that were just computed and named."""

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        """The request ended; its blocks are freed after this call."""

    def held_tokens(self, request_id: str) -> int:
        """Tokens of the request's own KV that the connector holds outside the device (its blocks
        swapped out, or its prompt prefilled by another instance): admitting it loads them instead
        of computing them. 0 when it holds none."""
        return 0

    def held_after_prefix(self, request_id: str) -> bool:
        """Whether the request's held KV may start after a prefix found on the device or in the tiers
        (a prompt prefilled elsewhere: the same tokens' KV wherever it comes from). Then `load_held`
        gets -1 for the blocks found here, whose held copies are dropped. Swapped-out KV: no."""
        return False

    def load_held(self, request: Request, block_ids: list[int]) -> None:
        """The scheduler gave these device blocks to the held KV (held_tokens' worth): plan its loads."""
        raise NotImplementedError(f"{type(self).__name__} holds no request's KV")

    def stats(self) -> dict:
        return {}
