"""The program tests/parallel/test_expert_parallel.py runs under torchrun to check the EP dispatcher
alone (no model): random tokens, routing and experts, against a single-process reference that every
rank computes for its own tokens with all the experts' weights. It holds no tests itself.

Each rank writes <out>/rank<R>.json: per case, the largest difference from the reference, the rows it
sent and received, and whether the compiled (torch.compile fullgraph through `toolkit::ep_moe`) run
gave the eager run's output.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from toolkit.parallel import expert_parallel as ep_mod

__test__ = False

E, H, I, K = 8, 16, 12, 2


def reference_pairs(x, w13, w2, weights, ids, first_expert=0):
    """What the experts op computes: sum over slots of weight * down(silu(gate x) * up x), ids outside
    [first_expert, first_expert + len(w13)) skipped. A loop over experts: one matmul each."""
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for local in range(w13.shape[0]):
        token, slot = torch.nonzero(ids == first_expert + local, as_tuple=True)
        if token.numel() == 0:
            continue
        h = x[token] @ w13[local].T
        y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w2[local].T
        out.index_add_(0, token, y * weights[token, slot, None].to(x.dtype))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = args.tp
    # Replicas of tp consecutive ranks; a replica's ranks see the same tokens.
    tp_groups = [dist.new_group(list(range(r, r + tp))) for r in range(0, world, tp)]
    tp_group = tp_groups[rank // tp]
    replica = rank // tp
    gen = torch.Generator().manual_seed(0)
    w13_all = torch.randn(E, 2 * I, H, generator=gen) * 0.3
    w2_all = torch.randn(E, H, I, generator=gen) * 0.3
    local = ep_mod.expert_range(E, rank, world)
    w13, w2 = w13_all[local.start:local.stop].contiguous(), w2_all[local.start:local.stop].contiguous()
    import toolkit.moe.ops  # noqa: F401  registers toolkit::moe_experts, which the dispatcher calls by name

    fake = ep_mod.ExpertParallel(SimpleNamespace(num_experts=E, path="random"), tp_group=tp_group,
                                 tp_rank=rank % tp, tp_size=tp)
    dispatcher = ep_mod.ExpertDispatcher(fake.handle)
    module = torch.nn.Module()
    module.w13, module.w2 = torch.nn.Parameter(w13, requires_grad=False), torch.nn.Parameter(w2, requires_grad=False)
    module.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.int64))
    routed = torch.zeros(E, dtype=torch.int64)  # what every replica routed (counted once per replica)

    def moe(x, weights, ids):
        return dispatcher(module, x, weights, ids)

    compiled = torch.compile(moe, fullgraph=True, dynamic=True, backend="aot_eager")
    report = {"rank": rank, "cases": {}}
    # Token counts differ per replica (and are uneven for the tp chunks); "skewed" sends every pair to
    # expert 0 (rank 0's), "empty" gives replica 1 no tokens at all.
    for case in ("random", "skewed", "last_rank", "empty"):
        tgen = torch.Generator().manual_seed(100 + replica)
        tokens = 0 if case == "empty" and replica == 1 else 5 + 3 * replica
        x = torch.randn(tokens, H, generator=tgen)
        logits = torch.randn(tokens, E, generator=tgen)
        if case == "skewed":
            logits[:, 0] += 100.0
        if case == "last_rank":
            logits[:, E - 2:] += 100.0  # both slots to the last rank's experts
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        expected = reference_pairs(x, w13_all, w2_all, weights, ids)
        if rank % tp == 0:
            routed += 2 * torch.bincount(ids.reshape(-1), minlength=E)  # eager and compiled runs
        before = fake.stats.rows_received
        eager = moe(x, weights, ids)
        received = fake.stats.rows_received - before
        graph = compiled(x, weights, ids)
        report["cases"][case] = {
            "max_diff": (eager - expected).abs().max().item() if tokens else 0.0,
            "compiled_equal": bool(torch.equal(graph, eager)),
            "received": received,
            "shape_ok": list(eager.shape) == [tokens, H],
        }
    report["stats"] = fake.stats.as_dict()
    # Each expert's pairs are counted on the rank that computed them: summed over ranks, the routing.
    counted = module.tokens_per_expert.clone()
    dist.all_reduce(counted)
    dist.all_reduce(routed)
    report["counts_match"] = bool(torch.equal(counted, routed))
    report["local_counts_only"] = bool((module.tokens_per_expert[:local.start] == 0).all()
                                       and (module.tokens_per_expert[local.stop:] == 0).all())
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
