"""Prefix caching and the KV tiers' bookkeeping, without torch: block names, the LRU pool, the
scheduler's prefix hits, and a property test that runs random arrivals with shared prefixes through
the scheduler and a simulated device whose KV slots hold (token, position) pairs, so a read of any
block that holds anything but the request's own tokens fails the test."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.hypothesis_profiles import examples
from toolkit.scheduling import Request, RequestStatus, Scheduler, SchedulerConfig
from toolkit.scheduling.block_hash import extend_block_hashes, hash_block
from toolkit.scheduling.block_pool import BlockPool
from toolkit.scheduling.kv_tiers import DiskResidency, TieredKVConnector

BS = 4


def tokens(n: int, start: int = 0) -> list[int]:
    return [start + i for i in range(n)]


# ---- block names -----------------------------------------------------------------------------

def test_block_hash_chains_over_the_parent_and_is_stable():
    a = extend_block_hashes([], tokens(12), BS)
    assert len(a) == 3
    assert a == extend_block_hashes([], tokens(12) + [99], BS)  # a partial block has no name yet
    assert a[0] == hash_block(None, tokens(4))  # stable across processes: no Python hash()
    b = extend_block_hashes([], [7] + tokens(11, 1), BS)
    assert b[0] != a[0] and b[1] != a[1]  # same tokens in block 1, a different parent
    grown = extend_block_hashes(list(a[:1]), tokens(12), BS)
    assert grown == a


def test_cache_salt_keeps_tenants_apart_through_the_chain():
    plain = extend_block_hashes([], tokens(8), BS)
    salted = extend_block_hashes([], tokens(8), BS, cache_salt="tenant-a")
    other = extend_block_hashes([], tokens(8), BS, cache_salt="tenant-b")
    assert plain[0] != salted[0] != other[0] and plain[1] != salted[1] != other[1]


# ---- the pool ----------------------------------------------------------------------------------

def test_freed_named_blocks_are_evicted_least_recently_used_tail_first():
    pool = BlockPool(6, enable_caching=True)
    a, b = pool.allocate(3), pool.allocate(3)
    for i, block in enumerate(a + b):
        pool.cache(block, bytes([i]) * 16)
    pool.free(reversed(a))  # a request's table, tail first
    pool.free(reversed(b))
    assert pool.free_block_ids() == list(reversed(a)) + list(reversed(b))
    assert pool.lookup([bytes([0]) * 16, bytes([1]) * 16]) == a[:2]
    pool.touch(a[:2])  # a hit takes them back out of the free queue
    assert pool.ref_count(a[0]) == 1 and pool.num_free == 4
    got = pool.allocate(1)
    assert got == [a[2]] and pool.drain_evicted() == [(a[2], bytes([2]) * 16)]
    assert pool.lookup([bytes([0]) * 16, bytes([1]) * 16, bytes([2]) * 16]) == a[:2]


def test_unnamed_free_blocks_are_reused_before_any_cached_one():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(4)
    pool.cache(blocks[0], b"x" * 16)
    pool.free(blocks)
    assert sorted(pool.allocate(3)) == blocks[1:]
    assert pool.drain_evicted() == []


def test_one_name_one_block_and_nothing_named_without_caching():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.allocate(2)
    assert pool.cache(a, b"h" * 16) and not pool.cache(b, b"h" * 16)
    off = BlockPool(2)
    assert not off.cache(off.allocate(1)[0], b"h" * 16)


# ---- the scheduler's prefix hits -------------------------------------------------------------

def sched(num_blocks=16, connector=None, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=BS, max_model_len=64, enable_prefix_caching=True,
                                     **kw), connector)


def finish_one(s: Scheduler, request: Request, token: int = 1) -> None:
    s.add_request(request)
    while not request.status.is_finished:
        out = s.schedule()
        s.update(out, {r.request_id: [token] for r in out.scheduled if r.samples})


def test_a_new_request_starts_after_its_cached_prefix_and_shares_those_blocks():
    s = sched()
    first = Request("a", tokens(10), max_tokens=1)
    finish_one(s, first)
    second = Request("b", tokens(10) + [50, 51], max_tokens=2)
    s.add_request(second)
    out = s.schedule()
    (scheduled,) = out.scheduled
    assert scheduled.start_position == 8 and scheduled.token_ids == [8, 9, 50, 51]
    assert second.num_cached_tokens == 8
    s.update(out, {"b": [1]})
    assert s.prefix_cache_stats.hits == 8 and s.prefix_cache_stats.queries == 10 + 12
    third = Request("c", tokens(8) + [60], max_tokens=2)
    s.add_request(third)
    out2 = s.schedule()
    shared = s.kv_cache.block_table("b")[:2]
    assert s.kv_cache.block_table("c")[:2] == shared
    assert all(s.kv_cache.block_pool.ref_count(b) == 2 for b in shared)
    s.update(out2, {r.request_id: [1] for r in out2.scheduled if r.samples})
    assert s.prefix_cache_stats.hits == 16 and s.prefix_cache_stats.queries == 22 + 9


def test_a_fully_cached_prompt_still_computes_its_last_token_in_a_block_of_its_own():
    s = sched()
    finish_one(s, Request("a", tokens(8), max_tokens=1))
    again = Request("b", tokens(8), max_tokens=1)
    s.add_request(again)
    (scheduled,) = s.schedule().scheduled
    # Block 1 holds the last token, which must be written: it is not shared, so only block 0 hits.
    assert scheduled.start_position == 4 and again.num_cached_tokens == 4


def test_a_prompt_whose_prefix_is_being_computed_waits_to_share_it():
    s = sched(max_num_batched_tokens=8)
    first = Request("a", tokens(12), max_tokens=1)
    twin = Request("b", tokens(12) + [90], max_tokens=1)  # the same first 12 tokens
    other = Request("c", tokens(5, 40), max_tokens=1)
    for r in (first, twin, other):
        s.add_request(r)
    out = s.schedule()  # a's first chunk fills the budget
    assert [r.request_id for r in out.scheduled] == ["a"]
    s.update(out, {})
    out = s.schedule()  # a's block 2 is still in flight: b waits for it, c (behind b) goes first
    assert [(r.request_id, r.start_position) for r in out.scheduled] == [("a", 8), ("c", 0)]
    s.update(out, {r.request_id: [1] for r in out.scheduled if r.samples})
    out = s.schedule()  # a's prompt is computed and named: b takes all of it
    assert ("b", 12) in [(r.request_id, r.start_position) for r in out.scheduled]
    assert twin.num_cached_tokens == 12


def test_salted_requests_do_not_share():
    s = sched()
    finish_one(s, Request("a", tokens(10), max_tokens=1, cache_salt="x"))
    other = Request("b", tokens(10), max_tokens=1, cache_salt="y")
    same = Request("c", tokens(10), max_tokens=1, cache_salt="x")
    s.add_request(other)
    s.add_request(same)
    starts = {r.request_id: r.start_position for r in s.schedule().scheduled}
    assert starts == {"b": 0, "c": 8}


# ---- a simulated device under random traffic -------------------------------------------------

class SimulatedDevice:
    """The worker side over lists: a KV slot holds the (token, position) that was written into it."""

    def __init__(self, num_blocks: int, cpu_blocks: int, rng: random.Random, corrupt: float):
        self.blocks = [[None] * BS for _ in range(num_blocks)]
        self.cpu = [None] * cpu_blocks
        self.disk: dict[str, list] = {}
        self.rng, self.corrupt = rng, corrupt

    def transfer(self, plan) -> list:
        for c in plan.saves:
            copy = list(self.blocks[c.block_id])
            if c.tier == "cpu":
                self.cpu[c.slot] = copy
            else:
                self.disk[c.key] = copy
        failed = []
        for c in plan.loads:
            source = self.cpu[c.slot] if c.tier == "cpu" else self.disk.get(c.key)
            if source is None or (c.tier == "disk" and self.rng.random() < self.corrupt):
                failed.append(c)
                self.blocks[c.block_id] = [None] * BS
            else:
                self.blocks[c.block_id] = list(source)
        for c in plan.deletes:
            self.disk.pop(c.key, None)
        return failed

    def forward(self, s: Scheduler, scheduled) -> None:
        request = s.get_request(scheduled.request_id)
        table, start = scheduled.block_table, scheduled.start_position
        everything = request.all_token_ids + scheduled.token_ids[len(request.all_token_ids) - start:]
        for pos in range(start + scheduled.num_new_tokens):
            if pos < start:  # attention reads the computed prefix: it must be this request's own KV
                assert self.blocks[table[pos // BS]][pos % BS] == (everything[pos], pos), (request.request_id, pos)
            else:
                block = table[pos // BS]
                assert s.kv_cache.block_pool.ref_count(block) == 1, "a shared block is written"
                assert s.kv_cache.block_pool.block_hash(block) is None, "a named block is written"
                self.blocks[block][pos % BS] = (everything[pos], pos)


def check_pool(s: Scheduler) -> None:
    pool = s.kv_cache.block_pool
    users = [0] * pool.num_blocks
    for table in s.kv_cache.owned_blocks().values():
        assert len(set(table)) == len(table)
        for block in table:
            users[block] += 1
    assert users == [pool.ref_count(b) for b in range(pool.num_blocks)], "a block leaked or is double-counted"
    assert sorted(pool.free_block_ids()) == [b for b in range(pool.num_blocks) if users[b] == 0]


def next_token(request: Request) -> int:
    # Few distinct values, so outputs share blocks too.
    return (request.num_tokens * 7 + request.prompt_token_ids[-1]) % 5


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(7, 16), cpu_blocks=st.sampled_from([0, 3, 12]),
       disk=st.booleans(), swap=st.booleans(), corrupt=st.sampled_from([0.0, 0.3]), budget=st.sampled_from([6, 64]))
# A preempted request whose re-admission lost its load once kept the count of that re-admission
# (its whole prompt) instead of its first admission's.
@example(seed=42627, num_blocks=10, cpu_blocks=0, disk=True, swap=False, corrupt=0.3, budget=6)
# A request dropped from its step for one failed load had its other, arrived loads counted as tier hits.
@example(seed=23285, num_blocks=7, cpu_blocks=3, disk=True, swap=False, corrupt=0.0, budget=64)
def test_random_traffic_with_shared_prefixes_and_tiers(seed, num_blocks, cpu_blocks, disk, swap, corrupt, budget):
    rng = random.Random(seed)
    swap = swap and cpu_blocks > 0
    residency = DiskResidency([], capacity_bytes=10 * 100, entry_bytes=100) if disk else None
    connector = TieredKVConnector(BS, cpu_blocks, residency) if cpu_blocks or disk else None
    s = sched(num_blocks, connector, max_num_batched_tokens=budget, max_num_seqs=6,
              preemption_mode="swap" if swap else "recompute")
    device = SimulatedDevice(num_blocks, cpu_blocks, rng, corrupt)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
    # Few suffixes, so whole prompts repeat too: later arrivals find their blocks evicted to a tier.
    pending = [Request(f"r{i}", rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(1, 6))],
                       max_tokens=rng.randrange(1, 8), cache_salt=rng.choice([None, None, "t"]))
               for i in range(24)]
    requests = list(pending)
    for _ in range(600):
        while pending and rng.random() < 0.3:
            s.add_request(pending.pop())
        if not pending and not s.has_unfinished():
            break
        out = s.schedule()
        if out.kv_transfer:
            failed = device.transfer(out.kv_transfer)
            if failed:
                s.transfers_failed(out, failed)
        for scheduled in out.scheduled:
            device.forward(s, scheduled)
        sampled = {r.request_id: [next_token(s.get_request(r.request_id))] for r in out.scheduled if r.samples}
        s.update(out, sampled)
        check_pool(s)
    assert not pending and not s.has_unfinished()
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
    stats = s.prefix_cache_stats
    assert stats.hits == stats.device_hits + stats.external_hits <= stats.queries
    assert all(0 <= r.num_cached_tokens < r.num_prompt_tokens for r in requests)
    if connector is not None and corrupt == 0.0:
        tier_hits = sum(connector.tier_stats.hit_blocks.values()) * BS
        assert tier_hits == stats.external_hits
    assert s.kv_cache.block_pool.num_free == num_blocks


def test_swap_preemption_brings_the_same_kv_back():
    connector = TieredKVConnector(BS, cpu_blocks=8)
    s = sched(num_blocks=6, connector=connector, preemption_mode="swap")
    device = SimulatedDevice(6, 8, random.Random(0), 0.0)
    a, b = Request("a", tokens(9), max_tokens=6), Request("b", tokens(9, 20), max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    while s.has_unfinished():
        out = s.schedule()
        if out.kv_transfer:
            assert device.transfer(out.kv_transfer) == []
        for scheduled in out.scheduled:
            device.forward(s, scheduled)
        s.update(out, {r.request_id: [1] for r in out.scheduled if r.samples})
    assert connector.tier_stats.swapped_out >= 1 and connector.tier_stats.swapped_in == connector.tier_stats.swapped_out
    assert b.num_preemptions >= 1 and a.num_output_tokens == b.num_output_tokens == 6


def test_swap_needs_a_tier_to_swap_to():
    with pytest.raises(ValueError, match="swap"):
        sched(preemption_mode="swap")
