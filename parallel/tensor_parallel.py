"""Tensor parallelism as DTensor plans, applied to an unmodified model from the outside.

The plan for the dense decoder family (Megatron layout, one all-reduce after attention and one
after the MLP):

- q/k/v and gate/up: `ColwiseParallel` (output features = heads / intermediate, split by rank);
- o and down: `RowwiseParallel` (input features split, the partial sums all-reduced);
- lm_head: column-wise over the vocabulary with `output_layouts=Replicate()`, so every rank gets
  the full logits (gathered) and samples the same token from them;
- embed_tokens: vocab-parallel (`RowwiseParallel` on an `nn.Embedding` shards its rows; ids a
  rank does not own give zeros and one all-reduce completes the sum). Chosen over replicating it
  because the embedding is the largest tensor of a small model, and with tied embeddings it shares
  the lm_head's `Shard(0)` layout, so the tied weight stays one tensor at 1/tp on each rank.
- norms (and row-wise biases) are replicated.

Loading: each rank reads only its slice of each tensor (safetensors `get_slice`), never the whole
tensor. `shard_meta` swaps the meta parameters for this rank's local shapes, so `load_weights`
checks each slice against the shape it must have; `parallelize` then wraps the loaded local tensors
as DTensors with the plan's placements and applies the plan with `parallelize_module` (which
finds the parameters already distributed and only installs the input/output redistributions).

KV heads: with tp <= num_kv_heads they are split like the query heads, so a rank's KV cache holds
num_kv_heads / tp heads. With tp > num_kv_heads (e.g. MQA) a head cannot be split: k_proj/v_proj
stay plain local modules holding the one kv head this rank's query heads use (rank r of tp serves
query heads [r*Hq/tp, (r+1)*Hq/tp), which all fall in kv head r // (tp / Hkv)), so the cache holds
one kv head per rank and ranks in the same group hold copies.

Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): attention (and a dense or shared-expert
MLP) as above; the router is replicated. The routed experts (one `Experts` module per layer, stacked
`w13` [E, 2I, H] and `w2` [E, H, I]) are not DTensors: without expert parallelism every rank holds
every expert's 1/tp slice of I (w13's gate rows and up rows, w2's columns; the loader reads only
those from the per-expert checkpoint tensors) and `TensorParallelExperts` all-reduces the partial
output over the tp group; with `enable_expert_parallel` they are split by expert instead
(parallel/expert_parallel.py) and this plan leaves them alone.

The model reads head counts from its local weight shapes, so nothing in `toolkit.models` changes.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from toolkit.parallel.distributed import ParallelConfigError
from toolkit.parallel.expert_parallel import TensorParallelExperts, is_experts, tp_expert_slice

KV_PROJECTIONS = ("model.layers.*.self_attn.k_proj", "model.layers.*.self_attn.v_proj")


def dense_plan(shard_kv: bool) -> dict[str, ParallelStyle]:
    """The plan for `toolkit.models.llama` (Llama, Mistral, Qwen2, Qwen3), by module name."""
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    if shard_kv:
        plan.update({name: ColwiseParallel() for name in KV_PROJECTIONS})
    return plan


def moe_plan(shard_kv: bool) -> dict[str, ParallelStyle]:
    """Mixture-of-experts decoders: the dense plan (attention; the dense MLP of layers that have one)
    and Qwen2-MoE's shared expert like a dense MLP. Routers and the routed experts are not in it."""
    plan = dense_plan(shard_kv)
    plan.update({
        "model.layers.*.mlp.shared_expert.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.shared_expert.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.shared_expert.down_proj": RowwiseParallel(),
    })
    return plan


PLANS = {"llama": dense_plan, "mistral": dense_plan, "qwen2": dense_plan, "qwen3": dense_plan,
         "mixtral": moe_plan, "qwen2_moe": moe_plan, "qwen3_moe": moe_plan}


def check_tensor_parallel(config, tp: int, expert_parallel: bool = False) -> None:
    """Raise if the model cannot be split tp ways (called before any weight is read). With
    `expert_parallel` the routed experts are split by expert, so their size need not divide."""
    if tp == 1:
        return
    if config.family not in PLANS:
        raise ParallelConfigError(f"no tensor-parallel plan for model family {config.family!r}")
    problem = _tp_problem(config, tp, expert_parallel)
    if problem:
        raise ParallelConfigError(
            f"tensor_parallel_size {tp} {problem} ({config.path}); "
            f"sizes that work: {', '.join(map(str, valid_tp_sizes(config, expert_parallel)))}"
        )


def valid_tp_sizes(config, expert_parallel: bool = False) -> list[int]:
    """Every tensor-parallel size this model can be split into."""
    return [tp for tp in range(1, config.num_heads + 1) if _tp_problem(config, tp, expert_parallel) is None]


def _moe_sizes(config, expert_parallel: bool) -> list[tuple[str, int]]:
    """(what, size) of the MoE intermediate sizes tensor parallelism splits: the shared expert's, and
    the routed experts' unless expert parallelism splits those by expert."""
    from toolkit.parallel.expert_parallel import num_experts

    moe = getattr(config, "moe", None)
    if moe is None or num_experts(config) is None:
        return []
    sizes = []
    if moe.shared_expert_intermediate_size:
        sizes.append(("shared expert intermediate size", moe.shared_expert_intermediate_size))
    if not expert_parallel:
        sizes.append(("experts' intermediate size", moe.intermediate_size))
    return sizes


def _tp_problem(config, tp: int, expert_parallel: bool = False) -> str | None:
    heads, kv = config.num_heads, config.num_kv_heads
    if heads % tp:
        return f"does not divide the model's {heads} attention heads"
    if kv % tp and tp % kv:
        return (f"cannot share the model's {kv} kv heads: it must divide them (split) or be a "
                f"multiple of them (each kv head replicated on tp/{kv} ranks)")
    if config.intermediate_size % tp:
        # RowwiseParallel rebuilds down_proj's input DTensor assuming equal shards (the vocabulary,
        # sharded only through weights, may be uneven).
        return f"does not divide the model's intermediate size {config.intermediate_size}"
    for what, size in _moe_sizes(config, expert_parallel):
        if size % tp:
            hint = "" if expert_parallel or "experts'" not in what else " (enable_expert_parallel splits experts whole)"
            return f"does not divide the model's {what} {size}{hint}"
    return None


def kv_heads(rank: int, tp: int, num_kv_heads: int) -> range:
    """The global kv heads TP rank `rank` of `tp` holds (in its KV cache's order): its 1/tp share, or
    with fewer kv heads than ranks the one its query heads attend with (each head copied on tp/H ranks)."""
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ParallelConfigError(f"tensor_parallel_size {tp} does not divide the model's {num_kv_heads} kv heads")
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    if tp % num_kv_heads:
        raise ParallelConfigError(f"tensor_parallel_size {tp} ranks cannot share the model's {num_kv_heads} kv heads")
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


class TensorParallel:
    """One replica's tensor-parallel group: the slices this rank loads, the plan, token broadcast."""

    def __init__(self, mesh: DeviceMesh, config, device: torch.device, expert_parallel: bool = False):
        check_tensor_parallel(config, mesh.size(), expert_parallel)
        # With expert parallelism the routed experts are split by expert (parallel/expert_parallel.py);
        # without it this plan splits each expert's intermediate size (TensorParallelExperts).
        self.expert_parallel = expert_parallel
        self.mesh = mesh
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        self.group = mesh.get_group()
        self.device = device
        self.config = config
        self.replicate_kv = config.num_kv_heads < self.size
        self.plan = PLANS[config.family](shard_kv=not self.replicate_kv)
        # Filled by shard_meta: per parameter name, the index of this rank's slice, and (for the
        # DTensor-planned ones) the placement and global shape to wrap the loaded slice with.
        self._index: dict[str, tuple[slice, ...]] = {}
        self._dtensor: dict[str, tuple[list, torch.Size]] = {}

    @property
    def num_kv_heads_local(self) -> int:
        return len(kv_heads(self.rank, self.size, self.config.num_kv_heads))

    # --- loading -------------------------------------------------------------------------------

    def shard_meta(self, model: nn.Module) -> None:
        """Give the meta model this rank's parameter shapes (before `load_weights`)."""
        for mname, module in model.named_modules():
            if is_experts(module):
                if not self.expert_parallel:
                    self._shard_experts_meta(module)
                continue
            style = _lookup(self.plan, mname)
            replicated_kv = self.replicate_kv and any(_matches(p, mname) for p in KV_PROJECTIONS)
            if style is None and not replicated_kv:
                continue
            for pname, param in list(module.named_parameters(recurse=False)):
                name = f"{mname}.{pname}"
                if replicated_kv:
                    index = self._kv_head_rows(param.shape)
                else:
                    placements = [_param_placement(style, module, pname)]
                    shape, offset = compute_local_shape_and_global_offset(param.shape, self.mesh, placements)
                    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
                    self._dtensor[name] = (placements, param.shape)
                self._index[name] = index
                local_shape = [s.stop - s.start for s in index]
                module._parameters[pname] = nn.Parameter(
                    torch.empty(local_shape, dtype=param.dtype, device="meta"), requires_grad=False
                )

    def _shard_experts_meta(self, module: nn.Module) -> None:
        """Every expert's slice of I on this rank: w13 [E, 2I/tp, H] (gate rows, then up rows), w2 [E, H, I/tp]."""
        w13, w2 = module._parameters["w13"], module._parameters["w2"]
        local = w13.shape[1] // 2 // self.size
        shapes = {"w13": (w13.shape[0], 2 * local, w13.shape[2]), "w2": (w2.shape[0], w2.shape[1], local)}
        for pname, shape in shapes.items():
            module._parameters[pname] = nn.Parameter(
                torch.empty(shape, dtype=module._parameters[pname].dtype, device="meta"), requires_grad=False)

    def _kv_head_rows(self, shape: torch.Size) -> tuple[slice, ...]:
        """k/v rows (weight or bias) of the one kv head this rank's query heads attend with."""
        head = kv_heads(self.rank, self.size, self.config.num_kv_heads).start
        d = self.config.head_dim
        return (slice(head * d, (head + 1) * d),) + tuple(slice(0, n) for n in shape[1:])

    def read_slice(self, name: str, tensor_slice) -> torch.Tensor:
        """`load_weights`' hook: read only this rank's part (all of it for replicated tensors)."""
        index = self._index.get(name)
        if index is None and not self.expert_parallel:
            index = tp_expert_slice(name, tensor_slice.get_shape(), self.rank, self.size)
        if index is None:
            return tensor_slice[:]
        # safetensors returns a view into the whole tensor's (memory-mapped) bytes: copy the slice
        # out, so this rank keeps only its part and the mapping is released with the file.
        return tensor_slice[index].clone(memory_format=torch.contiguous_format)

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Wrap the loaded local slices as DTensors and apply the plan (after `load_weights`)."""
        wrapped: dict[int, nn.Parameter] = {}  # by id: a tied weight stays one parameter
        for name, (placements, global_shape) in self._dtensor.items():
            mname, pname = name.rsplit(".", 1)
            module = model.get_submodule(mname)
            local = module._parameters[pname]
            if id(local) not in wrapped:
                stride = torch.empty(global_shape, device="meta").stride()
                dtensor = DTensor.from_local(
                    local.data, self.mesh, placements, run_check=False, shape=global_shape, stride=stride
                )
                wrapped[id(local)] = nn.Parameter(dtensor, requires_grad=False)
            module._parameters[pname] = wrapped[id(local)]
        # The plan by the model's own module names: a MoE family's plan names the dense MLP and the shared
        # expert, which not every layer (or family) holds, and parallelize_module warns of each pattern
        # that is missing from some layer.
        styles = {name: _lookup(self.plan, name) for name, _ in model.named_modules()}
        parallelize_module(model, self.mesh, {name: style for name, style in styles.items() if style is not None})
        if not self.expert_parallel:
            experts = TensorParallelExperts(self.group.group_name)
            for module in model.modules():
                if is_experts(module):
                    module.dispatcher = experts
        return model.requires_grad_(False)

    # --- lockstep ------------------------------------------------------------------------------

    def agree_min(self, value: int) -> int:
        """The smallest of the group's values (e.g. KV blocks: every rank must schedule the same)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def agree_any(self, flags: list[bool]) -> list[bool]:
        """Per position, whether any rank's flag is set (a KV load that failed on one rank fails on all)."""
        t = torch.tensor(flags, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(v) for v in t.tolist()]

    def broadcast_tokens(self, token_ids: list[int]) -> list[int]:
        """TP rank 0's sampled ids on every rank, so every rank's scheduler appends the same tokens."""
        if not token_ids:
            return token_ids
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        dist.broadcast(ids, group=self.group, group_src=0)
        return ids.tolist()


def _param_placement(style: ParallelStyle, module: nn.Module, pname: str):
    """Where `parallelize_module` puts each parameter for these styles (so loading agrees with it)."""
    embedding = isinstance(module, nn.Embedding)
    if isinstance(style, ColwiseParallel):
        return Shard(1) if embedding else Shard(0)
    if isinstance(style, RowwiseParallel):
        if embedding:
            return Shard(0)
        return Shard(1) if pname == "weight" else Replicate()  # the bias is added once, after the sum
    raise TypeError(f"no loading rule for {type(style).__name__}")


def _lookup(plan: dict[str, ParallelStyle], module_name: str) -> ParallelStyle | None:
    return next((style for pattern, style in plan.items() if _matches(pattern, module_name)), None)


def _matches(pattern: str, module_name: str) -> bool:
    """`parallelize_module`'s rule: '.'-separated atoms, each matched with fnmatch."""
    atoms, names = pattern.split("."), module_name.split(".")
    return len(atoms) == len(names) and all(fnmatchcase(n, a) for a, n in zip(atoms, names))
