"""The program tests/parallel/test_disaggregated.py runs under torchrun with 3 processes (it holds no
tests itself): KV blocks moved from prefill instances' caches into a decode instance's by
parallel.disaggregated, for three layouts in turn: prefill tp=2 into decode tp=1, prefill tp=1 into
decode tp=2, and two prefill instances into one decode instance, each with 4 kv heads and with 1
(copied across TP ranks). Every cache entry's value says where it came from (layer, k or v, block,
slot, global head, dim), so each decode rank checks its blocks against the entries the prefill side
wrote, and that no other block changed. Then the decode side's order (`admitted_out_of_order`): a
TP-2 prefill instance sends three requests' KV untagged, the decode rank's KVReceiver is told of them
in that order (READY) with room to receive one ahead, and loads them in another order, dropping one:
each must still get its own. Each rank writes <--out>/rank<R>.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit.parallel.disaggregated import (Disaggregation, DisaggLayout, KVReceiver, recv_kv, send_kv,
                                            transfer_plan)
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


# Three requests a prefill instance finishes in this order: (number, its blocks there, the decode side's).
REQUESTS = [(1, [4, 1, 3], [0, 5, 2]), (2, [2], [1]), (3, [0, 5], [4, 3])]


def admitted_out_of_order(rank: int) -> list[str]:
    """Sent and told in the order 1, 2, 3; loaded 3 then 1, and 2 dropped (it ended before loading)."""
    from toolkit.scheduling.kv_transfer import BlockCopy, KVTransferPlan

    layout, errors = DisaggLayout(1, 1, decode_tp=1, prefill_tp=2), []
    mine, (prefill, decode) = layout.instance_of(rank), layout.instances
    heads = kv_heads(rank - mine.ranks.start, mine.tp, 4)
    if mine.role == "prefill":
        routes, sends = transfer_plan(2, 1, 4), []
        for seq, src, _ in REQUESTS:  # each request's blocks say which request it is (offset by 1000 blocks)
            sends += send_kv(caches(heads, fill=True, offset=1000 * seq), src, routes, rank - mine.ranks.start,
                             decode.ranks)
        for work, _, _ in sends:
            work.wait()
    else:
        got = caches(heads, fill=False)
        disagg = Disaggregation(layout, mine, None, None, None)
        names = {f"r{seq}": seq for seq, _, _ in REQUESTS}
        receiver = KVReceiver(got, disagg, 4, lambda rid: prefill, names.__getitem__, ahead=1)
        for seq, src, _ in REQUESTS:
            receiver.expect(seq, prefill, len(src))
        (_, src1, dst1), (_, src2, _), (_, src3, dst3) = REQUESTS
        plan = KVTransferPlan(loads=[BlockCopy(b, "remote", "r3", i) for i, b in enumerate(dst3)]
                              + [BlockCopy(b, "remote", "r1", i) for i, b in enumerate(dst1)],
                              deletes=[BlockCopy(-1, "remote", "r2", len(src2))])
        receiver.start_load_kv(plan)
        for seq, src, dst in (REQUESTS[2], REQUESTS[0]):
            for layer, cache in enumerate(got):
                for kv in range(2):
                    for s_block, d_block in zip(src, dst):
                        if not torch.equal(cache[kv, d_block], entry(layer, kv, s_block + 1000 * seq, heads)):
                            errors.append(f"request {seq} loaded out of order: layer {layer} kv {kv} block {d_block} "
                                          "holds another request's KV")
        if receiver.stats.out_of_order != 1 or receiver.stats.transfers != 2 or receiver.stats.dropped != 1:
            errors.append(f"receiver stats {receiver.stats}")
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
    report["errors"] += admitted_out_of_order(rank)
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[sys.argv.index("--out") + 1]
    os.makedirs(out, exist_ok=True)
    main(out)
