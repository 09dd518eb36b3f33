"""The KV transfer interface, worker side, and the tiers' byte mover.

The plan is `scheduling.kv_transfer.KVTransferPlan` (lists `saves`, `loads`, `deletes` of copies
with `block_id`, `tier`, `key`, `slot`); this room reads it by those names and imports no scheduling.

`KVConnectorWorker` is the contract (see docs/architecture.md, "KV transfer"): the runner calls, per
step with a plan, `save_kv_layer` for every layer, `wait_for_save`, `start_load_kv`, then
`wait_for_layer_load` for every layer before the forward reads them, and `get_finished` for the
loads that failed. Saves run first because they read device blocks the step may overwrite.

`TieredKVWorker` carries out the plans of `scheduling.kv_tiers.TieredKVConnector`:
- the CPU tier is one host tensor per layer (pinned on CUDA, so copies can run asynchronously);
- the disk tier is one file per block: a header naming the model fingerprint, the entry, its shape,
  dtype and a checksum of the payload; written to a temporary name and renamed, so a reader sees a
  whole file or none, by one background thread (off the step's critical path). A load checks every
  field and the checksum, and reports the block as failed rather than use a torn or foreign file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor

import torch

log = logging.getLogger("toolkit")

MAGIC = b"TKKV\x01"
DISK_SUFFIX = ".kv"


class KVConnectorWorker(ABC):
    @abstractmethod
    def save_kv_layer(self, layer: int, plan) -> None:
        """Start copying layer `layer` of the plan's saved blocks out of the device cache."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Return once the device blocks the saves read may be overwritten."""

    @abstractmethod
    def start_load_kv(self, plan) -> None:
        """Start bringing the plan's loaded blocks into the device cache."""

    @abstractmethod
    def wait_for_layer_load(self, layer: int) -> None:
        """Return once layer `layer` of every loaded block is in the device cache."""

    @abstractmethod
    def get_finished(self) -> list:
        """The loads since the last call that failed (their blocks hold no valid KV)."""

    def close(self) -> None:
        """Finish background work (pending disk writes)."""


def run_transfers(worker: KVConnectorWorker, plan, num_layers: int) -> list:
    """One step's plan through the contract, in its order; returns the failed loads."""
    for layer in range(num_layers):
        worker.save_kv_layer(layer, plan)
    worker.wait_for_save()
    worker.start_load_kv(plan)
    # The compiled step reads every layer, so every layer is waited for before it runs.
    for layer in range(num_layers):
        worker.wait_for_layer_load(layer)
    return worker.get_finished()


class TieredKVWorker(KVConnectorWorker):
    def __init__(self, kv_caches: list[torch.Tensor], cpu_blocks: int = 0, disk_dir: str | None = None,
                 fingerprint: str = ""):
        self.kv_caches = kv_caches
        self.device = kv_caches[0].device
        _, _, *block_shape = kv_caches[0].shape  # [2, num_blocks, block_size, heads, head_dim]
        self.block_shape = tuple(block_shape)
        self.dtype = kv_caches[0].dtype
        pin = self.device.type == "cuda"
        self.cpu = [torch.empty((2, cpu_blocks, *block_shape), dtype=self.dtype, pin_memory=pin)
                    for _ in kv_caches] if cpu_blocks else []
        self.disk_dir = disk_dir
        self.fingerprint = fingerprint
        self._stream = torch.cuda.Stream(self.device) if pin else None
        self._layer_events: list = []
        self._staged: dict[str, torch.Tensor] = {}  # disk saves of this step, filled layer by layer
        self._failed: list = []
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-disk") if disk_dir else None
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()

    # --- saves -------------------------------------------------------------------------------

    def save_kv_layer(self, layer: int, plan) -> None:
        cache = self.kv_caches[layer]
        cpu = [c for c in plan.saves if c.tier == "cpu"]
        if cpu:
            blocks = torch.tensor([c.block_id for c in cpu], device=self.device)
            slots = torch.tensor([c.slot for c in cpu])
            self.cpu[layer][:, slots] = cache[:, blocks].to("cpu")
        for copy in plan.saves:
            if copy.tier == "disk":
                staged = self._staged.get(copy.key)
                if staged is None:
                    staged = self._staged[copy.key] = torch.empty((len(self.kv_caches), 2, *self.block_shape),
                                                                  dtype=self.dtype)
                staged[layer] = cache[:, copy.block_id].to("cpu")

    def wait_for_save(self) -> None:
        # Device-to-host copies above are synchronous; the disk writes need only the staged copies.
        for key, payload in self._staged.items():
            self._submit(key, self._write, key, payload)
        self._staged = {}

    # --- loads -------------------------------------------------------------------------------

    def start_load_kv(self, plan) -> None:
        cpu = [c for c in plan.loads if c.tier == "cpu"]
        disk = [c for c in plan.loads if c.tier == "disk"]
        payloads = {c.key: self._read(c.key) for c in disk}
        good = [c for c in disk if payloads[c.key] is not None]
        self._failed += [c for c in disk if payloads[c.key] is None]
        self._layer_events = []
        stream = torch.cuda.stream(self._stream) if self._stream is not None else _nullcontext()
        with stream:
            for layer, cache in enumerate(self.kv_caches):
                if cpu:
                    blocks = torch.tensor([c.block_id for c in cpu], device=self.device)
                    slots = torch.tensor([c.slot for c in cpu])
                    cache[:, blocks] = self.cpu[layer][:, slots].to(self.device, non_blocking=True)
                for c in good:
                    cache[:, c.block_id] = payloads[c.key][layer].to(self.device, non_blocking=True)
                if self._stream is not None:
                    event = torch.cuda.Event()
                    event.record(self._stream)
                    self._layer_events.append(event)
        for copy in plan.deletes:
            self._submit(copy.key, self._delete, copy.key)

    def wait_for_layer_load(self, layer: int) -> None:
        if self._layer_events:
            torch.cuda.current_stream(self.device).wait_event(self._layer_events[layer])

    def get_finished(self) -> list:
        failed, self._failed = self._failed, []
        return failed

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)

    def disk_entries(self) -> list[str]:
        """The disk tier's entries, least recently used first (what a new process starts from)."""
        entries = []
        with os.scandir(self.disk_dir) as it:
            for entry in it:
                if entry.name.endswith(DISK_SUFFIX) and entry.is_file():
                    entries.append((entry.stat().st_mtime, entry.name[: -len(DISK_SUFFIX)]))
                elif entry.name.endswith(".tmp"):
                    _remove(entry.path)  # a write a killed process left half done
        return [key for _, key in sorted(entries)]

    # --- the disk tier's files -----------------------------------------------------------------

    def _path(self, key: str) -> str:
        return os.path.join(self.disk_dir, key + DISK_SUFFIX)

    def _submit(self, key: str, fn, *args) -> None:
        # One writer thread runs a key's writes and deletes in the order they were planned.
        with self._lock:
            self._pending[key] = future = self._writer.submit(fn, *args)
        future.add_done_callback(lambda f, key=key: self._done(key, f))

    def _done(self, key: str, future: Future) -> None:
        with self._lock:
            if self._pending.get(key) is future:
                del self._pending[key]

    def _write(self, key: str, payload: torch.Tensor) -> None:
        data = payload.contiguous().view(torch.uint8).numpy().tobytes()
        header = json.dumps({"fingerprint": self.fingerprint, "key": key, "dtype": str(self.dtype),
                             "shape": list(payload.shape), "checksum": hashlib.blake2b(data, digest_size=16).hexdigest(),
                             }).encode()
        tmp = f"{self._path(key)}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(header)) + header)
                f.write(data)
            os.replace(tmp, self._path(key))
        except OSError as e:
            log.warning("KV disk tier: could not write %s (%s); that block will be recomputed when needed", key, e)
            _remove(tmp)

    def _delete(self, key: str) -> None:
        _remove(self._path(key))

    def _read(self, key: str) -> torch.Tensor | None:
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            pending.result()  # written in an earlier step and still in the writer's queue
        try:
            with open(self._path(key), "rb") as f:
                raw = f.read()
        except OSError:
            return None
        problem, payload = self._parse(key, raw)
        if problem:
            log.warning("KV disk tier: refusing %s (%s); recomputing it", self._path(key), problem)
            _remove(self._path(key))
        else:
            try:
                os.utime(self._path(key))  # the LRU order a later process starts from
            except OSError:
                pass
        return payload

    def _parse(self, key: str, raw: bytes) -> tuple[str | None, torch.Tensor | None]:
        if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + 4:
            return "not a KV entry", None
        (size,) = struct.unpack_from("<I", raw, len(MAGIC))
        start = len(MAGIC) + 4 + size
        try:
            header = json.loads(raw[len(MAGIC) + 4:start])
        except ValueError:
            return "unreadable header", None
        shape = [len(self.kv_caches), 2, *self.block_shape]
        expected = {"fingerprint": self.fingerprint, "key": key, "dtype": str(self.dtype), "shape": shape}
        for name, value in expected.items():
            if header.get(name) != value:
                return f"{name} is {header.get(name)!r}, expected {value!r}", None
        data = raw[start:]
        if len(data) != self.dtype.itemsize * _numel(shape):
            return f"payload has {len(data)} bytes (truncated?)", None
        if hashlib.blake2b(data, digest_size=16).hexdigest() != header.get("checksum"):
            return "checksum mismatch", None
        return None, torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype).view(shape)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
