"""Disaggregated prefill and decode, first part (#22): the job's layout into prefill and decode
instances, the router's choice of instances, and the data plane that moves a request's KV blocks
from a prefill instance's caches into a decode instance's, layer by layer, TP shard by TP shard.

Not wired into the engine yet: nothing here is reachable from `LLM` or the CLI (docs/architecture.md).

Layout: the world is P prefill instances of `prefill_tp` ranks, then D decode instances of `tp`
ranks, each instance consecutive ranks (one node's devices, as TP wants).

KV heads under TP (parallel/tensor_parallel.py::kv_heads): with at least as many kv heads as ranks,
rank r of t holds heads [r * H / t, (r + 1) * H / t); with fewer, each rank holds one, head
r // (t / H) (the heads are copied). When the two sides' TP sizes differ, each decode rank takes each of its
heads from the first prefill rank that holds it: the transfer plan (`transfer_plan`) lists, per
(prefill rank, decode rank) pair, the heads that go between them, so a shard is re-split (or
gathered) on the way and every head crosses once per decode rank that needs it.

Leaf module: torch only (and this package's TP head rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from toolkit.parallel.distributed import ParallelConfigError
from toolkit.parallel.tensor_parallel import kv_heads

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Instance:
    role: str
    index: int  # among the instances of its role
    ranks: range  # global ranks, consecutive

    @property
    def tp(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class DisaggLayout:
    """P prefill instances of `prefill_tp` ranks, then D decode instances of `decode_tp` ranks."""

    prefill_instances: int
    decode_instances: int
    decode_tp: int = 1
    prefill_tp: int | None = None  # None: decode_tp

    def __post_init__(self):
        for name in ("prefill_instances", "decode_instances", "decode_tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParallelConfigError(f"{name} must be an integer >= 1, got {value!r}")
        ptp = self.prefill_tp
        if ptp is not None and (not isinstance(ptp, int) or isinstance(ptp, bool) or ptp < 1):
            raise ParallelConfigError(f"prefill_tensor_parallel_size must be an integer >= 1, got {ptp!r}")

    @property
    def prefill_size(self) -> int:
        return self.prefill_tp or self.decode_tp

    @property
    def world_size(self) -> int:
        return self.prefill_instances * self.prefill_size + self.decode_instances * self.decode_tp

    @property
    def instances(self) -> list[Instance]:
        out, start = [], 0
        for role, count, tp in (("prefill", self.prefill_instances, self.prefill_size),
                                ("decode", self.decode_instances, self.decode_tp)):
            for i in range(count):
                out.append(Instance(role, i, range(start, start + tp)))
                start += tp
        return out

    def instance_of(self, rank: int) -> Instance:
        return next(inst for inst in self.instances if rank in inst.ranks)

    def check(self, world_size: int) -> None:
        """A clear error, before anything loads, when the launch does not have exactly this many ranks."""
        if world_size != self.world_size:
            raise ParallelConfigError(
                f"{self.prefill_instances} prefill instance(s) x {self.prefill_size} ranks + {self.decode_instances} "
                f"decode instance(s) x {self.decode_tp} ranks = {self.world_size} processes, but this launch has "
                f"a world size of {world_size}")


@dataclass(frozen=True)
class HeadRoute:
    """Heads that go from one prefill TP rank to one decode TP rank: where they sit in each cache."""

    prefill_rank: int  # TP rank within the prefill instance
    decode_rank: int  # TP rank within the decode instance
    src: slice  # positions in the prefill rank's cache's head dim
    dst: slice  # positions in the decode rank's cache's head dim


def transfer_plan(prefill_tp: int, decode_tp: int, num_kv_heads: int) -> list[HeadRoute]:
    """Every decode rank's heads, each from the first prefill rank holding it, as contiguous runs."""
    routes = []
    for d in range(decode_tp):
        wanted = kv_heads(d, decode_tp, num_kv_heads)
        for pos, head in enumerate(wanted):
            p = next(r for r in range(prefill_tp) if head in kv_heads(r, prefill_tp, num_kv_heads))
            src = kv_heads(p, prefill_tp, num_kv_heads).index(head)
            last = routes[-1] if routes else None
            if (last is not None and last.decode_rank == d and last.prefill_rank == p
                    and last.src.stop == src and last.dst.stop == pos):
                routes[-1] = HeadRoute(p, d, slice(last.src.start, src + 1), slice(last.dst.start, pos + 1))
            else:
                routes.append(HeadRoute(p, d, slice(src, src + 1), slice(pos, pos + 1)))
    return routes


def send_kv(kv_caches: list[torch.Tensor], blocks: list[int], routes: list[HeadRoute], tp_rank: int,
            decode_ranks: range, group=None) -> list:
    """On a prefill rank: start sending the request's `blocks` of every layer to the decode ranks the
    plan names, one message per layer and route (so a layer can go while the next is written).
    Returns the (work, tensor) pairs; the tensors must stay alive until the works complete."""
    index = torch.tensor(blocks, dtype=torch.int64, device=kv_caches[0].device)
    sends = []
    for cache in kv_caches:
        for route in (r for r in routes if r.prefill_rank == tp_rank):
            part = cache.index_select(1, index)[:, :, :, route.src].contiguous()
            sends.append((dist.isend(part, dst=decode_ranks[route.decode_rank], group=group), part))
    return sends


def recv_kv(kv_caches: list[torch.Tensor], blocks: list[int], routes: list[HeadRoute], tp_rank: int,
            prefill_ranks: range, group=None) -> None:
    """On a decode rank: receive the request's KV into its own `blocks` (as many as the sender's, in
    the same order), layer by layer, each route's heads into their place in this rank's cache."""
    index = torch.tensor(blocks, dtype=torch.int64, device=kv_caches[0].device)
    for cache in kv_caches:
        for route in (r for r in routes if r.decode_rank == tp_rank):
            heads = route.dst.stop - route.dst.start
            part = torch.empty((2, len(blocks), cache.shape[2], heads, cache.shape[4]), dtype=cache.dtype,
                               device=cache.device)
            dist.recv(part, src=prefill_ranks[route.prefill_rank], group=group)
            view = cache[:, :, :, route.dst]
            view.index_copy_(1, index, part)


def route_requests(prompt_lens: list[int], max_tokens: list[int], layout: DisaggLayout) -> list[tuple[int, int]]:
    """The router: each request's (prefill instance, decode instance), the same on every rank. In
    arrival order, the prefill instance with the fewest pending prompt tokens and the decode
    instance with the least KV promised (prompt + max_tokens); ties to the lower index."""
    pending = [0] * layout.prefill_instances
    promised = [0] * layout.decode_instances
    out = []
    for prompt, new in zip(prompt_lens, max_tokens):
        p = min(range(len(pending)), key=lambda i: (pending[i], i))
        d = min(range(len(promised)), key=lambda i: (promised[i], i))
        pending[p] += prompt
        promised[d] += prompt + new
        out.append((p, d))
    return out
