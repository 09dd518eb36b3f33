"""Disaggregated prefill/decode, first part (#22): the layout, the router and the KV data plane.

The data plane under a real torchrun launch (3 processes, gloo): a request's KV blocks go from
prefill caches into a decode cache's other blocks, re-split when the TP sizes differ (tp=2 into 1,
1 into 2) and from two prefill instances into one decode instance; every value encodes where it
was written, so the decode side checks each entry it got against the one the prefill side wrote,
and that no other block changed (tests/parallel/disagg_worker.py).
"""

from __future__ import annotations

import json

import pytest

from tests.parallel.test_parallel import REPO, output_tail, read_reports, torchrun
from toolkit.parallel import ParallelConfigError
from toolkit.parallel.disaggregated import DisaggLayout, HeadRoute, route_requests, transfer_plan
from toolkit.parallel.tensor_parallel import kv_heads

WORKER = REPO / "tests" / "parallel" / "disagg_worker.py"


def test_layout_lays_out_prefill_then_decode_instances_and_checks_the_world():
    layout = DisaggLayout(2, 1, decode_tp=1, prefill_tp=2)
    assert [(i.role, i.index, list(i.ranks)) for i in layout.instances] == [
        ("prefill", 0, [0, 1]), ("prefill", 1, [2, 3]), ("decode", 0, [4])]
    assert layout.world_size == 5 and layout.instance_of(3).index == 1 and layout.instance_of(4).role == "decode"
    layout.check(5)
    with pytest.raises(ParallelConfigError, match=r"2 prefill instance\(s\) x 2 ranks \+ 1 decode instance\(s\) x 1 "
                                                  r"ranks = 5 processes, but this launch has a world size of 4"):
        layout.check(4)
    with pytest.raises(ParallelConfigError, match="decode_instances must be an integer >= 1"):
        DisaggLayout(1, 0)
    with pytest.raises(ParallelConfigError, match="prefill_tensor_parallel_size must be an integer >= 1"):
        DisaggLayout(1, 1, prefill_tp=0)


def test_kv_heads_follow_the_tp_plan_and_the_transfer_plan_resplits_them():
    assert [list(kv_heads(r, 2, 4)) for r in range(2)] == [[0, 1], [2, 3]]
    assert [list(kv_heads(r, 4, 2)) for r in range(4)] == [[0], [0], [1], [1]]  # fewer heads than ranks: copies
    with pytest.raises(ParallelConfigError):
        kv_heads(0, 3, 4)
    # tp=2 into tp=1: the decode rank gathers both halves; tp=1 into tp=2: each takes its half.
    assert transfer_plan(2, 1, 4) == [HeadRoute(0, 0, slice(0, 2), slice(0, 2)), HeadRoute(1, 0, slice(0, 2), slice(2, 4))]
    assert transfer_plan(1, 2, 4) == [HeadRoute(0, 0, slice(0, 2), slice(0, 2)), HeadRoute(0, 1, slice(2, 4), slice(0, 2))]
    # One kv head, copied on every prefill rank: each decode rank takes it once, from the first holder.
    assert transfer_plan(2, 2, 1) == [HeadRoute(0, 0, slice(0, 1), slice(0, 1)), HeadRoute(0, 1, slice(0, 1), slice(0, 1))]
    assert transfer_plan(2, 2, 4) == [HeadRoute(0, 0, slice(0, 2), slice(0, 2)), HeadRoute(1, 1, slice(0, 2), slice(0, 2))]


def test_router_balances_pending_prompt_tokens_and_promised_kv():
    layout = DisaggLayout(2, 2)
    # A long prompt weighs on its prefill instance; a long output on its decode instance.
    got = route_requests([1000, 10, 10, 10], [10, 2000, 10, 10], layout)
    assert [p for p, _ in got] == [0, 1, 1, 1]
    assert [d for _, d in got] == [0, 1, 0, 0]


@pytest.mark.slow
def test_kv_blocks_move_between_instances_resplit_across_tp_sizes(tmp_path):
    proc = torchrun(tmp_path, ["--nproc-per-node=3", "--standalone"], [], script=WORKER)
    assert proc.returncode == 0, output_tail(proc)
    reports = read_reports(tmp_path, 3)
    assert [r["errors"] for r in reports] == [[], [], []]
    # Rank 1 decodes in the second layout (2 head counts), rank 2 in all three (3 x 2).
    assert [r["checked"] for r in reports] == [0, 2, 6], json.dumps(reports)
