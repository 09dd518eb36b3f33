"""The prefill and decode connectors of disaggregation (scheduling/disaggregated.py) with the real
scheduler: what each side plans, and that every block is free again on every path."""

from __future__ import annotations

from toolkit.scheduling import Request, RequestStatus, Scheduler, SchedulerConfig
from toolkit.scheduling.disaggregated import REMOTE, DecodeConnector, PrefillConnector
from toolkit.scheduling.kv_transfer import BlockCopy

BS = 8


def sched(connector, num_blocks=16, budget=64) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=BS, max_model_len=64,
                                     max_num_batched_tokens=budget, enable_prefix_caching=True), connector)


def run(s: Scheduler, token: int = 1) -> list:
    """Steps until nothing is left; returns every step's plan."""
    plans = []
    while s.has_unfinished():
        plan = s.schedule()
        plans.append(plan)
        s.update(plan, {r.request_id: [token] for r in plan.scheduled if r.samples})
    return plans


def test_a_prefill_instance_sends_the_blocks_of_a_prompt_it_finished_and_frees_them():
    connector = PrefillConnector(BS)
    s = sched(connector, budget=8)  # chunked: 19 tokens in three steps
    s.add_request(Request("a", list(range(1, 20)), max_tokens=1))  # a prompt of 20, all but its last token
    plans = run(s)
    assert [sum(r.num_new_tokens for r in p.scheduled) for p in plans] == [8, 8, 3]
    table = plans[-1].scheduled[0].block_table
    assert s.pending_transfers().saves == [BlockCopy(b, REMOTE, "a", i) for i, b in enumerate(table[:3])]
    assert connector.take_outcomes() == [("a", True)] and connector.take_outcomes() == []
    assert s.num_free_blocks == 16


def test_a_request_the_prefill_side_fails_or_rejects_is_reported_without_kv():
    connector = PrefillConnector(BS)
    s = sched(connector, num_blocks=4, budget=8)
    s.add_request(Request("a", list(range(1, 20)), max_tokens=1))
    s.add_request(Request("too-long", list(range(1, 40)), max_tokens=1))  # 5 blocks: can never fit
    s.update(s.schedule(), {})  # "a" computes its first chunk, then the engine fails it
    s.finish_request("a", RequestStatus.FINISHED_ERROR)
    run(s)
    assert s.pending_transfers().saves == []
    assert sorted(connector.take_outcomes()) == [("a", False), ("too-long", False)]
    assert s.num_free_blocks == 4 and connector.stats()["failed"] == 2


def test_a_decode_instance_loads_the_held_prompt_and_computes_only_its_last_token():
    connector = DecodeConnector(BS)
    s = sched(connector)
    request = Request("a", list(range(1, 21)), max_tokens=3)
    s.add_request(request)
    connector.arrived("a", 19)
    plan = s.schedule()
    (scheduled,) = plan.scheduled
    assert (scheduled.start_position, scheduled.token_ids, scheduled.samples) == (19, [20], True)
    assert plan.kv_transfer.loads == [BlockCopy(b, REMOTE, "a", i) for i, b in enumerate(scheduled.block_table[:3])]
    assert connector.held_tokens("a") == 0  # loaded: a preemption from here recomputes
    s.update(plan, {"a": [7]})
    run(s)
    assert request.output_token_ids == [7, 1, 1] and s.num_free_blocks == 16
    assert request.num_cached_tokens == 19  # vLLM counts KV loaded from elsewhere as cached


def test_held_kv_of_a_request_that_ends_before_loading_is_received_and_dropped():
    connector = DecodeConnector(BS)
    s = sched(connector, num_blocks=4)
    s.add_request(Request("big", list(range(1, 25)), max_tokens=8))  # 3 blocks, and a 4th as it decodes
    s.update(s.schedule(), {"big": [1]})
    s.add_request(Request("b", list(range(1, 12)), max_tokens=2))
    connector.arrived("b", 10)
    assert not s.schedule().kv_transfer  # no room: "b" waits, its KV with it
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    # The message is still taken (its block count in `slot`), so the sender's send completes.
    assert s.schedule().kv_transfer.deletes == [BlockCopy(-1, REMOTE, "b", 2)]
    assert connector.stats()["dropped"] == 1
