"""Expert parallelism: the routed experts of every MoE layer split over all tp x dp ranks (vLLM's
`enable_expert_parallel`), tokens moved to their experts and back by all-to-all.

- **Placement.** The EP group is the whole world (every rank of every replica). Rank r owns the
  contiguous experts [r*E/ep, (r+1)*E/ep) of every layer; `shard_meta` gives each `Experts` module
  those local shapes (`w13` [E/ep, 2I, H], `w2` [E/ep, H, I]) and its `first_expert` before loading,
  so the loader reads only this rank's experts. E must be a multiple of ep (`check_expert_parallel`,
  called before any weight is read).
- **Dispatch / combine** (`dispatch_combine`, eager). Each rank sorts its (token, slot) pairs by
  expert (hence by owning rank), exchanges the per-rank pair counts (`all_to_all_single` of counts),
  then sends each pair's hidden row and its (expert id, weight) to the owner (`all_to_all_single`),
  which computes its experts over what it received with `toolkit::moe_experts(..., first_expert)`
  (each received row a token of one slot, weighted there), and sends the rows back (the combine
  all-to-all), where each token's slots are summed in expert order. With tp > 1 the ranks of a
  replica hold the same tokens (attention stays tensor-parallel): each dispatches only its 1/tp
  chunk of them and one all-reduce over the tp group puts the chunks back together (they are
  disjoint, so the sum is exact).
- **Inside the compiled step.** The whole dispatch-compute-combine is the custom op
  `toolkit::ep_moe` with a fake impl (an x-shaped output), so `torch.compile(fullgraph=True)`
  traces the model through it and the collectives (whose sizes depend on the routing) run eagerly
  inside. The op finds its group by an integer handle (`ExpertParallel.handle`), since an op's
  arguments cannot be process groups. `ExpertDispatcher`, set on every `Experts.dispatcher` by
  `apply_expert_parallel` (called from `transforms.apply`), calls it.
- **Lockstep.** Every rank must enter each layer's all-to-all once per step, so with dp > 1 the
  replicas step together (the engine: `Engine.has_unfinished`/`Engine.step`), a replica without work
  running a one-token dummy forward.
- **Load statistics.** `Experts.tokens_per_expert` is counted by the experts op on the rank that
  computes a pair, so under EP each rank counts its own experts' pairs (from every replica's tokens)
  and the global count of an expert is the sum over ranks (each expert is counted on one rank).
- **Counters.** `EPStats`: bytes each rank sent through the all-to-alls (dispatch and combine) and the
  wall time spent in them, since the engine started (`Engine.stats()["expert_parallel"]`). On CUDA the
  counts' exchange waits for the device (`.tolist()`), so the time includes the queued work before it.

Without EP but with tp > 1 the experts are tensor-parallel instead (parallel/tensor_parallel.py):
every rank holds all experts' 1/tp slice of I and the output is all-reduced, like the dense MLP.

Leaf rule: nothing here imports the toolkit; the experts op is reached through torch's op registry
(`torch.ops.toolkit.moe_experts`, registered when the model module imports toolkit.moe.ops), and
`Experts` modules are recognized by their attributes (`dispatcher`, `w13`, `w2`).
"""

from __future__ import annotations

import itertools
import re
import time
import weakref
from dataclasses import asdict, dataclass

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from toolkit.parallel.distributed import ParallelConfigError

# A checkpoint's per-expert tensor: Mixtral's experts.{e}.w1/w3/w2, Qwen-MoE's gate_proj/up_proj/down_proj.
EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
UP_OR_GATE = ("w1", "w3", "gate_proj", "up_proj")


def is_experts(module: nn.Module) -> bool:
    """An `Experts` module (toolkit/models/moe.py): stacked w13/w2 and a dispatcher slot."""
    return hasattr(module, "dispatcher") and "w13" in module._parameters and "w2" in module._parameters


def num_experts(config) -> int | None:
    """Routed experts per layer (None for a dense model): ModelConfig.moe's, else the HF config's."""
    moe = getattr(config, "moe", None)
    if moe is not None:
        return moe.num_experts or None
    for source in (config, getattr(config, "hf_config", None)):
        for name in ("num_experts", "num_local_experts"):
            value = getattr(source, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def expert_range(num: int, rank: int, size: int) -> range:
    """The global ids of the experts rank `rank` of `size` owns: a contiguous range of num/size."""
    per_rank = num // size
    return range(rank * per_rank, (rank + 1) * per_rank)


def check_expert_parallel(config, ep_size: int) -> None:
    """Raise if the experts cannot be split ep_size ways (before any weight is read)."""
    num = num_experts(config)
    if num is None:
        raise ParallelConfigError(f"enable_expert_parallel needs a mixture-of-experts model; "
                                  f"{getattr(config, 'path', 'this model')} has no routed experts")
    if num % ep_size:
        sizes = [n for n in range(1, num + 1) if num % n == 0]
        raise ParallelConfigError(
            f"expert parallel size {ep_size} (tensor_parallel_size x data_parallel_size) does not divide the "
            f"model's {num} experts ({getattr(config, 'path', '')}); EP sizes that work: {', '.join(map(str, sizes))}"
        )


@dataclass
class EPStats:
    """Since the engine started, on this rank: all-to-all traffic and time (both directions)."""

    calls: int = 0  # MoE layer calls (one dispatch and one combine each)
    dispatch_bytes: int = 0  # hidden rows and their (expert, weight) sent to other ranks, and the counts
    combine_bytes: int = 0  # expert outputs sent back
    rows_sent: int = 0  # (token, slot) pairs sent (to any rank, this one included)
    rows_received: int = 0  # pairs this rank's experts computed
    all_to_all_s: float = 0.0  # wall time inside the all-to-all calls (counts, dispatch, combine)
    op_s: float = 0.0  # wall time of the whole dispatch-compute-combine

    def as_dict(self) -> dict:
        return asdict(self)


def _chunk(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when `total` rows are cut into `parts` near-equal pieces."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def dispatch_combine(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, num_experts: int,
                     group, rank: int, size: int, compute, tp_group=None, tp_rank: int = 0, tp_size: int = 1,
                     stats: EPStats | None = None) -> torch.Tensor:
    """The experts' combined output [T, H] for this rank's tokens x [T, H], computed by whichever rank
    owns each expert. `compute(rows [M, H], weights [M, 1] float32, ids [M, 1] int64) -> [M, H]` runs
    this rank's experts over the pairs it received (each row weighted by its own weight). Eager: a
    collective of every rank of `group` (and of `tp_group` when tp_size > 1)."""
    start_s = time.perf_counter()
    comm_s = 0.0
    tokens, hidden = x.shape
    k = topk_ids.shape[1]
    lo, hi = _chunk(tokens, tp_size, tp_rank)
    ids = topk_ids[lo:hi].reshape(-1)
    weights = topk_weights[lo:hi].reshape(-1).to(torch.float32)
    # By expert, so by owning rank (contiguous ranges), and within an expert in token order: the order
    # the single-process op (and transformers' loop over experts) adds each token's slots in.
    order = torch.argsort(ids, stable=True)
    token = order // k
    ids_sorted = ids[order]
    send_counts = torch.bincount(ids_sorted // (num_experts // size), minlength=size)
    send_x = x[lo:hi].index_select(0, token)
    # Expert id and the weight's float32 bits in one int64 tensor: one all-to-all for both.
    send_meta = torch.stack([ids_sorted, weights[order].view(torch.int32).to(torch.int64)], dim=1)
    recv_counts = torch.empty_like(send_counts)
    t0 = time.perf_counter()
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    sends, recvs = send_counts.tolist(), recv_counts.tolist()
    received = sum(recvs)
    recv_x = x.new_empty((received, hidden))
    recv_meta = send_meta.new_empty((received, 2))
    dist.all_to_all_single(recv_x, send_x, recvs, sends, group=group)
    dist.all_to_all_single(recv_meta, send_meta, recvs, sends, group=group)
    comm_s += time.perf_counter() - t0
    recv_weights = recv_meta[:, 1].to(torch.int32).view(torch.float32)
    y = compute(recv_x, recv_weights.unsqueeze(1), recv_meta[:, :1].contiguous()).to(x.dtype).contiguous()
    back = x.new_empty((ids.numel(), hidden))
    t0 = time.perf_counter()
    dist.all_to_all_single(back, y, sends, recvs, group=group)
    comm_s += time.perf_counter() - t0
    # Each token's slots summed in float32, as the single-process op sums them, then cast once.
    out = torch.zeros((hi - lo, hidden), dtype=torch.float32, device=x.device)
    out.index_add_(0, token, back.float())
    out = out.to(x.dtype)
    if tp_size > 1:
        whole = x.new_zeros((tokens, hidden))
        whole[lo:hi] = out
        t0 = time.perf_counter()
        dist.all_reduce(whole, group=tp_group)
        comm_s += time.perf_counter() - t0
        out = whole
    if stats is not None:
        row_bytes = hidden * x.element_size() + 2 * 8
        mine = sends[rank]
        stats.calls += 1
        stats.dispatch_bytes += (ids.numel() - mine) * row_bytes + send_counts.numel() * 8
        stats.combine_bytes += (received - recvs[rank]) * hidden * x.element_size()
        stats.rows_sent += ids.numel()
        stats.rows_received += received
        stats.all_to_all_s += comm_s
        stats.op_s += time.perf_counter() - start_s
    return out


# --- the op the compiled step calls -----------------------------------------------------------------

_HANDLES = itertools.count()
_GROUPS: "weakref.WeakValueDictionary[int, ExpertParallel]" = weakref.WeakValueDictionary()


@torch.library.custom_op("toolkit::ep_moe", mutates_args=("tokens_per_expert",))
def ep_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor, handle: int, tokens_per_expert: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Routed experts under expert parallelism: dispatch, this rank's experts, combine (eager).
    `tokens_per_expert` counts the pairs this rank's experts computed (from every rank's tokens)."""
    return _GROUPS[handle].run(x, w13, w2, topk_weights, topk_ids, tokens_per_expert)


@ep_moe.register_fake
def _(x, w13, w2, topk_weights, topk_ids, handle, tokens_per_expert=None):
    return x.new_empty(x.shape)


class ExpertDispatcher:
    """What `Experts.dispatcher` holds under EP: `(experts, x, topk_weights, topk_ids) -> [T, H]`."""

    def __init__(self, handle: int):
        self.handle = handle

    def __call__(self, experts: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.toolkit.ep_moe(x, experts.w13, experts.w2, topk_weights, topk_ids, self.handle,
                                        experts.tokens_per_expert)


class ExpertParallel:
    """This rank's place in the EP group (every rank; under pipeline parallelism every rank of its
    stage, in every replica), its experts, and the all-to-all counters."""

    def __init__(self, config, tp_group=None, tp_rank: int = 0, tp_size: int = 1, group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        check_expert_parallel(config, self.size)
        self.num_experts = num_experts(config)
        self.experts = expert_range(self.num_experts, self.rank, self.size)
        self.tp_group, self.tp_rank, self.tp_size = tp_group, tp_rank, tp_size
        self.stats = EPStats()
        self.handle = next(_HANDLES)
        _GROUPS[self.handle] = self

    @property
    def first_expert(self) -> int:
        return self.experts.start

    @property
    def num_local_experts(self) -> int:
        return len(self.experts)

    # --- loading ---------------------------------------------------------------------------------

    def shard_meta(self, model: nn.Module) -> int:
        """Give every meta `Experts` this rank's experts' shapes and first_expert (before loading);
        returns how many modules it changed."""
        changed = 0
        for module in model.modules():
            if not is_experts(module):
                continue
            for pname in ("w13", "w2"):
                param = module._parameters[pname]
                if param.shape[0] != self.num_experts:
                    raise ValueError(f"an Experts module holds {param.shape[0]} experts, the config says "
                                     f"{self.num_experts}")
                module._parameters[pname] = nn.Parameter(
                    torch.empty((self.num_local_experts, *param.shape[1:]), dtype=param.dtype, device="meta"),
                    requires_grad=False,
                )
            module.first_expert = self.first_expert
            changed += 1
        return changed

    # --- the step ---------------------------------------------------------------------------------

    def run(self, x, w13, w2, topk_weights, topk_ids, tokens_per_expert=None) -> torch.Tensor:
        first = self.first_expert

        def compute(rows, weights, ids):
            return torch.ops.toolkit.moe_experts(rows, w13, w2, weights, ids, first, tokens_per_expert)

        return dispatch_combine(x, topk_weights, topk_ids, num_experts=self.num_experts, group=self.group,
                                rank=self.rank, size=self.size, compute=compute, tp_group=self.tp_group,
                                tp_rank=self.tp_rank, tp_size=self.tp_size, stats=self.stats)


def apply_expert_parallel(model: nn.Module, ep: ExpertParallel) -> int:
    """The plan: every `Experts` of the loaded model dispatches through the all-to-all op; returns
    how many layers it covers."""
    dispatcher = ExpertDispatcher(ep.handle)
    count = 0
    for module in model.modules():
        if is_experts(module):
            if module.w13.shape[0] != ep.num_local_experts or module.first_expert != ep.first_expert:
                raise ValueError("apply_expert_parallel: the experts were not loaded for this rank "
                                 "(ExpertParallel.shard_meta runs before loading)")
            module.dispatcher = dispatcher
            count += 1
    return count


# --- tensor-parallel experts (tp > 1 without EP) ------------------------------------------------------


class TensorParallelExperts:
    """`Experts.dispatcher` under TP without EP: every rank holds all experts' 1/tp slice of the
    intermediate size (w13's gate and up rows, w2's columns), computes its partial output with the
    local op and the tp group sums it (a functional all-reduce, traced into the compiled graph)."""

    def __init__(self, group_name: str):
        self.group_name = group_name

    def __call__(self, experts: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol

        partial = torch.ops.toolkit.moe_experts(x, experts.w13, experts.w2, topk_weights, topk_ids,
                                                experts.first_expert, experts.tokens_per_expert)
        return funcol.all_reduce(partial, "sum", self.group_name)


def tp_expert_slice(checkpoint_name: str, shape, tp_rank: int, tp_size: int) -> tuple[slice, ...] | None:
    """The index of this TP rank's part of a per-expert checkpoint tensor (None: not an expert's):
    gate/up [I, H] -> rows [r*I/tp, (r+1)*I/tp); down [H, I] -> those columns."""
    m = EXPERT_TENSOR.search(checkpoint_name)
    if m is None:
        return None
    if m.group(2) in UP_OR_GATE:
        lo, hi = _chunk(shape[0], tp_size, tp_rank)
        return slice(lo, hi), slice(0, shape[1])
    lo, hi = _chunk(shape[1], tp_size, tp_rank)
    return slice(0, shape[0]), slice(lo, hi)
