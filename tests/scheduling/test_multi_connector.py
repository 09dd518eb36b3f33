"""Several KV connectors at once (scheduling/multi_connector.py) with the real scheduler: the CPU tier
beside a decode instance's handoff connector, and beside a prefill instance's."""

from __future__ import annotations

from tests.scheduling.test_disaggregated import BS, run
from toolkit.scheduling import Request, Scheduler, SchedulerConfig
from toolkit.scheduling.disaggregated import REMOTE, DecodeConnector, PrefillConnector
from toolkit.scheduling.kv_tiers import TieredKVConnector
from toolkit.scheduling.kv_transfer import BlockCopy
from toolkit.scheduling.multi_connector import MultiConnector, plan_for


def sched(connector, num_blocks=16, preemption="recompute") -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=BS, max_model_len=64, max_num_batched_tokens=64,
                                     enable_prefix_caching=True, preemption_mode=preemption), connector)


def test_a_decode_instance_reuses_its_device_prefix_and_loads_only_the_rest_of_the_held_prompt():
    decode = DecodeConnector(BS)
    s = sched(MultiConnector([TieredKVConnector(BS, cpu_blocks=4), decode]))
    s.add_request(Request("a", list(range(1, 21)), max_tokens=2))
    decode.arrived("a", 19)
    run(s)  # "a" loads its 3 blocks, computes its last prompt token, names its 2 full blocks
    s.add_request(Request("b", list(range(1, 18)) + [90, 91, 92], max_tokens=2))  # shares 2 blocks with "a"
    decode.arrived("b", 19)
    plan = s.schedule()
    (scheduled,) = plan.scheduled
    assert (scheduled.start_position, scheduled.token_ids) == (19, [92])
    # The sent message holds 3 blocks: the first two are found here (-1: received and dropped).
    assert plan.kv_transfer.loads == [BlockCopy(-1, REMOTE, "b", 0), BlockCopy(-1, REMOTE, "b", 1),
                                      BlockCopy(scheduled.block_table[2], REMOTE, "b", 2)]
    s.update(plan, {"b": [5]})
    assert s.prefix_cache_stats.device_hits == 16  # counted as the step's update takes the admission
    run(s)
    assert s.num_free_blocks == 16 and decode.stats()["blocks"] == 3 + 1


def test_a_decode_instance_loads_a_prefix_from_its_cpu_tier_and_recomputes_after_a_failed_tier_load():
    decode, tiers = DecodeConnector(BS), TieredKVConnector(BS, cpu_blocks=8)
    multi = MultiConnector([tiers, decode])
    assert multi.swap_out == tiers.swap_out and multi.reset == tiers.reset
    s = sched(multi, num_blocks=4, preemption="swap")
    s.add_request(Request("a", list(range(1, 21)), max_tokens=2))
    decode.arrived("a", 19)
    run(s)
    s.add_request(Request("c", list(range(50, 74)), max_tokens=2))  # 3 blocks: evicts "a"'s named blocks
    decode.arrived("c", 23)
    plan = s.schedule()
    assert plan_for(plan.kv_transfer, tiers.tiers).loads == [] and len(plan_for(plan.kv_transfer, (REMOTE,)).loads) == 3
    s.update(plan, {"c": [5]})
    plans = [plan] + run(s)
    # "a"'s two named blocks, evicted as "c" takes the cache, went to the CPU tier.
    assert [c.tier for p in plans for c in p.kv_transfer.saves] == ["cpu", "cpu"]
    s.add_request(Request("b", list(range(1, 18)) + [90, 91, 92], max_tokens=2))
    decode.arrived("b", 19)
    plan = s.schedule()
    (scheduled,) = plan.scheduled
    cpu = [c for c in plan.kv_transfer.loads if c.tier == "cpu"]
    assert [c.block_id for c in cpu] == scheduled.block_table[:2]
    assert [c.block_id for c in plan.kv_transfer.loads if c.tier == REMOTE] == [-1, -1, scheduled.block_table[2]]
    assert tiers.stats()["hit_blocks"]["cpu"] == 2
    # A failed CPU load goes back to the tiers alone, and the request recomputes.
    s.transfers_failed(plan, cpu[:1])
    assert tiers.stats()["failed_loads"] == 1 and plan.requeued == ["b"]
    run(s)
    assert s.num_free_blocks == 4


def test_a_prefill_instance_sends_its_prompt_and_writes_through_to_its_tier_in_one_plan():
    prefill, tiers = PrefillConnector(BS), TieredKVConnector(BS, cpu_blocks=4)
    s = sched(MultiConnector([tiers, prefill]), num_blocks=3)
    s.add_request(Request("a", list(range(1, 18)), max_tokens=1))
    run(s)
    s.add_request(Request("b", list(range(30, 47)), max_tokens=1))  # evicts "a"'s two named blocks
    plans = run(s)
    saves = plans[0].kv_transfer.saves
    assert sorted(c.tier for c in saves) == ["cpu", "cpu", REMOTE, REMOTE, REMOTE]
    assert [c.key for c in s.pending_transfers().saves] == ["b"] * 3
    assert [ok for _, ok in prefill.take_outcomes()] == [True, True]
