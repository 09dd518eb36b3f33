"""The KV memory hierarchy's bookkeeping: which blocks the CPU and disk tiers hold, their LRU order,
and swapped-out requests. The bytes are moved by the worker side (attention/kv_transfer.py).

- CPU tier: a fixed number of slots. A named block the device cache evicts is copied into a slot
  (the least recently used entry gives way); a prefix hit on it copies it back.
- Disk tier: one file per named block under a directory keyed by the model's fingerprint, written
  through as blocks are computed (so a later process finds them), bounded in bytes, LRU.
- Swap preemption: a preempted request's blocks go to CPU slots that nothing evicts, and come back
  when it resumes.

A slot read by a load in the plan being built is never handed to a save in the same plan (saves run
first), and slots given up in a plan are reused only in the next one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from .block_hash import BlockHash
from .kv_transfer import BlockCopy, KVConnectorScheduler, KVTransferPlan
from .request import Request

DIRECTIONS = ("device_to_cpu", "cpu_to_device", "device_to_disk", "disk_to_device")


@dataclass
class TierStats:
    hit_blocks: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "disk": 0})
    copied_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    failed_loads: int = 0
    swapped_out: int = 0  # requests
    swapped_in: int = 0


class DiskResidency:
    """The entries of one fingerprint's directory, least recently used first, within a byte budget."""

    def __init__(self, entries: list[str], capacity_bytes: int, entry_bytes: int):
        """`entries`: what the directory holds, least recently used first (the worker lists it)."""
        self.capacity_bytes = capacity_bytes
        self.entry_bytes = entry_bytes  # one block's file, header included (every entry's size)
        self._entries: OrderedDict[str, None] = OrderedDict.fromkeys(entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def touch(self, key: str) -> None:
        self._entries.move_to_end(key)

    def add(self, key: str) -> list[str]:
        """Record a new entry; returns the entries evicted to keep within the budget."""
        self._entries[key] = None
        evicted = []
        while len(self._entries) * self.entry_bytes > self.capacity_bytes and len(self._entries) > 1:
            old, _ = self._entries.popitem(last=False)
            evicted.append(old)
        return evicted

    def discard(self, key: str) -> None:
        self._entries.pop(key, None)


class TieredKVConnector(KVConnectorScheduler):
    tiers = ("cpu", "disk")

    def __init__(self, block_size: int, cpu_blocks: int = 0, disk: DiskResidency | None = None):
        self.block_size = block_size
        self.cpu_blocks = cpu_blocks
        self.disk = disk
        self._cpu: OrderedDict[str, int] = OrderedDict()  # key -> slot, least recently used first
        self._free_slots = list(range(cpu_blocks - 1, -1, -1))
        self._swapped: dict[str, tuple[list[int], int]] = {}  # request id -> (slots, computed tokens)
        self._plan = KVTransferPlan()
        self._read_slots: set[int] = set()  # slots loads of the plan being built read
        self._released: list[int] = []  # slots given up in this plan, free from the next
        self.tier_stats = TierStats()

    # ---- prefix hits ----------------------------------------------------------------------------

    def num_matched_blocks(self, request: Request, hashes: list[BlockHash]) -> int:
        n = 0
        for block_hash in hashes:
            key = block_hash.hex()
            if key not in self._cpu and (self.disk is None or key not in self.disk):
                break
            n += 1
        return n

    def blocks_allocated(self, request: Request, block_ids: list[int], hashes: list[BlockHash]) -> None:
        for block_id, block_hash in zip(block_ids, hashes):
            key = block_hash.hex()
            if key in self._cpu:
                self._cpu.move_to_end(key)
                slot = self._cpu[key]
                self._read_slots.add(slot)
                self._plan.loads.append(BlockCopy(block_id, "cpu", key, slot))
            else:
                self.disk.touch(key)
                self._plan.loads.append(BlockCopy(block_id, "disk", key))
            self.tier_stats.hit_blocks[self._plan.loads[-1].tier] += 1

    # ---- what the device gives up ---------------------------------------------------------------

    def blocks_evicted(self, evicted: list[tuple[int, BlockHash]]) -> None:
        for block_id, block_hash in evicted:
            key = block_hash.hex()
            if key in self._cpu:
                self._cpu.move_to_end(key)
                continue
            slot = self._take_slot()
            if slot is None:
                return  # every slot is swapped out or read in this step
            self._cpu[key] = slot
            self._plan.saves.append(BlockCopy(block_id, "cpu", key, slot))

    def blocks_computed(self, request: Request, blocks: list[tuple[int, BlockHash]]) -> None:
        if self.disk is None:
            return
        for block_id, block_hash in blocks:
            key = block_hash.hex()
            if key in self.disk:
                self.disk.touch(key)
                continue
            self._plan.saves.append(BlockCopy(block_id, "disk", key))
            self._plan.deletes += [BlockCopy(-1, "disk", old) for old in self.disk.add(key)]

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        self.drop_swap(request.request_id)

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for key, slot in self._cpu.items():  # least recently used first
            if slot not in self._read_slots:
                del self._cpu[key]
                return slot
        return None

    # ---- swap preemption ------------------------------------------------------------------------

    def swap_out(self, request: Request, block_ids: list[int]) -> bool:
        """Copy a preempted request's computed blocks to CPU slots nothing evicts; False (copying
        nothing) when the tier cannot hold them all."""
        available = len(self._free_slots) + sum(1 for s in self._cpu.values() if s not in self._read_slots)
        if not block_ids or len(block_ids) > available:
            return False
        slots = [self._take_slot() for _ in block_ids]
        rid = request.request_id
        self._plan.saves += [BlockCopy(b, "cpu", f"swap:{rid}:{i}", s) for i, (b, s) in enumerate(zip(block_ids, slots))]
        self._swapped[rid] = (slots, request.num_computed_tokens)
        self.tier_stats.swapped_out += 1
        return True

    def held_tokens(self, request_id: str) -> int:
        """A swapped-out request's computed tokens (0 for any other)."""
        entry = self._swapped.get(request_id)
        return entry[1] if entry else 0

    def load_held(self, request: Request, block_ids: list[int]) -> None:
        """Swap a preempted request back in."""
        slots, _ = self._swapped.pop(request.request_id)
        rid = request.request_id
        self._plan.loads += [BlockCopy(b, "cpu", f"swap:{rid}:{i}", s) for i, (b, s) in enumerate(zip(block_ids, slots))]
        self._read_slots.update(slots)
        self._released += slots
        self.tier_stats.swapped_in += 1

    def drop_swap(self, request_id: str) -> None:
        entry = self._swapped.pop(request_id, None)
        if entry is not None:
            self._released += entry[0]

    # ---- the step's plan ------------------------------------------------------------------------

    def build_plan(self) -> KVTransferPlan:
        plan, self._plan = self._plan, KVTransferPlan()
        for copy in plan.saves:
            self.tier_stats.copied_blocks[f"device_to_{copy.tier}"] += 1
        for copy in plan.loads:
            self.tier_stats.copied_blocks[f"{copy.tier}_to_device"] += 1
        self._free_slots += self._released
        self._released, self._read_slots = [], set()
        return plan

    def transfers_failed(self, copies: list[BlockCopy]) -> None:
        for copy in copies:
            # Counted as hits and copies when planned; a load that failed was neither.
            self.tier_stats.failed_loads += 1
            self.tier_stats.copied_blocks[f"{copy.tier}_to_device"] -= 1
            if not copy.key.startswith("swap:"):
                self.tier_stats.hit_blocks[copy.tier] -= 1
            if copy.tier == "disk" and self.disk is not None:
                self.disk.discard(copy.key)
            elif copy.tier == "cpu" and self._cpu.get(copy.key) == copy.slot:
                self._free_slots.append(self._cpu.pop(copy.key))

    def loads_dropped(self, copies: list[BlockCopy]) -> None:
        for copy in copies:
            if not copy.key.startswith("swap:"):
                self.tier_stats.hit_blocks[copy.tier] -= 1  # counted when planned

    def reset(self) -> None:
        """Forget the CPU tier's cached blocks (swapped-out requests keep theirs; the disk tier is kept:
        outliving the process is its point)."""
        swapped = {slot for slots, _ in self._swapped.values() for slot in slots}
        self._cpu.clear()
        self._free_slots = [s for s in range(self.cpu_blocks - 1, -1, -1) if s not in swapped]

    def stats(self) -> dict:
        s = self.tier_stats
        return {"cpu_blocks": self.cpu_blocks, "cpu_entries": len(self._cpu), "disk_entries": len(self.disk or ()),
                "hit_blocks": dict(s.hit_blocks), "copied_blocks": dict(s.copied_blocks),
                "failed_loads": s.failed_loads, "swapped_out": s.swapped_out, "swapped_in": s.swapped_in}
