"""The KV memory hierarchy, assembled from the config: the CPU and disk tiers' bookkeeping (a
`scheduling.kv_tiers.TieredKVConnector` the scheduler asks) and their byte mover (an
`attention.kv_transfer.TieredKVWorker` the engine runs each step's transfers through); and the
tiers beside a disaggregated role's remote handoff (`combine_kv_movers`: several connectors at once).

A tier that cannot be had (more host memory than is free, a directory that cannot be written, a
disk without room) is left out with one warning; the run goes on with the tiers it has.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.attention import available_memory_bytes
from toolkit.attention.kv_transfer import KVConnectorWorker, TieredKVWorker, run_transfers
from toolkit.scheduling.kv_tiers import DiskResidency, TieredKVConnector
from toolkit.scheduling.multi_connector import MultiConnector, plan_for
from toolkit.metrics import Counter

log = logging.getLogger("toolkit")

GIB = 2**30
FORMAT_VERSION = 1  # of the disk entries' layout; a change makes every older entry a miss


@dataclass
class KVHierarchy:
    connector: TieredKVConnector
    worker: TieredKVWorker
    block_bytes: int  # one block's KV on this rank, all its layers

    def transfer(self, plan) -> list:
        """Run one step's plan on this rank's layers and KV heads; returns the loads that failed here
        (the executor makes every rank of the replica drop the same ones)."""
        return run_transfers(self.worker, plan, len(self.worker.kv_caches))

    def metrics(self) -> list:
        s = self.stats()
        out = [Counter("toolkit:prefix_cache_hits_tier", {"tier": t}, n) for t, n in s["hit_tokens"].items()]
        out += [Counter("toolkit:kv_transfer_bytes", {"direction": d}, n) for d, n in s["bytes_moved"].items()]
        return out + [Counter("toolkit:kv_transfer_failed_loads", value=s["failed_loads"])]

    def stats(self) -> dict:
        """The connector's counters, with the hits in tokens and the copies in bytes beside the blocks."""
        stats = self.connector.stats()
        stats["hit_tokens"] = {t: n * self.connector.block_size for t, n in stats["hit_blocks"].items()}
        stats["bytes_moved"] = {d: n * self.block_bytes for d, n in stats["copied_blocks"].items()}
        return stats

    def close(self) -> None:
        self.worker.close()


class MultiKVWorker(KVConnectorWorker):
    """Several connectors' workers as one: each gets the copies of its own tiers, and every worker's
    saves run before any worker's loads (a block a finished request gave up may be loaded into in
    the same step, after another connector's save has read it)."""

    def __init__(self, parts: list[tuple[tuple[str, ...], KVConnectorWorker]]):
        self.parts = parts  # (tiers, worker)
        self.kv_caches = parts[0][1].kv_caches
        self._plan, self._split = None, []

    def _plans(self, plan) -> list:
        if plan is not self._plan:
            self._plan, self._split = plan, [plan_for(plan, tiers) for tiers, _ in self.parts]
        return self._split

    def save_kv_layer(self, layer: int, plan) -> None:
        for (_, worker), mine in zip(self.parts, self._plans(plan)):
            worker.save_kv_layer(layer, mine)

    def wait_for_save(self) -> None:
        for _, worker in self.parts:
            worker.wait_for_save()

    def start_load_kv(self, plan) -> None:
        for (_, worker), mine in zip(self.parts, self._plans(plan)):
            worker.start_load_kv(mine)

    def wait_for_layer_load(self, layer: int) -> None:
        for _, worker in self.parts:
            worker.wait_for_layer_load(layer)

    def get_finished(self) -> list:
        self._plan, self._split = None, []
        return [copy for _, worker in self.parts for copy in worker.get_finished()]

    def close(self) -> None:
        for _, worker in self.parts:
            worker.close()


@dataclass
class MultiKVMover:
    """The engine's KV mover when several connectors run at once: the scheduler asks `connector` (a
    MultiConnector), each step's plan runs through `worker`; metrics are the parts' own."""

    parts: list  # each with .connector, .worker, .metrics()
    connector: MultiConnector
    worker: MultiKVWorker

    def transfer(self, plan) -> list:
        return run_transfers(self.worker, plan, len(self.worker.kv_caches))

    def metrics(self) -> list:
        return [m for part in self.parts for m in part.metrics()]

    def close(self) -> None:
        self.worker.close()


def combine_kv_movers(*movers):
    """One KV mover over those given (None ones left out): the tiers first, so a prefix hit is theirs."""
    movers = [m for m in movers if m is not None]
    if len(movers) < 2:
        return movers[0] if movers else None
    return MultiKVMover(movers, MultiConnector([m.connector for m in movers]),
                        MultiKVWorker([(m.connector.tiers, m.worker) for m in movers]))


def build_kv_hierarchy(config, model_config, kv_caches: list[torch.Tensor], block_bytes: int,
                       tp=None, stage=None, group=None) -> KVHierarchy | None:
    """The tiers the config asks for and the machine allows, or None for none. Under tensor or
    pipeline parallelism each rank holds its share of every block (`tp`: its KV heads; `stage`: its
    layers) in its own tiers, and the ranks of `group` (the replica) agree on one block count, disk
    budget and set of disk entries, since their schedulers must make the same choices."""
    cpu_blocks = _agree(_cpu_blocks(config, block_bytes), group)
    disk_dir = _disk_dir(config, model_config, tp, stage)
    entry_bytes = block_bytes + 1024  # the header
    disk_capacity = _disk_capacity(config, disk_dir, entry_bytes) if disk_dir else 0
    # An entry's bytes differ per stage: the budget is agreed in entries, the smallest rank's.
    disk_entries = _agree(disk_capacity // entry_bytes, group) if config.kv_disk_cache_dir is not None else 0
    disk_capacity = disk_entries * entry_bytes
    if not disk_capacity:
        disk_dir = None
    if not cpu_blocks and disk_dir is None:
        return None
    fingerprint = Path(disk_dir).name if disk_dir else ""
    worker = TieredKVWorker(kv_caches, cpu_blocks, disk_dir, fingerprint)
    disk = DiskResidency(_common(worker.disk_entries(), group), disk_capacity, entry_bytes) if disk_dir else None
    connector = TieredKVConnector(config.block_size, cpu_blocks, disk)
    log.info("KV tiers: CPU %d blocks (%.2f GiB); disk %s", cpu_blocks, cpu_blocks * block_bytes / GIB,
             f"{disk_dir} ({disk_capacity / GIB:.2f} GiB, {len(disk)} entries found)" if disk else "off")
    return KVHierarchy(connector, worker, block_bytes)


def _agree(value: int, group) -> int:
    """The smallest of the group's values (the value itself without a group)."""
    if group is None:
        return value
    import torch.distributed as dist

    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def _common(entries: list[str], group) -> list[str]:
    """The disk entries every rank of the group holds, in this rank's (least recently used first)
    order: a block whose share one rank lacks is a miss for all."""
    if group is None:
        return entries
    import torch.distributed as dist

    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, entries, group=group)
    held = set(entries).intersection(*map(set, every))
    return [e for e in entries if e in held]


def _cpu_blocks(config, block_bytes: int) -> int:
    if config.kv_offloading_size is None:
        return 0
    wanted = int(config.kv_offloading_size * GIB)
    free = available_memory_bytes("cpu")
    if wanted > free:
        log.warning("KV CPU tier: kv_offloading_size %.2f GiB is more than the %.2f GiB of host memory free; "
                    "running without the CPU tier", config.kv_offloading_size, free / GIB)
        return 0
    blocks = wanted // block_bytes
    if blocks < 1:
        log.warning("KV CPU tier: kv_offloading_size %.4f GiB holds no block of %d bytes; running without it",
                    config.kv_offloading_size, block_bytes)
    return blocks


def _disk_dir(config, model_config, tp, stage=None) -> str | None:
    if config.kv_disk_cache_dir is None:
        return None
    path = Path(config.kv_disk_cache_dir).expanduser() / kv_fingerprint(config, model_config, tp, stage)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe.{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        log.warning("KV disk tier: cannot write to %s (%s); running without the disk tier", path, e)
        return None
    return str(path)


def _disk_capacity(config, disk_dir: str, entry_bytes: int) -> int:
    wanted = int(config.kv_disk_cache_size * GIB)
    # The tier's own entries count as room: they are what it evicts to make more.
    free = shutil.disk_usage(disk_dir).free + sum(e.stat().st_size for e in os.scandir(disk_dir) if e.is_file())
    if free < entry_bytes:
        log.warning("KV disk tier: %s has no room for one block (%d bytes); running without the disk tier",
                    disk_dir, entry_bytes)
        return 0
    if wanted > free:
        log.warning("KV disk tier: kv_disk_cache_size %.2f GiB is more than the %.2f GiB free at %s; using %.2f GiB",
                    config.kv_disk_cache_size, free / GIB, disk_dir, free * 0.9 / GIB)
        return int(free * 0.9)
    return wanted


def kv_fingerprint(config, model_config, tp=None, stage=None) -> str:
    """Names whose KV a disk entry holds: the checkpoint (its config and a sample of its weight files'
    bytes), the dtype, block size, KV layout and this rank's shard (TP rank, pipeline stage's layers),
    so another model or another shard never reads it."""
    h = hashlib.blake2b(digest_size=12)
    model = Path(model_config.path)
    if model.is_file():  # a GGUF file: its metadata is in its first MiB
        h.update(_sample(model))
    else:
        h.update((model / "config.json").read_bytes())
    if config.load_format == "dummy":
        h.update(f"dummy weights, seed {config.seed}".encode())
    elif model.is_dir():
        for file in sorted(model.glob("*.safetensors")):
            h.update(_sample(file))
    layout = {"format": FORMAT_VERSION, "dtype": str(config.dtype), "block_size": config.block_size,
              "layers": model_config.num_layers, "kv_heads": tp.num_kv_heads_local if tp else model_config.num_kv_heads,
              "head_dim": model_config.head_dim, "layout": "[2, block, kv_head, head_dim] per layer",
              "tp": [tp.rank, tp.size] if tp else [0, 1]}
    if stage is not None:
        layout["stage_layers"] = [stage.layers.start, stage.layers.stop]
    h.update(json.dumps(layout, sort_keys=True).encode())
    return h.hexdigest()


def _sample(file: Path, span: int = 1 << 20) -> bytes:
    """A weight file's name, size and first and last MiB: enough to tell two checkpoints apart
    without reading gigabytes at every start."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(span)
        f.seek(max(0, size - span))
        tail = f.read(span)
    return f"{file.name}:{size}:".encode() + hashlib.blake2b(head + tail).digest()
