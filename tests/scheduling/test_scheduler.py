"""Unit and property tests of scheduling/: pure Python, no model, no torch."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.hypothesis_profiles import examples
from toolkit.scheduling import (
    BlockPool,
    KVCacheManager,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    finish_reason,
)

S = RequestStatus


def req(rid: str, prompt_len: int, max_tokens: int, **kw) -> Request:
    return Request(rid, [100 + i for i in range(prompt_len)], max_tokens, **kw)


def sample_all(out: SchedulerOutput, token: int = 5) -> dict[str, list[int]]:
    return {s.request_id: [token] for s in out.scheduled if s.samples}


def step(sched: Scheduler, token: int = 5):
    out = sched.schedule()
    return out, sched.update(out, sample_all(out, token))


def run_to_completion(sched: Scheduler, token: int = 5, max_steps: int = 1000) -> list[Request]:
    finished = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return finished
        finished += step(sched, token)[1]
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def summary(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(s.request_id, s.start_position, s.num_new_tokens, s.samples) for s in out.scheduled]


# ---- Request, config, block pool, KV cache manager ---------------------------------------------


def test_request_properties_and_validation():
    r = Request("a", (1, 2, 3), 4, stop_token_ids=[9, 9, 8])
    assert r.stop_token_ids == frozenset({8, 9}) and isinstance(r.prompt_token_ids, list)
    r.append_output_token(7)
    r.append_output_token(6)
    assert (r.num_prompt_tokens, r.num_output_tokens, r.num_tokens) == (3, 2, 5)
    assert r.all_token_ids == [1, 2, 3, 7, 6]
    for start in range(6):
        for end in range(start, 6):
            assert r.token_ids_slice(start, end) == r.all_token_ids[start:end]


def test_status_finish_reason():
    assert [s.is_finished for s in (S.WAITING, S.RUNNING, S.PREEMPTED)] == [False] * 3
    assert finish_reason(S.FINISHED_STOPPED) == "stop"
    assert RequestStatus.finish_reason(S.FINISHED_LENGTH) == "length"
    assert finish_reason(S.FINISHED_ABORTED) == "abort"
    assert finish_reason(S.FINISHED_ERROR) == "error"
    assert finish_reason(S.RUNNING) is None
    assert all(s.is_finished for s in S if s.name.startswith("FINISHED"))


@pytest.mark.parametrize(
    "field, value",
    [("num_blocks", 0), ("block_size", -1), ("max_num_seqs", 0), ("max_num_batched_tokens", 0),
     ("max_model_len", 0), ("block_size", 2.0), ("num_blocks", True)],
)
def test_config_rejects_non_positive(field, value):
    kwargs = {"num_blocks": 8, field: value}
    with pytest.raises(ValueError, match=rf"SchedulerConfig\.{field} must be a positive integer"):
        SchedulerConfig(**kwargs)


def test_config_rejects_unknown_policy():
    with pytest.raises(ValueError, match=r"SchedulerConfig\.policy.*'fcfs', 'priority'.*'lifo'"):
        SchedulerConfig(num_blocks=8, policy="lifo")
    SchedulerConfig(num_blocks=8, policy="priority")


def test_block_pool_allocate_free_refcounts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.num_free == 1
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert pool.allocate(2) is None and pool.num_free == 1  # all or nothing
    pool.free(a[:2])
    assert pool.num_free == 3 and pool.ref_count(a[0]) == 0
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([a[0]])
    assert pool.allocate(0) == []
    b = pool.allocate(3)
    assert a[2] not in b and pool.num_free == 0


def test_kv_cache_manager_grows_tables_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r = req("r", 5, 10)
    assert len(kv.allocate_slots(r, 5)) == 2
    r.num_computed_tokens = 5
    assert len(kv.allocate_slots(r, 3)) == 2  # 8 tokens still fit in 2 blocks
    table = kv.allocate_slots(r, 4)  # 9 tokens: a third block
    assert len(table) == 3 and kv.block_table("r") == table and kv.num_free_blocks == 0
    r.num_computed_tokens = 12
    assert kv.allocate_slots(r, 1) is None
    assert kv.block_table("r") == table and kv.num_free_blocks == 0
    other = req("o", 1, 1)
    assert kv.allocate_slots(other, 1) is None and kv.block_table("o") == []
    kv.free(r)
    assert kv.num_free_blocks == 3 and kv.block_table("r") == []
    kv.free(r)  # a request without blocks frees nothing
    assert kv.num_free_blocks == 3


# ---- scheduling rules ----------------------------------------------------------------------------


def test_chunked_prefill_splits_long_prompt_while_another_decodes():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8))
    sched.add_request(req("a", 3, 10))
    out, _ = step(sched)
    assert summary(out) == [("a", 0, 3, True)]
    sched.add_request(req("b", 20, 2))
    out, _ = step(sched)
    assert summary(out) == [("a", 3, 1, True), ("b", 0, 7, False)]
    assert out.num_batched_tokens == 8
    assert out.scheduled[1].token_ids == list(range(100, 107))
    out, _ = step(sched)
    assert summary(out) == [("a", 4, 1, True), ("b", 7, 7, False)]
    assert out.scheduled[1].token_ids == list(range(107, 114))
    out, _ = step(sched)
    assert summary(out) == [("a", 5, 1, True), ("b", 14, 6, True)]
    assert len(out.scheduled[1].block_table) == 5  # 20 tokens at block size 4
    assert sched.get_request("b").output_token_ids == [5]
    out, _ = step(sched)
    assert summary(out) == [("a", 6, 1, True), ("b", 20, 1, True)]
    assert out.scheduled[1].token_ids == [5]


def test_decodes_come_before_prefills_whatever_the_priority():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8, policy="priority"))
    sched.add_request(req("low", 2, 10, priority=5))
    step(sched)
    sched.add_request(req("high", 20, 10, priority=-1))
    out, _ = step(sched)
    assert summary(out) == [("low", 2, 1, True), ("high", 0, 7, False)]
    out, _ = step(sched)
    assert summary(out) == [("low", 3, 1, True), ("high", 7, 7, False)]


def test_token_budget_and_max_num_seqs():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=10))
    for rid in "abc":
        sched.add_request(req(rid, 4, 2))
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a", "b"] and sched.num_waiting == 1
    assert sched.num_running == 2
    out, finished = step(sched)
    assert [r.request_id for r in finished] == ["a", "b"]
    out, _ = step(sched)
    assert summary(out) == [("c", 0, 4, True)]

    # The budget, not the seq limit, binds here: 3 + 3 tokens, then the third only gets what is left.
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=7))
    for rid in "xyz":
        sched.add_request(req(rid, 3, 2))
    out = sched.schedule()
    assert summary(out) == [("x", 0, 3, True), ("y", 0, 3, True), ("z", 0, 1, False)]
    assert out.num_batched_tokens == 7


def test_preemption_under_tiny_cache_and_resume_keeps_outputs():
    sched = Scheduler(SchedulerConfig(num_blocks=4, block_size=2))
    sched.add_request(req("a", 3, 4))
    sched.add_request(req("b", 3, 4))
    out, _ = step(sched, token=11)
    assert [s.request_id for s in out.scheduled] == ["a", "b"] and sched.num_free_blocks == 0
    out, _ = step(sched, token=12)  # 4 tokens each: still 2 blocks each
    assert out.preempted == []
    out = sched.schedule()  # a needs a third block: the newest, b, is preempted
    assert out.preempted == ["b"] and summary(out) == [("a", 4, 1, True)]
    b = sched.get_request("b")
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (S.PREEMPTED, 0, 1)
    assert b.output_token_ids == [11, 12]
    assert sched.num_waiting == 1 and sched.num_running == 1
    sched.update(out, {"a": [13]})
    out, finished = step(sched, token=14)  # b's recompute needs 3 blocks, only 1 is free
    assert summary(out) == [("a", 5, 1, True)] and [r.request_id for r in finished] == ["a"]
    out = sched.schedule()
    assert summary(out) == [("b", 0, 5, True)]
    assert out.scheduled[0].token_ids == [100, 101, 102, 11, 12]
    assert sched.get_request("b").status is S.RUNNING
    sched.update(out, {"b": [15]})
    step(sched, token=16)
    assert b.status is S.FINISHED_LENGTH and b.output_token_ids == [11, 12, 15, 16]
    assert sched.num_free_blocks == 4 and not sched.has_unfinished()


def test_resumed_request_recomputes_outputs_in_chunks_and_samples_once():
    sched = Scheduler(SchedulerConfig(num_blocks=4, block_size=2, max_num_batched_tokens=4))
    sched.add_request(req("a", 2, 5))
    sched.add_request(req("b", 2, 5))
    for token in (20, 21, 22):
        step(sched, token)
    out, _ = step(sched, 23)
    assert out.preempted == ["b"]
    step(sched, 24)  # a finishes
    out, _ = step(sched, 25)  # b's prompt + 3 outputs is 5 tokens: a first chunk of 4, without sampling
    assert summary(out) == [("b", 0, 4, False)] and out.scheduled[0].token_ids == [100, 101, 20, 21]
    out, _ = step(sched, 26)
    assert summary(out) == [("b", 4, 1, True)] and out.scheduled[0].token_ids == [22]
    assert sched.get_request("b").output_token_ids == [20, 21, 22, 26]


def _three_running(policy: str) -> Scheduler:
    # Block size 1: every decode needs a fresh block, and the 6 blocks are all taken after the prefills.
    sched = Scheduler(SchedulerConfig(num_blocks=6, block_size=1, policy=policy))
    for rid, priority in (("a", 2), ("b", 0), ("c", 1)):
        sched.add_request(req(rid, 2, 3, priority=priority))
    step(sched)
    assert sched.num_running == 3 and sched.num_free_blocks == 0
    return sched


def test_fcfs_preempts_the_newest_arrival():
    sched = _three_running("fcfs")
    out = sched.schedule()
    assert out.preempted == ["c"]
    assert [s.request_id for s in out.scheduled] == ["a", "b"]


def test_priority_preempts_the_largest_priority_value():
    sched = _three_running("priority")
    out = sched.schedule()
    assert out.preempted == ["a"]
    assert [s.request_id for s in out.scheduled] == ["b", "c"]


def test_victim_already_scheduled_this_step_is_unscheduled():
    # "low" decodes first, then "high" (more important, mid-prefill) needs the last blocks: "low" is
    # preempted and must vanish from this step's batch, its token refunded to the budget.
    sched = Scheduler(SchedulerConfig(num_blocks=6, block_size=2, max_num_batched_tokens=4, policy="priority"))
    sched.add_request(req("low", 2, 5, priority=0))
    step(sched)
    sched.add_request(req("high", 8, 1, priority=-1))
    out, _ = step(sched)
    assert summary(out) == [("low", 2, 1, True), ("high", 0, 3, False)]
    out, _ = step(sched)
    assert summary(out) == [("low", 3, 1, True), ("high", 3, 3, False)]
    assert sched.num_free_blocks == 1
    out = sched.schedule()
    assert out.preempted == ["low"]
    assert summary(out) == [("high", 6, 2, True)] and out.num_batched_tokens == 2
    assert sched.get_request("low").status is S.PREEMPTED


def test_request_preempting_itself_is_not_scheduled():
    # "new" is the newest running request and the only one that needs a block: it is its own victim.
    sched = Scheduler(SchedulerConfig(num_blocks=4, block_size=2))
    sched.add_request(req("old", 3, 4))  # 2 blocks, position 3 still fits
    sched.add_request(req("new", 4, 4))  # 2 full blocks, its first decode needs a third
    step(sched)
    assert sched.num_free_blocks == 0
    out = sched.schedule()
    assert out.preempted == ["new"] and summary(out) == [("old", 3, 1, True)]
    assert sched.get_request("new").status is S.PREEMPTED and sched.num_free_blocks == 2


def test_head_of_line_request_is_not_jumped():
    sched = Scheduler(SchedulerConfig(num_blocks=4, block_size=4))
    sched.add_request(req("a", 11, 4))  # 3 blocks; its next decode (position 11) needs no new one
    step(sched)
    assert sched.num_free_blocks == 1
    sched.add_request(req("b", 8, 1))  # needs 2 blocks
    sched.add_request(req("c", 1, 1))  # would fit in the 1 free block
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["a"] and sched.num_waiting == 2
    assert sched.num_free_blocks == 1


def test_priority_admission_order():
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_num_seqs=1, policy="priority"))
    for rid, priority in (("a", 1), ("b", 0), ("c", 0), ("d", -3)):
        sched.add_request(req(rid, 2, 1, priority=priority))
    order = []
    for _ in range(100):
        out, _ = step(sched)
        order += [s.request_id for s in out.scheduled]
    assert not sched.has_unfinished()
    assert order == ["d", "b", "c", "a"]


def test_never_fitting_request_fails_alone():
    sched = Scheduler(SchedulerConfig(num_blocks=4, block_size=4, max_model_len=64))
    big = req("big", 10, 20)  # 30 tokens -> 8 blocks > 4
    long = req("long", 65, 1)
    sched.add_request(big)
    sched.add_request(long)
    sched.add_request(req("ok", 3, 2))
    assert big.status is S.FINISHED_ERROR and long.status is S.FINISHED_ERROR
    assert big.error == (
        "request needs 8 KV blocks (prompt 10 + max_tokens 20 tokens, at block size 4) "
        "but the cache has only 4; raise the KV memory or lower max_tokens"
    )
    assert "65 tokens" in long.error and "max_model_len is 64" in long.error
    out, _ = step(sched)
    assert out.rejected == [big, long] and [s.request_id for s in out.scheduled] == ["ok"]
    out, finished = step(sched)
    assert out.rejected == [] and [r.request_id for r in finished] == ["ok"]
    assert not sched.has_unfinished() and sched.num_free_blocks == 4


def test_invalid_requests_fail_alone():
    # The engine computes max_tokens = max_model_len - prompt length when the user gives none: a full
    # or empty prompt must come back as an error, not raise inside add_request.
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_model_len=8))
    empty, no_room, ok = Request("e", [], 4), req("n", 8, 0), req("ok", 7, 1)
    for r in (empty, no_room, ok):
        sched.add_request(r)
    assert "prompt is empty" in empty.error
    assert no_room.error == "max_tokens must be at least 1, got 0"
    out, finished = step(sched)
    assert out.rejected == [empty, no_room] and finished == [ok] and ok.num_tokens == 8
    assert all(r.status is S.FINISHED_ERROR for r in (empty, no_room))


def test_rejection_counts_max_model_len_cap_and_is_pending_work():
    sched = Scheduler(SchedulerConfig(num_blocks=2, block_size=4, max_model_len=8))
    fits = req("fits", 4, 100)  # capped at 8 tokens = 2 blocks
    sched.add_request(fits)
    assert fits.status is S.WAITING
    sched2 = Scheduler(SchedulerConfig(num_blocks=2, block_size=4, max_model_len=12))
    bad = req("bad", 4, 100)
    sched2.add_request(bad)
    assert "capped at max_model_len 12" in bad.error and "needs 3 KV blocks" in bad.error
    assert sched2.has_unfinished()  # the rejection still has to be reported
    assert sched2.schedule().rejected == [bad]
    assert not sched2.has_unfinished() and sched2.schedule().rejected == []
    run_to_completion(sched)
    assert fits.status is S.FINISHED_LENGTH and fits.num_tokens == 8


def test_finish_request_frees_blocks_and_is_idempotent():
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_num_seqs=1))
    a, b = req("a", 6, 10), req("b", 3, 10)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert sched.num_free_blocks == 6
    sched.finish_request("a", S.FINISHED_ABORTED)
    assert a.status is S.FINISHED_ABORTED and sched.num_free_blocks == 8 and sched.num_running == 0
    sched.finish_request("a", S.FINISHED_ABORTED)
    sched.finish_request("nobody", S.FINISHED_ABORTED)
    with pytest.raises(KeyError):
        sched.get_request("a")
    sched.finish_request("b", S.FINISHED_STOPPED)  # still waiting
    assert b.status is S.FINISHED_STOPPED and sched.num_waiting == 0 and not sched.has_unfinished()
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_request("b", S.RUNNING)
    sched.add_request(req("a", 2, 1))  # the id is free again


def test_abort_between_schedule_and_update():
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4))
    sched.add_request(req("a", 3, 5))
    sched.add_request(req("b", 3, 1))
    out = sched.schedule()
    sched.finish_request("a", S.FINISHED_ABORTED)
    finished = sched.update(out, sample_all(out))
    assert [r.request_id for r in finished] == ["b"]
    assert sched.num_free_blocks == 8 and not sched.has_unfinished()


def test_min_tokens_delays_stop_tokens():
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4))
    late = req("late", 2, 10, min_tokens=3, stop_token_ids={7})
    early = req("early", 2, 10, stop_token_ids={7})
    sched.add_request(late)
    sched.add_request(early)
    run_to_completion(sched, token=7)
    assert early.output_token_ids == [7] and early.status is S.FINISHED_STOPPED
    assert late.output_token_ids == [7, 7, 7] and late.status is S.FINISHED_STOPPED
    assert late.stop_reason == 7


def test_length_limits():
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_model_len=6))
    by_model_len, by_max_tokens, full_prompt = req("m", 4, 10), req("t", 1, 3), req("f", 6, 10)
    for r in (by_model_len, by_max_tokens, full_prompt):
        sched.add_request(r)
    finished = run_to_completion(sched)
    assert {r.request_id for r in finished} == {"m", "t", "f"}
    assert all(r.status is S.FINISHED_LENGTH and r.stop_reason is None for r in finished)
    assert (by_model_len.num_tokens, by_max_tokens.num_output_tokens, full_prompt.num_output_tokens) == (6, 3, 1)


def decoding(sched: Scheduler, r: Request, first: int = 1) -> Request:
    """Add r and run its prefill, which samples `first`: r then decodes."""
    sched.add_request(r)
    sched.update(sched.schedule(), {r.request_id: [first]})
    return r


def test_drafts_are_scheduled_after_the_last_token_and_only_accepted_ones_count():
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4))
    r = decoding(sched, req("r", 3, 10))
    r.spec_token_ids = [7, 8, 9]
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.token_ids == [1, 7, 8, 9] and s.num_draft_tokens == 3 and s.start_position == 3 and s.samples
    assert out.num_batched_tokens == 4
    # 7 accepted, 8 rejected: the target's own token 6 replaces it.
    sched.update(out, {"r": [7, 6]})
    assert r.output_token_ids == [1, 7, 6] and r.num_computed_tokens == 5 and r.spec_token_ids == []
    # The next step feeds 6 at position 5: the slot the rejected draft 8 had written is written again.
    (s,) = sched.schedule().scheduled
    assert s.token_ids == [6] and s.start_position == 5


def test_a_verified_run_stops_where_plain_decoding_would():
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4))
    r = decoding(sched, req("r", 2, 10, stop_token_ids={7}))
    r.spec_token_ids = [7, 3]
    assert sched.update(sched.schedule(), {"r": [7, 3, 5]}) == [r]
    assert r.output_token_ids == [1, 7] and r.stop_reason == 7 and sched.num_free_blocks == 8
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4))
    r = decoding(sched, req("r", 2, 3))
    r.spec_token_ids = [7, 3]
    assert sched.update(sched.schedule(), {"r": [7, 3, 5]}) == [r]
    assert r.output_token_ids == [1, 7, 3] and r.status is RequestStatus.FINISHED_LENGTH


def test_drafts_are_cut_to_the_token_budget_and_more_tokens_than_drafts_is_loud():
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_num_batched_tokens=3))
    r = decoding(sched, req("r", 2, 10))
    r.spec_token_ids = [7, 8, 9, 10]
    out = sched.schedule()
    assert out.scheduled[0].token_ids == [1, 7, 8] and out.scheduled[0].num_draft_tokens == 2
    with pytest.raises(ValueError, match="verified 2 drafts but got 4 tokens"):
        sched.update(out, {"r": [7, 8, 9, 10]})


def test_lookahead_slots_are_reserved_for_a_draft_model_and_capped_by_the_request():
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, num_lookahead_tokens=3))
    sched.add_request(req("r", 4, 10))
    out = sched.schedule()  # the prefill samples: 4 tokens + 3 lookahead slots = 2 blocks
    assert len(out.scheduled[0].block_table) == 2
    # A request that can hold only 5 tokens never gets slots past them.
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, num_lookahead_tokens=6))
    sched.add_request(req("s", 4, 1))
    assert len(sched.schedule().scheduled[0].block_table) == 2  # 5 tokens, not 10
    # A chunk that does not sample gets none.
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, num_lookahead_tokens=3, max_num_batched_tokens=4))
    sched.add_request(req("t", 8, 4))
    assert len(sched.schedule().scheduled[0].block_table) == 1


def test_a_recompute_that_leaves_one_token_gets_lookahead_slots_too():
    """After a preemption the request recomputes all but its last token, then decodes it: the draft
    model writes past that chunk, so its slots are reserved then (this once ran off the table's end)."""
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, num_lookahead_tokens=3, max_num_batched_tokens=3))
    # As a preempted request comes back: 4 tokens (3 prompt, 1 output), none computed; the budget of 3
    # recomputes all but the last, which the draft feeds right after this step.
    r = Request("r", [100, 101, 102], 10, output_token_ids=[1])
    sched.add_request(r)
    (s,) = sched.schedule().scheduled
    assert len(s.token_ids) == 3 and not s.samples
    # The draft then writes positions 3..5 (the last token and 2 drafts): 6 slots, 2 blocks.
    assert len(s.block_table) == 2


def test_drafts_give_way_before_anyone_is_preempted_for_them():
    sched = Scheduler(SchedulerConfig(num_blocks=2, block_size=4))
    old, new = req("old", 3, 5), req("new", 3, 5)
    sched.add_request(old)
    sched.add_request(new)
    sched.update(sched.schedule(), {"old": [1], "new": [1]})
    # Each holds one block; 3 drafts from position 3 would need a second: the drafts are dropped instead.
    old.spec_token_ids = [7, 8, 9]
    out = sched.schedule()
    assert out.preempted == [] and [s.num_draft_tokens for s in out.scheduled] == [0, 0]
    # So do a draft model's lookahead slots: b is admitted with the one block left, without them.
    sched = Scheduler(SchedulerConfig(num_blocks=3, block_size=4, num_lookahead_tokens=3))
    a, b = req("a", 3, 5), req("b", 3, 5)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [(s.request_id, len(s.block_table)) for s in out.scheduled] == [("a", 2), ("b", 1)]


def test_preemption_drops_a_requests_drafts():
    sched = Scheduler(SchedulerConfig(num_blocks=2, block_size=4))
    old, new = req("old", 4, 3), req("new", 3, 3)  # each fits the cache alone
    sched.add_request(old)
    sched.add_request(new)
    sched.update(sched.schedule(), {"old": [1], "new": [1]})
    new.spec_token_ids = [9]
    out = sched.schedule()  # old's next token (position 4) needs a second block: new is preempted
    assert out.preempted == ["new"] and new.spec_token_ids == [] and new.num_computed_tokens == 0
    assert [s.request_id for s in out.scheduled] == ["old"]


def test_update_misuse_is_loud():
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4))
    sched.add_request(req("r", 5, 4))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(req("r", 1, 1))
    out = sched.schedule()
    with pytest.raises(KeyError, match="no sampled token"):
        sched.update(out, {})
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4))
    sched.add_request(req("r", 5, 4))
    out = sched.schedule()
    sched.update(out, {"r": [1]})
    with pytest.raises(RuntimeError, match="called twice"):
        sched.update(out, {"r": [1]})


# ---- property tests: a fake paged model drives the scheduler ----------------------------------

VOCAB = 40


def next_token(context: list[int]) -> int:
    h = 0
    for t in context:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


class FakePagedModel:
    """Stores every fed token in its KV slot and samples from the context it reads back through the
    block table, so a wrong position, block table or shared block changes the tokens it generates."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)

    def slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def run(self, out: SchedulerOutput) -> dict[str, list[int]]:
        for s in out.scheduled:  # write the whole batch's KV first, as write_kv does
            for i, token in enumerate(s.token_ids):
                self.slots[self.slot(s.block_table, s.start_position + i)] = token
        sampled = {}
        for s in out.scheduled:
            if s.samples:
                end = s.start_position + s.num_new_tokens
                sampled[s.request_id] = [next_token([self.slots[self.slot(s.block_table, p)] for p in range(end)])]
        return sampled


def reference_generation(r: Request, max_model_len: int) -> tuple[list[int], RequestStatus]:
    tokens, out = list(r.prompt_token_ids), []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t in r.stop_token_ids and len(out) >= r.min_tokens:
            return out, S.FINISHED_STOPPED
        if len(out) >= r.max_tokens or len(tokens) >= max_model_len:
            return out, S.FINISHED_LENGTH


def never_fits(r: Request, cfg: SchedulerConfig) -> bool:  # the generators make no empty prompt or max_tokens 0
    total = min(r.num_prompt_tokens + r.max_tokens, cfg.max_model_len)
    return r.num_prompt_tokens > cfg.max_model_len or -(-total // cfg.block_size) > cfg.num_blocks


def check_output(sched, cfg, out, requests, before, order_key):
    """Check one SchedulerOutput; `before` is each request's (status, tokens not yet computed) before
    schedule(), `order_key` the service order the policy promises (arrival, or priority then arrival)."""
    ids = [s.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids)) and len(ids) <= cfg.max_num_seqs
    assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled) <= cfg.max_num_batched_tokens
    assert not set(out.preempted) & set(ids)
    live_before = [rid for rid, (status, _) in before.items() if not status.is_finished]
    assert ids or not live_before, "a step with live requests scheduled nothing"
    kinds = []
    for s in out.scheduled:
        r = requests[s.request_id]
        end = s.start_position + s.num_new_tokens
        assert r.status is S.RUNNING and s.num_new_tokens >= 1
        assert s.start_position == r.num_computed_tokens and end <= r.num_tokens
        assert s.token_ids == r.all_token_ids[s.start_position:end]
        assert s.samples == (end == r.num_tokens)
        assert len(s.block_table) * cfg.block_size >= end
        assert s.block_table == sched.kv_cache.block_table(s.request_id)
        status, remaining = before[s.request_id]
        kinds.append(0 if status is S.RUNNING and remaining == 1 else 1 if status is S.RUNNING else 2)
    assert kinds == sorted(kinds), "decodes, then running prefills, then admissions"
    admitted = [s.request_id for s, kind in zip(out.scheduled, kinds) if kind == 2]
    waiting = sorted((rid for rid, (status, _) in before.items() if status in (S.WAITING, S.PREEMPTED)), key=order_key)
    assert admitted == waiting[: len(admitted)], "admissions follow the policy order, none jumps the line"
    for rid in out.preempted:
        r = requests[rid]
        assert before[rid][0] is S.RUNNING and r.status is S.PREEMPTED and r.num_computed_tokens == 0


def check_blocks(sched, cfg, requests):
    owned = sched.kv_cache.owned_blocks()
    flat = [b for table in owned.values() for b in table]
    assert len(flat) == len(set(flat)), "a block is owned by two requests"
    assert len(flat) + sched.num_free_blocks == cfg.num_blocks, "a block leaked"
    pool = sched.kv_cache.block_pool
    assert [pool.ref_count(b) for b in range(cfg.num_blocks)] == [int(b in set(flat)) for b in range(cfg.num_blocks)]
    for rid in owned:
        assert requests[rid].status is S.RUNNING, "only running requests hold blocks"
    assert sched.num_running <= cfg.max_num_seqs
    live = [r for r in requests.values() if not r.status.is_finished]
    assert sched.num_running + sched.num_waiting == len(live)


request_specs = st.lists(
    st.fixed_dictionaries({
        "prompt_len": st.integers(1, 40),
        "max_tokens": st.integers(1, 20),
        "min_frac": st.floats(0, 1),
        "stops": st.frozensets(st.integers(0, VOCAB - 1), max_size=2),
        "priority": st.integers(0, 3),
        "arrival_step": st.integers(0, 12),
        "seed": st.integers(0, VOCAB - 1),
        "abort_at": st.one_of(st.none(), st.integers(0, 30)),
    }),
    min_size=1,
    max_size=8,
)
configs = st.builds(
    SchedulerConfig,
    num_blocks=st.integers(1, 40),
    block_size=st.integers(1, 8),
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(1, 48),
    max_model_len=st.integers(4, 64),
    policy=st.sampled_from(["fcfs", "priority"]),
)


def build_requests(specs) -> list[Request]:
    out = []
    for i, spec in enumerate(specs):
        prompt = [(spec["seed"] + 7 * j) % VOCAB for j in range(spec["prompt_len"])]
        min_tokens = int(spec["min_frac"] * spec["max_tokens"])
        out.append(Request(f"r{i}", prompt, spec["max_tokens"], min_tokens=min_tokens,
                           stop_token_ids=spec["stops"], priority=spec["priority"],
                           arrival_time=float(spec["arrival_step"])))
    return out


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, specs=request_specs)
def test_random_workloads_keep_invariants_and_finish(cfg, specs):
    sched = Scheduler(cfg)
    model = FakePagedModel(cfg.num_blocks, cfg.block_size)
    reqs = build_requests(specs)
    requests = {}  # the requests that have arrived

    def order_key(rid):  # requests arrive in index order within a step
        spec = specs[int(rid[1:])]
        arrival = (spec["arrival_step"], int(rid[1:]))
        return (spec["priority"],) + arrival if cfg.policy == "priority" else arrival

    rejected, finished = [], []
    # A livelock would run forever; a correct scheduler has needed at most ~1 step per token (budget 1).
    max_steps = 13 + 20 * sum(r.num_prompt_tokens + r.max_tokens for r in reqs)
    step_no = 0
    while step_no < max_steps:
        for r, spec in zip(reqs, specs):
            if spec["arrival_step"] == step_no:
                requests[r.request_id] = r
                sched.add_request(r)
        if step_no > 12 and not sched.has_unfinished():
            break
        before = {rid: (r.status, r.num_tokens - r.num_computed_tokens) for rid, r in requests.items()}
        out = sched.schedule()
        rejected += out.rejected
        check_output(sched, cfg, out, requests, before, order_key)
        for r, spec in zip(reqs, specs):
            if spec["abort_at"] == step_no:  # between schedule and update, the engine's hardest moment
                sched.finish_request(r.request_id, S.FINISHED_ABORTED)
        finished += sched.update(out, model.run(out))
        check_blocks(sched, cfg, requests)
        step_no += 1
        if out.preempted:
            event("a request was preempted")
        if any(not s.samples for s in out.scheduled):
            event("a prompt was split into chunks")
    assert not sched.has_unfinished(), f"not done after {step_no} steps"
    assert sched.num_free_blocks == cfg.num_blocks

    assert sorted(r.request_id for r in rejected) == sorted(r.request_id for r in reqs if never_fits(r, cfg))
    assert len(finished) == len({id(r) for r in finished})
    for reason in ("error", "abort", "stop", "length"):
        if any(finish_reason(r.status) == reason for r in reqs):
            event(f"a request finished with reason {reason!r}")
    for r in reqs:
        if r in rejected:
            assert r.status is S.FINISHED_ERROR and r.error and r.output_token_ids == []
            continue
        expected_tokens, expected_status = reference_generation(r, cfg.max_model_len)
        if r.status is S.FINISHED_ABORTED:
            assert r not in finished
            assert r.output_token_ids == expected_tokens[: r.num_output_tokens]
        else:
            assert r in finished
            assert (r.output_token_ids, r.status) == (expected_tokens, expected_status)
            assert r.stop_reason == (expected_tokens[-1] if expected_status is S.FINISHED_STOPPED else None)


@settings(max_examples=examples(100), deadline=None)
@given(
    cfg=configs,
    lengths=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)), min_size=3, max_size=6),
    spare_blocks=st.integers(0, 2),
)
def test_tight_cache_contention_finishes_with_exact_outputs(cfg, lengths, spare_blocks):
    """Every request fits alone, but the cache is sized for the largest one plus a few blocks, so
    requests arriving together keep preempting each other."""
    reqs = [Request(f"q{i}", [(i + j) % VOCAB for j in range(p)], m, priority=prio)
            for i, (p, m, prio) in enumerate(lengths)]
    reqs = [r for r in reqs if r.num_prompt_tokens <= cfg.max_model_len]
    needed = [-(-min(r.num_prompt_tokens + r.max_tokens, cfg.max_model_len) // cfg.block_size) for r in reqs]
    cfg = dataclasses.replace(cfg, num_blocks=max(needed, default=1) + spare_blocks,
                              max_num_seqs=max(cfg.max_num_seqs, 3))
    sched = Scheduler(cfg)
    model = FakePagedModel(cfg.num_blocks, cfg.block_size)
    requests = {r.request_id: r for r in reqs}
    for r in reqs:
        sched.add_request(r)

    def order_key(rid):
        r = requests[rid]
        return (r.priority, int(rid[1:])) if cfg.policy == "priority" else int(rid[1:])

    steps = 0
    while sched.has_unfinished():
        before = {rid: (r.status, r.num_tokens - r.num_computed_tokens) for rid, r in requests.items()}
        out = sched.schedule()
        check_output(sched, cfg, out, requests, before, order_key)
        sched.update(out, model.run(out))
        check_blocks(sched, cfg, requests)
        steps += 1
        assert steps < 20 * sum(r.num_prompt_tokens + r.max_tokens for r in reqs), "livelock"
        if out.preempted:
            event("a request was preempted")
    for r in reqs:
        assert (r.output_token_ids, r.status) == reference_generation(r, cfg.max_model_len)


def test_the_scheduler_imports_without_torch():
    # The scheduling room is bookkeeping: importing it (through the toolkit package) loads no torch.
    import subprocess
    import sys

    code = "import sys, toolkit.scheduling; assert 'torch' not in sys.modules, 'torch was imported'"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
