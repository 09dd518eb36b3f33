"""The program tests/parallel/test_disaggregated.py runs under torchrun with 3 processes (it holds no
tests itself): KV blocks moved from prefill instances' caches into a decode instance's by
parallel.disaggregated, for three layouts in turn: prefill tp=2 into decode tp=1, prefill tp=1 into
decode tp=2, and two prefill instances into one decode instance, each with 4 kv heads and with 1
(copied across TP ranks). Every cache entry's value says where it came from (layer, k or v, block,
slot, global head, dim), so each decode rank checks its blocks against the entries the prefill side
wrote, and that no other block changed. Each rank writes <--out>/rank<R>.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit.parallel.disaggregated import DisaggLayout, recv_kv, send_kv, transfer_plan
from toolkit.parallel.tensor_parallel import kv_heads

__test__ = False

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_DIM = 2, 6, 4, 3
SRC_BLOCKS, DST_BLOCKS = [4, 1, 3], [0, 5, 2]


def entry(layer, kv, block, heads: range) -> torch.Tensor:
    """[BLOCK_SIZE, len(heads), HEAD_DIM]: each value encodes its coordinates."""
    slot = torch.arange(BLOCK_SIZE).view(-1, 1, 1)
    head = torch.tensor(list(heads)).view(1, -1, 1)
    dim = torch.arange(HEAD_DIM).view(1, 1, -1)
    return (layer * 10000 + kv * 5000 + block * 100 + slot * 10 + head + dim * 0.01).float()


def caches(heads: range, fill: bool, offset: int = 0) -> list[torch.Tensor]:
    out = []
    for layer in range(LAYERS):
        cache = torch.zeros(2, BLOCKS, BLOCK_SIZE, len(heads), HEAD_DIM)
        if fill:
            for kv in range(2):
                for block in range(BLOCKS):
                    cache[kv, block] = entry(layer, kv, block + offset, heads)
        out.append(cache)
    return out


def run(layout: DisaggLayout, num_kv_heads: int, rank: int) -> list[str]:
    """One layout: every prefill instance sends its request to decode instance 0; returns this rank's errors."""
    errors = []
    mine = layout.instance_of(rank)
    decode = next(i for i in layout.instances if i.role == "decode")
    prefills = [i for i in layout.instances if i.role == "prefill"]
    routes = transfer_plan(layout.prefill_size, layout.decode_tp, num_kv_heads)
    tp_rank = rank - mine.ranks.start
    heads = kv_heads(tp_rank, mine.tp, num_kv_heads)
    if mine.role == "prefill":
        # Each prefill instance's blocks say which instance wrote them (offset by 1000 blocks).
        sent = send_kv(caches(heads, fill=True, offset=1000 * mine.index), SRC_BLOCKS, routes, tp_rank, decode.ranks)
        for work, _, _ in sent:
            work.wait()
    elif mine.index == 0:
        for p in prefills:
            got = caches(heads, fill=False)
            recv_kv(got, DST_BLOCKS, routes, tp_rank, p.ranks)
            for layer, cache in enumerate(got):
                for kv in range(2):
                    for block in range(BLOCKS):
                        if block in DST_BLOCKS:
                            src = SRC_BLOCKS[DST_BLOCKS.index(block)] + 1000 * p.index
                            want = entry(layer, kv, src, heads)
                        else:
                            want = torch.zeros(BLOCK_SIZE, len(heads), HEAD_DIM)
                        if not torch.equal(cache[kv, block], want):
                            errors.append(f"{layout} heads {num_kv_heads}: from prefill {p.index}, layer {layer} "
                                          f"kv {kv} block {block} differs")
    dist.barrier()
    return errors


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layouts = [DisaggLayout(1, 1, decode_tp=1, prefill_tp=2), DisaggLayout(1, 1, decode_tp=2, prefill_tp=1),
               DisaggLayout(2, 1, decode_tp=1)]
    report = {"rank": rank, "errors": [], "checked": 0}
    for layout in layouts:
        layout.check(dist.get_world_size())
        for num_kv_heads in (4, 1):
            report["errors"] += run(layout, num_kv_heads, rank)
            report["checked"] += int(layout.instance_of(rank).role == "decode")
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[sys.argv.index("--out") + 1]
    os.makedirs(out, exist_ok=True)
    main(out)
