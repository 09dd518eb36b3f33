"""Disaggregated prefill and decode (#22), the distributed side: the job's layout into prefill and
decode instances and their process groups (`setup_disaggregated`), the router's choice of
instances, the data plane that moves a request's KV blocks from a prefill instance's caches into a
decode instance's, one message per pair of ranks sharing layers and heads (`send_kv`, `post_recv_kv` /
`place_kv`, and the KV connector
workers `KVSender`, `KVReceiver` that carry out the step plans of scheduling/disaggregated.py), and
the control plane (`ControlPlane`): small messages on a gloo group saying a request's KV is ready,
that a decode instance is alive, and that it is done.

Layout: the world is P prefill instances of `prefill_pp` x `prefill_tp` ranks, then D decode
deployments of `decode_dp` replicas of `decode_pp` x `decode_tp` ranks, each instance (a replica)
consecutive ranks, stage-major (a stage's TP ranks consecutive: one node's devices, as TP wants), as a
data-parallel replica's are (parallel/dims.py). A deployment's replicas are separate decode instances
to the router (data parallelism is that routing); with expert parallelism they split each MoE layer's
experts over all their ranks and step in lockstep, as colocated data-parallel replicas do.

KV heads under TP (parallel/tensor_parallel.py::kv_heads): with at least as many kv heads as ranks,
rank r of t holds heads [r * H / t, (r + 1) * H / t); with fewer, each rank holds one, head
r // (t / H) (the heads are copied). When the two sides' TP sizes differ, each decode rank takes each of its
heads from the first prefill rank that holds it: the transfer plan (`transfer_plan`) lists, per
(prefill rank, decode rank) pair, the heads that go between them, so a shard is re-split (or
gathered) on the way and every head crosses once per decode rank that needs it. When the two sides'
pipeline stages differ, a route also names the layers the two ranks' stages share: a prefill stage
sends each decode stage only that stage's layers, the rest of its cache from another prefill stage.

Messages: the KV of a request goes on the default group (NCCL on GPUs), untagged: NCCL matches a
pair's messages in the order they were sent, and gloo's untagged messages do the same, so the CPU
tests check the order NCCL needs. A prefill rank sends in the order its requests finish and tells the
decode instance in that order (READY); every rank of the decode instance posts its receives in READY
order, at once (up to `ahead` requests received before their admission; the rest wait at the
sender), into staging tensors that admission then copies into the blocks the scheduler gave: the
scheduler may admit the requests in any order.

Leaf module: torch only (and this package's TP head rule).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from contextlib import contextmanager
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from toolkit.parallel.dims import ParallelDims
from toolkit.parallel.distributed import ParallelConfigError, dist_timeout
from toolkit.parallel.tensor_parallel import kv_heads

log = logging.getLogger("toolkit")

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Instance:
    role: str
    index: int  # among the instances of its role
    ranks: range  # global ranks, consecutive, stage-major
    tp: int = 0  # ranks per pipeline stage (0: all of them, one stage)
    dp: int = 1  # replicas in its data-parallel deployment (index // dp), of which it is index % dp

    def __post_init__(self):
        if not self.tp:
            object.__setattr__(self, "tp", len(self.ranks))

    @property
    def pp(self) -> int:
        return len(self.ranks) // self.tp

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def replica(self) -> int:
        return self.index % self.dp

    def shape(self) -> str:
        shape = f"pp {self.pp} x tp {self.tp}" if self.pp > 1 else f"tp {self.tp}"
        return f"dp {self.dp} x {shape}" if self.dp > 1 else shape


@dataclass(frozen=True)
class DisaggLayout:
    """P prefill instances of `prefill_pp` x `prefill_tp` ranks, then D decode deployments of
    `decode_dp` instances (replicas) of `decode_pp` x `decode_tp` ranks."""

    prefill_instances: int
    decode_instances: int
    decode_tp: int = 1
    prefill_tp: int | None = None  # None: decode_tp
    decode_pp: int = 1
    prefill_pp: int | None = None  # None: decode_pp
    decode_dp: int = 1

    def __post_init__(self):
        for name in ("prefill_instances", "decode_instances", "decode_tp", "decode_pp", "decode_dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParallelConfigError(f"{name} must be an integer >= 1, got {value!r}")
        ptp = self.prefill_tp
        if ptp is not None and (not isinstance(ptp, int) or isinstance(ptp, bool) or ptp < 1):
            raise ParallelConfigError(f"prefill_tensor_parallel_size must be an integer >= 1, got {ptp!r}")
        ppp = self.prefill_pp
        if ppp is not None and (not isinstance(ppp, int) or isinstance(ppp, bool) or ppp < 1):
            raise ParallelConfigError(f"prefill_pipeline_parallel_size must be an integer >= 1, got {ppp!r}")

    @property
    def prefill_size(self) -> int:
        """TP ranks of a prefill instance's stage."""
        return self.prefill_tp or self.decode_tp

    @property
    def prefill_stages(self) -> int:
        return self.prefill_pp or self.decode_pp

    def shape(self, role: str) -> tuple[int, int]:
        """(pp, tp) of the role's instances."""
        return (self.prefill_stages, self.prefill_size) if role == "prefill" else (self.decode_pp, self.decode_tp)

    def count(self, role: str) -> int:
        """The role's instances (a decode deployment's replicas each one)."""
        return self.prefill_instances if role == "prefill" else self.decode_instances * self.decode_dp

    @property
    def world_size(self) -> int:
        return sum(self.count(role) * pp * tp for role, (pp, tp) in ((r, self.shape(r)) for r in ROLES))

    @property
    def instances(self) -> list[Instance]:
        out, start = [], 0
        for role in ROLES:
            (pp, tp), dp = self.shape(role), self.decode_dp if role == "decode" else 1
            for i in range(self.count(role)):
                out.append(Instance(role, i, range(start, start + pp * tp), tp, dp))
                start += pp * tp
        return out

    def deployments(self) -> list[list[Instance]]:
        """The instances that split one MoE layer's experts and step together: each prefill instance
        alone, each decode deployment's replicas together."""
        out = []
        for inst in self.instances:
            if inst.replica == 0:
                out.append([])
            out[-1].append(inst)
        return out

    def instance_of(self, rank: int) -> Instance:
        return next(inst for inst in self.instances if rank in inst.ranks)

    def check(self, world_size: int) -> None:
        """A clear error, before anything loads, when the launch does not have exactly this many ranks."""
        if world_size != self.world_size:
            (ppp, ptp), (dpp, dtp) = self.shape("prefill"), self.shape("decode")
            replicas = f" x {self.decode_dp} replicas" if self.decode_dp > 1 else ""
            raise ParallelConfigError(
                f"{self.prefill_instances} prefill instance(s) x {ppp * ptp} ranks + {self.decode_instances} "
                f"decode instance(s){replicas} x {dpp * dtp} ranks = {self.world_size} processes, but this launch "
                f"has a world size of {world_size}")


@dataclass(frozen=True)
class HeadRoute:
    """Heads (of some layers) that go from one prefill rank to one decode rank: where they sit in each
    rank's caches."""

    prefill_rank: int  # rank within the prefill instance (stage * tp + TP rank)
    decode_rank: int  # rank within the decode instance
    src: slice  # positions in the prefill rank's cache's head dim
    dst: slice  # positions in the decode rank's cache's head dim
    # The prefill rank's caches (its stage's layers) that go, and the decode rank's caches they go into.
    src_layers: slice = field(default_factory=lambda: slice(None))
    dst_layers: slice = field(default_factory=lambda: slice(None))


def transfer_plan(prefill_tp: int, decode_tp: int, num_kv_heads: int, prefill_layers: list[int] | None = None,
                  decode_layers: list[int] | None = None) -> list[HeadRoute]:
    """Every decode rank's heads, each from the first prefill TP rank holding it, as contiguous runs;
    with pipeline stages (`*_layers`: layers per stage of each side, both or neither), every layer of
    a decode rank's stage from the prefill stage holding it."""
    heads = _head_routes(prefill_tp, decode_tp, num_kv_heads)
    if prefill_layers is None and decode_layers is None:
        return heads
    if prefill_layers is None or decode_layers is None or sum(prefill_layers) != sum(decode_layers):
        raise ValueError(f"layers per stage {prefill_layers} and {decode_layers}: give both sides', of one model")
    routes = []
    for ds, (c, e) in enumerate(_stage_bounds(decode_layers)):
        for d in range(decode_tp):
            for ps, (a, b) in enumerate(_stage_bounds(prefill_layers)):
                lo, hi = max(a, c), min(b, e)
                if lo < hi:  # the layers these two stages share
                    routes += [HeadRoute(ps * prefill_tp + r.prefill_rank, ds * decode_tp + d, r.src, r.dst,
                                         slice(lo - a, hi - a), slice(lo - c, hi - c))
                               for r in heads if r.decode_rank == d]
    return routes


def _stage_bounds(sizes: list[int]) -> list[tuple[int, int]]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(start, start + n) for start, n in zip(starts, sizes)]


def _head_routes(prefill_tp: int, decode_tp: int, num_kv_heads: int) -> list[HeadRoute]:
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


def send_kv(kv_caches: list[torch.Tensor], blocks: list[int], routes: list[HeadRoute], local_rank: int,
            decode_ranks: range, group=None, tag: int = 0) -> list:
    """On a prefill rank (`local_rank` within its instance): start sending the request's `blocks` to
    the decode ranks the plan names, one message per route holding its layers ([layers, 2, blocks, block_size, heads,
    head_dim]): on gloo each message is a rendezvous that may wait for the sending process's
    transport thread to get a time slice, so one per layer would cost that once per layer.
    Returns the (work, tensor, decode rank) triples; the tensors must stay alive until the works complete."""
    index = torch.tensor(blocks, dtype=torch.int64, device=kv_caches[0].device)
    sends = []
    for route in (r for r in routes if r.prefill_rank == local_rank):
        part = torch.stack([cache.index_select(1, index)[:, :, :, route.src] for cache in kv_caches[route.src_layers]])
        dst = decode_ranks[route.decode_rank]
        sends.append((dist.isend(part, dst=dst, group=group, tag=tag), part, dst))
    return sends


def post_recv_kv(kv_caches: list[torch.Tensor], num_blocks: int, routes: list[HeadRoute], local_rank: int,
                 prefill_ranks: range, group=None, tag: int = 0) -> list:
    """On a decode rank (`local_rank` within its instance): post the receives of a request's KV,
    `num_blocks` blocks of each route's heads of its layers, into staging tensors; returns the
    (work, tensor, route) triples `place_kv` takes."""
    first = kv_caches[0]
    posted = []
    for route in (r for r in routes if r.decode_rank == local_rank):
        heads = route.dst.stop - route.dst.start
        part = torch.empty((len(kv_caches[route.dst_layers]), 2, num_blocks, first.shape[2], heads, first.shape[4]),
                           dtype=first.dtype, device=first.device)
        posted.append((dist.irecv(part, src=prefill_ranks[route.prefill_rank], group=group, tag=tag), part, route))
    return posted


def place_kv(kv_caches: list[torch.Tensor], blocks: list[int], posted: list, keep: bool = True) -> int:
    """Wait for a request's posted receives and copy them into its own `blocks` (as many as were sent,
    in the same order; -1 for a block this rank already holds, dropped); with `keep=False` drop them
    all. Returns the bytes received."""
    first = kv_caches[0]
    kept = [i for i, b in enumerate(blocks) if b >= 0] if keep else []
    index = torch.tensor([blocks[i] for i in kept], dtype=torch.int64, device=first.device)
    positions = torch.tensor(kept, dtype=torch.int64, device=first.device)
    received = 0
    for work, part, route in posted:
        work.wait()
        received += part.numel() * part.element_size()
        if kept:
            for cache, layer in zip(kv_caches[route.dst_layers], part):
                cache[:, :, :, route.dst].index_copy_(1, index, layer.index_select(1, positions))
    return received


def recv_kv(kv_caches: list[torch.Tensor], blocks: list[int], routes: list[HeadRoute], local_rank: int,
            prefill_ranks: range, group=None, tag: int = 0, keep: bool = True) -> int:
    """Receive a request's KV into `blocks` at once (`post_recv_kv`, then `place_kv`)."""
    posted = post_recv_kv(kv_caches, len(blocks), routes, local_rank, prefill_ranks, group, tag)
    return place_kv(kv_caches, blocks, posted, keep)


def route_requests(prompt_lens: list[int], max_tokens: list[int], layout: DisaggLayout,
                   decode_token_cost: float = 0.0) -> list[tuple[int, int | None]]:
    """The router: each request's (prefill instance, decode instance), the same on every rank (`Router`)."""
    router = Router(layout, decode_token_cost)
    return [router.route(prompt, new) for prompt, new in zip(prompt_lens, max_tokens)]


class Router:
    """The router one request at a time (requests arrive as the engine is fed): the same answer on
    every rank, since every rank sees the same requests in the same order (`route_requests`). In
    arrival order, the prefill instance with the fewest pending prompt tokens and the decode instance
    with the least KV promised (prompt + max_tokens); ties to the lower index.

    With `decode_token_cost` r > 0 a prefill instance also serves whole requests (prefill and decode)
    while it has less work routed to it than the decode instance would: work counted in prompt tokens,
    an output token as r of them. Handing a request over adds its prompt to the prefill side and r x
    its output to the decode side; serving it whole adds both to the prefill side; the two sides'
    larger total is smaller served whole exactly when the prefill side's work plus the prompt stays
    below the decode side's. Without it, a prefill instance idles once its prompts are done while its
    decode instance still decodes them all."""

    def __init__(self, layout: DisaggLayout, decode_token_cost: float = 0.0):
        self.cost = decode_token_cost
        self.layout = layout
        self.reset()

    def reset(self) -> None:
        """Forget what was routed so far (every rank at the same point: a benchmark's warm-up)."""
        self.pending = [0.0] * self.layout.count("prefill")
        self.promised = [0] * self.layout.count("decode")
        self.decoding = [0.0] * self.layout.count("decode")  # each decode instance's work, in prompt tokens

    def route(self, prompt_len: int, max_tokens: int, handoff: bool = True) -> tuple[int, int | None]:
        """`handoff=False`: the decode instance computes the prompt itself (no prefill instance's work).
        The decode instance is None when the prefill instance serves the whole request."""
        p = min(range(len(self.pending)), key=lambda i: (self.pending[i], i))
        d = min(range(len(self.promised)), key=lambda i: (self.promised[i], i))
        decode = self.cost * max_tokens
        if handoff and self.cost > 0 and self.pending[p] + prompt_len < self.decoding[d]:
            self.pending[p] += prompt_len + decode
            return p, None
        self.pending[p] += prompt_len if handoff else 0
        self.promised[d] += prompt_len + max_tokens
        self.decoding[d] += decode + (0 if handoff else prompt_len)
        return p, d


# --- process groups ------------------------------------------------------------------------------


@dataclass
class Disaggregation:
    """This rank's place in a disaggregated job, and the groups the roles talk over."""

    layout: DisaggLayout
    instance: Instance
    control_group: object  # gloo, every rank: the control plane's messages
    instance_group: object  # gloo, this instance's ranks: a decode instance's arrivals
    gather_group: object  # gloo, every rank, a long timeout: the outputs at the end of a call
    # Layers per pipeline stage of each role's instances (None: one stage each, every layer)
    layers: dict[str, list[int]] | None = None

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def local_rank(self) -> int:
        """This rank within its instance (0: the instance's first rank, which speaks for it)."""
        return self.rank - self.instance.ranks.start

    @property
    def tp_rank(self) -> int:
        return self.local_rank % self.instance.tp

    @property
    def stage(self) -> int:
        return self.local_rank // self.instance.tp

    @property
    def role(self) -> str:
        return self.instance.role

    def instances(self, role: str) -> list[Instance]:
        return [i for i in self.layout.instances if i.role == role]

    def describe(self, rank: int) -> str:
        inst = self.layout.instance_of(rank)
        local = rank - inst.ranks.start
        replica = f"DP replica {inst.replica} of {inst.dp}, " if inst.dp > 1 else ""
        stage = f"stage {local // inst.tp} of {inst.pp}, " if inst.pp > 1 else ""
        return (f"rank {rank} ({inst.role} instance {inst.index}, {replica}{stage}TP rank {local % inst.tp} of "
                f"{inst.tp})")

    def routes(self, num_kv_heads: int) -> list[HeadRoute]:
        """Which heads and layers go between which ranks of a prefill and a decode instance."""
        layers = self.layers or {}
        return transfer_plan(self.layout.prefill_size, self.layout.decode_tp, num_kv_heads, layers.get("prefill"),
                             layers.get("decode"))


def setup_disaggregated(layout: DisaggLayout, device, model_config, expert_parallel: bool = False,
                        pp_layer_partition: str | None = None):
    """Join the process group as one rank of `layout` (checked against the world, and each role's TP
    and pipeline sizes against the model, before anything is waited for); returns (ParallelState of
    this rank's instance: a (1, pp, tp) mesh of its ranks, Disaggregation). With `expert_parallel` (a
    MoE model) each stage of a deployment (a prefill instance, or a decode instance's dp replicas)
    splits its experts over that stage's ranks, as colocated replicas do, and a decode deployment's
    replicas step in lockstep. `pp_layer_partition` is the decode instances' split (the prefill
    side's is the default)."""
    from toolkit.parallel.distributed import (GATHER_TIMEOUT, ParallelState, _init_process_group, _log_rank0_only,
                                              launched_world_size, local_device)
    from toolkit.parallel.expert_parallel import num_experts

    if expert_parallel and num_experts(model_config) is None:
        log.warning("enable_expert_parallel: %s has no routed experts; ignored", getattr(model_config, "path", "the model"))
        expert_parallel = False
    layers = {role: _check_role(layout, role, model_config, expert_parallel,
                                pp_layer_partition if role == "decode" else None) for role in ROLES}
    world = launched_world_size()
    layout.check(world)
    device = local_device(device)
    _init_process_group(device, world)
    rank = dist.get_rank()
    mine = layout.instance_of(rank)
    # Every rank takes part in creating every instance's groups, in the same order.
    built = [_instance_groups(inst, device) for inst in layout.instances]
    mesh, instance_group, pipeline = built[layout.instances.index(mine)]
    ep_group, lockstep = _deployment_groups(layout, device) if expert_parallel else (None, None)
    control = dist.new_group(backend="gloo", timeout=dist_timeout())
    gather = dist.new_group(backend="gloo", timeout=GATHER_TIMEOUT)
    _log_rank0_only()
    disagg = Disaggregation(layout, mine, control, instance_group, gather, layers if layout.shape("prefill")[0] > 1
                            or layout.decode_pp > 1 else None)
    dims = ParallelDims(pp=mine.pp, tp=mine.tp, expert_parallel=expert_parallel)  # one instance's degrees
    state = ParallelState(mesh, device, None, None, dims=dims)
    _instance_parts(state, disagg, pipeline, ep_group, model_config, layers[mine.role])
    if lockstep is not None:
        from toolkit.parallel.data_parallel import Lockstep

        state.lockstep = Lockstep(lockstep)
    log.info("disaggregated: %d prefill instance(s) of %s + %d decode instance(s) of %s, backend %s",
             layout.prefill_instances, layout.instances[0].shape(), layout.decode_instances,
             layout.instances[-1].shape(), dist.get_backend())
    return state, disagg


def _check_role(layout: DisaggLayout, role: str, model_config, expert_parallel: bool, partition) -> list[int]:
    """The role's instance shape against the model (heads, experts, layers); its layers per stage."""
    from toolkit.parallel.expert_parallel import check_expert_parallel
    from toolkit.parallel.pipeline import head_layers, layer_partition
    from toolkit.parallel.tensor_parallel import check_tensor_parallel

    pp, tp = layout.shape(role)
    try:
        check_tensor_parallel(model_config, tp, expert_parallel=expert_parallel)
        if expert_parallel:
            check_expert_parallel(model_config, tp * (layout.decode_dp if role == "decode" else 1))
        return layer_partition(model_config.num_layers, pp, partition, head_layers(model_config) if pp > 1 else 0.0)
    except ParallelConfigError as e:
        raise ParallelConfigError(f"{role} instances: {e}") from None


def _instance_groups(inst: Instance, device) -> tuple:
    """One instance's mesh, arrivals group and pipeline groups: collectives of every rank, whichever
    instance it is in."""
    from toolkit.parallel.distributed import MESH_DIM_NAMES
    from toolkit.parallel.pipeline import replica_groups
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh(device.type, torch.tensor(list(inst.ranks)).view(1, inst.pp, inst.tp),
                      mesh_dim_names=MESH_DIM_NAMES)
    group = dist.new_group(list(inst.ranks), backend="gloo", timeout=dist_timeout())
    pipeline = replica_groups([list(inst.ranks)], dist_timeout()) if inst.pp > 1 else None
    return mesh, group, pipeline


def _deployment_groups(layout: DisaggLayout, device) -> tuple:
    """Expert parallelism's groups: every stage of every deployment over that stage's ranks in each of
    its replicas (replica-major, as parallel/dims.py's stage_ranks), and each deployment of several
    replicas a lockstep group; this rank's two (None: not in lockstep)."""
    ep = lockstep = None
    me = dist.get_rank()
    for deployment in layout.deployments():
        first = deployment[0]
        for stage in range(first.pp):
            ranks = [inst.ranks[stage * inst.tp + t] for inst in deployment for t in range(inst.tp)]
            g = dist.new_group(ranks, backend="gloo" if device.type == "cpu" else None, timeout=dist_timeout())
            if me in ranks:
                ep = g
        if len(deployment) > 1:
            ranks = [r for inst in deployment for r in inst.ranks]
            g = dist.new_group(ranks, backend="gloo", timeout=dist_timeout())
            if me in ranks:
                lockstep = g
    return ep, lockstep


def _instance_parts(state, disagg: Disaggregation, pipeline, ep_group, model_config, stage_sizes) -> None:
    """This rank's TP, pipeline and expert-parallel helpers, as a colocated replica of the instance's shape has."""
    from toolkit.parallel.expert_parallel import ExpertParallel
    from toolkit.parallel.pipeline import PipelineParallel, StageSplit
    from toolkit.parallel.tensor_parallel import TensorParallel

    mine, dims = disagg.instance, state.dims
    if mine.tp > 1:
        state.tp = TensorParallel(state.mesh["tp"], model_config, state.device, expert_parallel=dims.expert_parallel)
    if mine.pp > 1:
        stage = StageSplit.of(disagg.stage, stage_sizes, bool(model_config.tie_word_embeddings))
        state.pp = PipelineParallel(state.mesh, stage, pipeline, mine.tp)
    if dims.expert_parallel:
        state.ep = ExpertParallel(model_config, tp_group=state.tp.group if state.tp else None, tp_rank=disagg.tp_rank,
                                  tp_size=mine.tp, group=ep_group)


# --- the control plane ---------------------------------------------------------------------------


class SendWaiter:
    """Gloo's point-to-point works never say they are complete until someone waits on them, and a
    send completes only when the peer receives it: one thread waits on them, in order, so the step
    loop can poll (`done`) and free what a completed send read.

    A send may rightly wait long (a decode instance whose cache is full takes a request's KV only
    when it can admit it), and gloo closes the pair when a wait outlasts its timeout, so the wait
    here is a day long; a hung or dead peer is told by the roles' own timers instead."""

    WAIT = timedelta(hours=24)

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # A daemon thread: a process ending on an error must not wait for a send nobody will take.
        threading.Thread(target=self._run, name="kv-send-wait", daemon=True).start()

    def watch(self, work) -> Future:
        future: Future = Future()
        self._queue.put((work, future))
        return future

    def _run(self) -> None:
        while True:
            work, future = self._queue.get()
            try:
                work.wait(self.WAIT)
                future.set_result(None)
            except BaseException as exc:  # noqa: BLE001  handed to whoever polls the future
                future.set_exception(exc)


@contextmanager
def naming_peer(disagg: Disaggregation, what: str, peer: int):
    """A failed send or receive (gloo's error, which names an address) as one naming both ranks and
    their roles: `what` the peer, e.g. "sending request 7's KV to"."""
    try:
        yield
    except (RuntimeError, dist.DistError) as exc:
        raise RuntimeError(f"{disagg.describe(disagg.rank)}: {what} {disagg.describe(peer)} failed (hung or dead?): "
                           f"{exc}") from exc


READY, HEARTBEAT, DONE = 1, 2, 3  # message kinds: [kind, a, b, c] in one int64 tensor
HEARTBEAT_S = 2.0


class ControlPlane:
    """Small messages on the control group, each [kind, a, b, c]:
    - READY (prefill instance's first rank -> decode instance's first rank): request `a`'s prompt
      KV, c blocks, is being sent (b = 1), or the prefill side failed it (b = 0: the decode side
      computes it);
    - HEARTBEAT and DONE (decode instance's first rank -> global rank 0, which returns the outputs):
      still working, at most every HEARTBEAT_S; done with every request routed to it so far.
    A receive is posted ahead for each peer that still owes a message, and polled."""

    def __init__(self, disagg: Disaggregation, waiter: SendWaiter):
        self.disagg = disagg
        self.group = disagg.control_group
        self.waiter = waiter
        self._recvs: dict[int, tuple] = {}  # source rank -> (work, buffer)
        self._sends: deque = deque()  # (future, message, destination)
        self._last_heartbeat = 0.0

    def send(self, dst: int, kind: int, a: int = 0, b: int = 0, c: int = 0) -> None:
        while self._sends and self._sends[0][0].done():
            future, _, to = self._sends.popleft()
            with naming_peer(self.disagg, "a control message to", to):
                future.result()
        message = torch.tensor([kind, a, b, c], dtype=torch.int64)
        with naming_peer(self.disagg, "a control message to", dst):
            self._sends.append((self.waiter.watch(dist.isend(message, dst=dst, group=self.group)), message, dst))

    def heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat >= HEARTBEAT_S:
            self._last_heartbeat = now
            self.send(0, HEARTBEAT)

    def receive(self, sources: dict[int, int]) -> list[tuple[int, int, int, int, int]]:
        """Messages that have arrived, as (source, kind, a, b, c), from the sources that still owe some
        (`sources`: rank -> messages still owed; a receive stays posted for each owed one)."""
        got = []
        for src, owed in sources.items():
            while owed > 0:
                work, buf = self._recvs.get(src) or self._post(src)
                if buf[0].item() == 0:  # no kind yet: not arrived (gloo's work says so only once waited on)
                    break
                with naming_peer(self.disagg, "a control message from", src):
                    work.wait()  # the rest of the message, if still on its way
                del self._recvs[src]
                kind, a, b, c = buf.tolist()
                got.append((src, kind, a, b, c))
                if kind != HEARTBEAT:
                    owed -= 1
        return got

    def _post(self, src: int) -> tuple:
        buf = torch.zeros(4, dtype=torch.int64)
        with naming_peer(self.disagg, "a control message from", src):
            self._recvs[src] = (dist.irecv(buf, src=src, group=self.group), buf)
        return self._recvs[src]


# --- the KV connector workers ---------------------------------------------------------------------


@dataclass
class TransferStats:
    """One side's KV traffic since start: transfers, bytes, and (receiving side) the seconds each
    admission waited for its KV to finish arriving (it was posted when READY came); a sender's sends
    complete when the receiver takes them."""

    transfers: int = 0
    bytes: int = 0
    seconds: list[float] = field(default_factory=list)
    dropped: int = 0
    out_of_order: int = 0  # receiving side: requests loaded or dropped before one whose KV was sent earlier

    def as_dict(self) -> dict:
        total, pct = sum(self.seconds), percentiles(self.seconds)
        return {"transfers": self.transfers, "bytes": self.bytes, "dropped": self.dropped,
                "out_of_order": self.out_of_order,
                "seconds_total": total, "seconds_p50": pct["p50"], "seconds_p99": pct["p99"],
                "bandwidth_gbps": self.bytes / total / 1e9 if total else None}


def percentiles(values: list[float]) -> dict:
    """count, p50, p99 (nearest rank) and mean of a list of seconds; None for an empty list."""
    s = sorted(values)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))] if s else None  # noqa: E731
    return {"count": len(s), "p50": pick(0.5), "p99": pick(0.99), "mean": sum(s) / len(s) if s else None}


class _KVWorker:
    """What both sides share: the caches, the head routes, and a request's number in the job (`tag_of`:
    the same on every rank; its messages carry no tag, see the module's docstring)."""

    def __init__(self, kv_caches: list[torch.Tensor], disagg: Disaggregation, num_kv_heads: int,
                 peers_of, tag_of, waiter: SendWaiter | None = None):
        self.kv_caches = kv_caches
        self.disagg = disagg
        self.routes = disagg.routes(num_kv_heads)
        self.peers_of = peers_of  # request id -> the other side's instance (its ranks)
        self.tag_of = tag_of  # request id -> its number in the job
        self.waiter = waiter
        self.stats = TransferStats()

    @staticmethod
    def by_request(copies) -> dict[str, list[int]]:
        out: dict[str, list] = {}
        for c in copies:
            if c.tier == "remote":
                out.setdefault(c.key, []).append(c)
        return {key: [c.block_id for c in sorted(cs, key=lambda c: c.slot)] for key, cs in out.items()}

    # The parts of the contract a side does not use.
    def wait_for_save(self) -> None:
        pass

    def start_load_kv(self, plan) -> None:
        pass

    def wait_for_layer_load(self, layer: int) -> None:
        pass

    def get_finished(self) -> list:
        return []


class KVSender(_KVWorker):
    """A prefill rank: each finished request's blocks, every layer, to the decode ranks that take its
    heads (isend: the copy goes while the next step computes). The staged copies are what the
    sends read, so the blocks themselves are free again after the step's saves."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._inflight: deque = deque()  # (work, tensor, request id, peer rank, posted at)
        self._plan = None
        self._last_done = time.monotonic()

    def save_kv_layer(self, layer: int, plan) -> None:
        if layer == 0:  # every layer goes in one message per route (send_kv), from wait_for_save
            self._plan = plan

    def wait_for_save(self) -> None:
        # Still before the step's loads and forward: the blocks the saves name are whole.
        plan, self._plan = self._plan, None
        for rid, blocks in self.by_request(plan.saves if plan else ()).items():
            self.stats.transfers += 1
            peer = self.peers_of(rid)
            with naming_peer(self.disagg, f"sending request {rid}'s KV to", peer.ranks[0]):
                sends = send_kv(self.kv_caches, blocks, self.routes, self.disagg.local_rank, peer.ranks)
            for work, part, dst in sends:
                self._inflight.append((self.waiter.watch(work), part, rid, dst, time.monotonic()))
                self.stats.bytes += part.numel() * part.element_size()

    def poll(self) -> int:
        """Retire the sends the decode side has taken; returns how many are still pending. A send
        that nothing takes for the collective timeout while this rank has nothing else to do fails
        (`stalled`)."""
        while self._inflight and self._inflight[0][0].done():
            work, _, rid, dst, _ = self._inflight.popleft()
            with naming_peer(self.disagg, f"sending request {rid}'s KV to", dst):
                work.result()
            self._last_done = time.monotonic()
        return len(self._inflight)

    def staged_requests(self) -> int:
        """Requests whose staged KV the decode side has not taken yet (after retiring what it has)."""
        self.poll()
        return len({rid for _, _, rid, _, _ in self._inflight})

    def stalled(self) -> None:
        if not self._inflight:
            self._last_done = time.monotonic()
            return
        waited = time.monotonic() - max(self._last_done, self._inflight[0][4])
        if waited > dist_timeout().total_seconds():
            _, _, rid, dst, _ = self._inflight[0]
            raise RuntimeError(f"{self.disagg.describe(self.disagg.rank)}: request {rid}'s KV has waited "
                               f"{waited:.0f} s for {self.disagg.describe(dst)} to receive it, with nothing "
                               "else sent meanwhile (the collective timeout): that rank is hung or dead")


class KVReceiver(_KVWorker):
    """A decode rank: each request's KV posted for receiving when its READY comes (`expect`, in READY
    order on every rank of the instance: the order the prefill ranks sent it), at most `ahead`
    requests ahead of their admission; at admission, into the blocks the scheduler gave it, before the
    step's forward. A request that ends before its KV was loaded has it received and dropped."""

    def __init__(self, *args, ahead: int = 64, **kwargs):
        super().__init__(*args, **kwargs)
        self.ahead = ahead
        self._queue: deque = deque()  # (number, prefill instance, blocks): READY came, receives not posted
        self._posted: dict[int, list] = {}  # number -> its posted receives

    def save_kv_layer(self, layer: int, plan) -> None:
        pass

    def expect(self, seq: int, peer: Instance, num_blocks: int) -> None:
        """Request `seq`'s KV (`num_blocks` blocks) is on its way from `peer`."""
        self._queue.append((seq, peer, num_blocks))
        self._post_ahead()

    def _post_ahead(self) -> None:
        while self._queue and len(self._posted) < self.ahead:
            self._post_next()

    def _post_next(self) -> None:
        seq, peer, num_blocks = self._queue.popleft()
        with naming_peer(self.disagg, f"receiving request number {seq}'s KV from", peer.ranks[0]):
            self._posted[seq] = post_recv_kv(self.kv_caches, num_blocks, self.routes, self.disagg.local_rank,
                                             peer.ranks)

    def start_load_kv(self, plan) -> None:
        for rid, blocks in self.by_request(plan.loads).items():
            self._place(rid, blocks, keep=True)
        for copy in (c for c in plan.deletes if c.tier == "remote"):
            self._place(copy.key, [], keep=False)
            self.stats.dropped += 1
        self._post_ahead()  # the room the loads freed

    def _place(self, rid: str, blocks: list[int], keep: bool) -> None:
        seq = self.tag_of(rid)
        if next(iter(self._posted), seq) != seq:
            self.stats.out_of_order += 1
        while seq not in self._posted:  # admitted before its turn to be posted: post up to it, in order
            if not self._queue:
                raise RuntimeError(f"request {rid}'s KV is loaded but its READY never came (a bug: please report)")
            self._post_next()
        start = time.perf_counter()
        with naming_peer(self.disagg, f"receiving request {rid}'s KV from", self.peers_of(rid).ranks[0]):
            received = place_kv(self.kv_caches, blocks, self._posted.pop(seq), keep=keep)
        if keep:
            self.stats.transfers += 1
            self.stats.bytes += received
            self.stats.seconds.append(time.perf_counter() - start)
