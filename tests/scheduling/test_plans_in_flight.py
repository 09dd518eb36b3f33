"""Several step plans in flight (pipeline parallelism): a request scheduled in a plan whose update()
has not come is never scheduled again nor preempted, plans split the live requests between them,
and any order of schedules and in-order updates gives the tokens of one plan at a time."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.hypothesis_profiles import examples
from toolkit.scheduling import Request, RequestStatus, Scheduler, SchedulerConfig


def req(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(rid, [100 + i for i in range(prompt_len)], max_tokens)


def token(rid: str, position: int) -> int:
    """A deterministic 'model': the token depends only on the request and its position."""
    return 3 + (hash((rid, position)) % 50)


def sampled(plan, sched) -> dict[str, list[int]]:
    return {s.request_id: [token(s.request_id, s.start_position + len(s.token_ids))]
            for s in plan.scheduled if s.samples}


def run(depth: int, requests: list[tuple[int, int]], num_blocks: int, budget: int, block_size: int = 4):
    """Drive a scheduler with up to `depth` plans in flight, as the pipelined engine does; returns
    the outputs and the most plans that were in flight at once."""
    sched = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                                      max_model_len=64, max_plans_in_flight=depth))
    reqs = [req(f"r{i}", p, m) for i, (p, m) in enumerate(requests)]
    for r in reqs:
        sched.add_request(r)
    queue, most = deque(), 0
    for _ in range(10_000):
        if not sched.has_unfinished() and not queue:
            break
        plan = sched.schedule() if len(queue) < depth else None
        if plan is not None and plan.scheduled:
            ids = [s.request_id for s in plan.scheduled]
            busy = {s.request_id for p in queue for s in p.scheduled}
            assert busy.isdisjoint(ids), "a request was scheduled while its plan was in flight"
            assert busy.isdisjoint(plan.preempted), "a request in flight was preempted"
            queue.append(plan)
            most = max(most, len(queue))
            if len(queue) < depth:
                continue
        if queue:
            done = queue.popleft()
            sched.update(done, sampled(done, sched))
    assert not sched.has_unfinished() and sched.num_in_step == 0
    return {r.request_id: list(r.output_token_ids) for r in reqs}, most


def test_two_plans_split_the_requests_and_stay_in_flight():
    out, most = run(2, [(6, 5)] * 8, num_blocks=64, budget=64)
    assert most == 2
    one, _ = run(1, [(6, 5)] * 8, num_blocks=64, budget=64)
    assert out == one


def test_a_plan_takes_its_share_of_the_live_requests():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=512, max_model_len=64,
                                      max_plans_in_flight=2))
    for i in range(6):
        sched.add_request(req(f"r{i}", 5, 4))
    first, second, third = sched.schedule(), sched.schedule(), sched.schedule()
    assert [len(p.scheduled) for p in (first, second, third)] == [3, 3, 0]  # all six are in flight
    sched.update(first, sampled(first, sched))
    again = sched.schedule()
    assert {s.request_id for s in again.scheduled} == {s.request_id for s in first.scheduled}


def test_plans_in_flight_share_the_token_budget():
    # A 100-token prompt under a 40-token budget: one plan at a time takes 40-token chunks; two in
    # flight take 20 each, so the tokens in flight are still 40 and the chunks alternate plans.
    for depth, chunk in ((1, 40), (2, 20), (3, 14)):
        sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=40, max_model_len=128,
                                          max_plans_in_flight=depth))
        sched.add_request(req("long", 100, 2))
        sched.add_request(req("short", 3, 2))
        plan = sched.schedule()
        assert plan.num_batched_tokens == sum(len(s.token_ids) for s in plan.scheduled) <= chunk
        assert [len(s.token_ids) for s in plan.scheduled if s.request_id == "long"] == [chunk]


def test_no_preemption_of_a_request_in_flight():
    # 3 blocks of 4 tokens: r0 and r1 both running, r1 in flight; r0 needs another block and must wait
    # rather than take r1's (whose KV the plan in flight is writing).
    sched = Scheduler(SchedulerConfig(num_blocks=3, block_size=4, max_num_batched_tokens=64, max_model_len=12,
                                      max_plans_in_flight=2))
    sched.add_request(req("r0", 4, 6))
    sched.add_request(req("r1", 4, 4))
    plan = sched.schedule()
    assert {s.request_id for s in plan.scheduled} == {"r0"}  # a plan takes half of the two
    second = sched.schedule()
    assert {s.request_id for s in second.scheduled} == {"r1"}
    sched.update(plan, sampled(plan, sched))  # r0 has 5 tokens: its decode needs a second block
    third = sched.schedule()
    assert third.preempted == [] and [s.request_id for s in third.scheduled] == ["r0"]
    sched.update(second, sampled(second, sched))
    # r1's decode needs a block too, and the only other holder, r0, is in flight: r1 waits, unpreempted.
    fourth = sched.schedule()
    assert fourth.scheduled == [] and fourth.preempted == []
    assert sched.get_request("r1").status is RequestStatus.RUNNING
    sched.update(third, sampled(third, sched))
    fifth = sched.schedule()  # r0 is back: served first, it decodes within its blocks
    assert [s.request_id for s in fifth.scheduled] == ["r0"]


@settings(max_examples=examples(60), deadline=None)
@given(depth=st.integers(1, 4),
       requests=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), min_size=1, max_size=10),
       num_blocks=st.integers(8, 24), budget=st.integers(1, 40))
def test_plans_in_flight_give_the_tokens_of_one_plan_at_a_time(depth, requests, num_blocks, budget):
    # Tight caches force preemptions, small budgets chunked prefills; the tokens never change.
    out, _ = run(depth, requests, num_blocks, budget)
    one, _ = run(1, requests, num_blocks, budget)
    assert out == one
