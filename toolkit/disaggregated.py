"""Disaggregated prefill and decode: what an engine does differently as a prefill or a decode
instance. Chosen once, when the engine is built (`build_role`), as the engine core's hooks; the step itself is
the core's own.

Every rank is fed every request, in the same order (SPMD, as under TP), and the router
(parallel/disaggregated.py) gives each the same (prefill instance, decode instance) on every rank.
- The prefill instance runs the prompt but its last token, with one thrown-away sampled token
  (`PrefillRole`): after the step that ends it, its blocks' KV goes to the decode instance's ranks
  (scheduling/disaggregated.py plans it, parallel/disaggregated.py's KVSender sends it) and the
  decode instance's first rank is told (READY). It holds at most `prefill_backlog` requests at once,
  computing or staged until the decode side takes their KV; the next wait at its door (the
  instance's first rank counts and tells the others, whose sends may finish at other times).
- The decode instance (`DecodeRole`) adds the request when READY comes, holding that KV in its
  connector: the scheduler allocates its blocks, the step's plan receives the KV into them, and the
  forward computes the last prompt token and samples the first output token, with the request's own
  sampling parameters: from there it is an ordinary request, so outputs equal the colocated engine's.
  A request with a one-token prompt, or wanting prompt logprobs, is computed by the decode instance
  alone; so is one the prefill side failed (READY with ok = 0), and one whose prompt is at most
  `max_local_prefill_tokens` long (conditional disaggregation: a short prompt costs the decode
  instance less than its handoff and the prefill instance's queue cost it).
- The reverse, with `decode_token_cost` > 0: the router gives a prefill instance some requests whole
  (prefill and decode) while less work is routed to it than to the decode instance. They enter its
  engine once no prompt fed before them waits at its door, so their decodes come after the prompts
  it hands over (which are what its decode instances wait for), and their outputs are its own.
- At the end of a `generate` call the outputs of the instances that serve requests (every decode
  instance; a prefill instance too with `decode_token_cost`) are gathered on global rank 0, which first
  waits for every decode instance's DONE (their heartbeats tell a long decode from a hung one).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch.distributed as dist

from toolkit.metrics import Counter, Gauge
from toolkit.parallel.disaggregated import (DONE, READY, ControlPlane, Disaggregation, KVReceiver, KVSender, Router,
                                            SendWaiter, percentiles)
from toolkit.parallel.distributed import dist_timeout
from toolkit.sampling_params import SamplingParams
from toolkit.scheduling.disaggregated import DecodeConnector, PrefillConnector

log = logging.getLogger("toolkit")

IDLE_SLEEP_S = 0.0005  # between polls when a role has nothing to compute (2 cores: leave gloo its turn)


@dataclass
class _Expected:
    """A request a decode instance serves, until it is added to the engine."""

    seq: int
    prefill: int  # its prefill instance
    args: tuple  # Engine.admit's arguments, arrival time included


@dataclass
class RoleTimes:
    """Seconds per request on this instance: waiting to be scheduled, and the role's latencies."""

    queue: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {name: percentiles(getattr(self, name)) for name in ("queue", "ttft", "tpot")}

    def record(self, out, ready: float) -> None:
        """A served request's: its wait from `ready` (when it could run) to its first step, TTFT, TPOT."""
        m = out.metrics
        self.queue.append((m.first_scheduled_time or m.finished_time) - ready)
        if m.first_token_time is not None:
            self.ttft.append(m.first_token_time - m.arrival_time)
            tokens = max(len(c.token_ids) for c in out.outputs)
            if tokens > 1:
                self.tpot.append((m.finished_time - m.first_token_time) / (tokens - 1))


class _Role:
    """What both roles share: routing every request, the KV worker, stats. A role is the engine core's
    hooks (engine/build.py's NoHooks is the colocated engine's): it takes the requests routed to its
    instance, and works before and after the core's own step."""

    def __init__(self, disagg: Disaggregation, max_local_prefill: int = 0, decode_token_cost: float = 0.0):
        self.disagg = disagg
        self.max_local_prefill = max_local_prefill
        self.router = Router(disagg.layout, decode_token_cost)
        self.waiter = SendWaiter()
        self.control = ControlPlane(disagg, self.waiter)
        self.times = RoleTimes()
        self._seq = 0
        self._tags: dict[str, int] = {}
        self._peers: dict[str, object] = {}
        self.worker = None  # set by the role

    @property
    def role(self) -> str:
        return self.disagg.role

    def route(self, prompt_len: int, max_tokens: int, handoff: bool) -> tuple[int, int, int | None]:
        """(seq, prefill instance, decode instance) of the next request fed to the job; the decode
        instance is None when the prefill instance serves it whole."""
        p, d = self.router.route(prompt_len, max_tokens, handoff)
        self._seq += 1
        return self._seq, p, d

    def handoff(self, prompt_token_ids: list[int], params: SamplingParams) -> bool:
        """Whether a prefill instance computes the request's prompt: not for a one-token prompt (nothing
        to hand over), one at most max_local_prefill tokens long, nor one that wants prompt logprobs
        (they are computed with the prompt)."""
        return len(prompt_token_ids) > max(1, self.max_local_prefill) and params.prompt_logprobs is None

    def transfer(self, plan) -> list:
        from toolkit.attention.kv_transfer import run_transfers

        return run_transfers(self.worker, plan, len(self.worker.kv_caches))

    def stats(self) -> dict:
        d = self.disagg
        return {"role": self.role, "instance": d.instance.index, "tp": d.instance.tp, "pp": d.instance.pp,
                "dp": d.instance.dp, "replica": d.instance.replica,
                "local_rank": d.local_rank, "stage": d.stage, "tp_rank": d.tp_rank,
                "handoff": self.connector.stats(), "kv": self.worker.stats.as_dict(), **self.times.as_dict()}

    def reset_times(self) -> None:
        """Forget the per-request latencies and transfer times so far, and the router's loads (a
        benchmark's warm-up: every rank calls it at the same point, so their routers still agree)."""
        self.times = RoleTimes()
        self.worker.stats.seconds.clear()
        self.router.reset()

    def metrics(self) -> list:
        labels = {"role": self.role, "instance": str(self.disagg.instance.index)}
        kv = self.worker.stats
        out = [Counter("toolkit:disagg_kv_transfers", labels, kv.transfers),
               Counter("toolkit:disagg_kv_bytes", labels, kv.bytes),
               Counter("toolkit:disagg_kv_transfer_seconds", labels, sum(kv.seconds))]
        for name, values in (("queue", self.times.queue), ("ttft", self.times.ttft), ("tpot", self.times.tpot)):
            if values:
                out += [Gauge(f"toolkit:disagg_{name}_seconds_p50", labels, percentiles(values)["p50"]),
                        Gauge(f"toolkit:disagg_{name}_seconds_p99", labels, percentiles(values)["p99"])]
        return out

    def _idle(self) -> None:
        time.sleep(IDLE_SLEEP_S)

    def before_step(self, engine) -> None:
        pass



def whole_requests_due(whole: deque, door_head: int | None) -> list[tuple]:
    """The requests a prefill instance serves whole that enter its engine now, taken from `whole`
    ((seq, Engine.admit's arguments) in the order they were fed): every one while no prompt to hand
    over waits at the door (door_head None), else those fed before the door's first prompt (seq
    door_head). A whole request thus waits behind the prompts fed before it, never behind later ones."""
    due = []
    while whole and (door_head is None or whole[0][0] < door_head):
        due.append(whole.popleft()[1])
    return due


class PrefillRole(_Role):
    def __init__(self, disagg: Disaggregation, block_size: int, kv_caches, num_kv_heads: int, backlog: int = 64,
                 max_local_prefill: int = 0, decode_token_cost: float = 0.0):
        super().__init__(disagg, max_local_prefill, decode_token_cost)
        self.backlog = backlog
        self.block_size = block_size
        self._blocks: dict[str, int] = {}  # request id -> blocks of KV it sends (READY says so)
        self._door: deque = deque()  # Engine.admit's arguments of requests waiting for room
        self._whole: deque = deque()  # (seq, the same) of requests served here whole, until their turn
        self._served: set[str] = set()  # requests served here whole, until they finish
        self.served_times = RoleTimes()
        self.served_count = 0
        self.connector = PrefillConnector(block_size)
        self.worker = KVSender(kv_caches, disagg, num_kv_heads, self._peers.__getitem__, self._tags.__getitem__,
                               self.waiter)
        # Global rank 0: the DONE each decode instance's first rank still owes for this call. Their
        # heartbeats are read every step, so none waits long in a sender's queue.
        self._done_owed: dict[int, int] = {}
        self._call_open = False  # rank 0: a generate call has fed a request and not finished yet

    def add_request(self, engine, request_id, prompt_token_ids, params: SamplingParams, prompt, priority,
                    arrival_time, cache_salt) -> None:
        handoff = self.handoff(prompt_token_ids, params)
        seq, p, d = self.route(len(prompt_token_ids), params.max_tokens or engine.max_model_len, handoff)
        if self.disagg.rank == 0 and not self._call_open:  # the first request of a call
            self._open_call()
        if p != self.disagg.instance.index:
            return
        if d is None:  # served here whole; TTFT counts from now, not from when it enters the engine
            self._served.add(request_id)
            arrival = time.monotonic() if arrival_time is None else arrival_time
            self._whole.append((seq, (request_id, prompt_token_ids, params, prompt, priority, arrival, cache_salt)))
            return
        if not handoff:
            return
        self._tags[request_id] = seq
        self._peers[request_id] = self.disagg.instances("decode")[d]
        self._blocks[request_id] = -(-(len(prompt_token_ids) - 1) // self.block_size)
        # All but the last prompt token, one greedy token that nobody reads; it always ends by length.
        prefill = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        self._door.append((request_id, prompt_token_ids[:-1], prefill, None, priority, arrival_time, cache_salt))

    def before_step(self, engine) -> None:
        """Let in waiting requests while the instance holds fewer than `backlog` (in the engine, or
        staged for sending); then the requests served here whole, once no prompt to hand over waits at
        the door: behind those in the scheduler's queue, so their decodes do not slow the prompts a
        decode instance waits for. A whole request fed before every prompt still at the door enters
        anyway, so a door that never empties (a small backlog under steady load) cannot starve it."""
        if self._door:
            self._let_in(engine)
        for args in whole_requests_due(self._whole, self._tags[self._door[0][0]] if self._door else None):
            group = engine.admit(*args)
            self.connector.keep(group.children if group is not None else ())

    def _let_in(self, engine) -> None:
        room = None
        if self.disagg.local_rank == 0:
            # The handed-over requests it holds: in the engine (but those served here whole) or staged.
            whole = len(self._served) - len(self._whole)
            held = engine.num_held - whole + self.worker.staged_requests()
            room = max(0, self.backlog - held)
            stats = self.connector.handoff_stats
            stats.max_backlog = max(stats.max_backlog, held + min(room, len(self._door)))
        if self.disagg.instance.size > 1:
            box = [room]
            dist.broadcast_object_list(box, src=self.disagg.instance.ranks[0], group=self.disagg.instance_group)
            room = box[0]
        if room < len(self._door):
            self.connector.handoff_stats.door_waits += 1
        for _ in range(min(room, len(self._door))):
            engine.admit(*self._door.popleft())

    def after_step(self, engine, finished: list) -> list:
        served = []
        for out in finished:
            m = out.metrics
            if out.request_id in self._served:
                self._served.discard(out.request_id)
                self.served_count += 1
                served.append(out)
                self.served_times.record(out, m.arrival_time)
                continue
            # The handoff requests' own outputs are nobody's.
            self.times.queue.append((m.first_scheduled_time or m.finished_time) - m.arrival_time)
            self.times.ttft.append(m.finished_time - m.arrival_time)  # the KV ready to send
        self._ship(engine)
        if self._done_owed:
            self._take_done()
        if not engine.num_held:
            self.worker.stalled()
            self._idle()
        return served

    def _open_call(self) -> None:
        self._call_open = True
        self._done_owed = {inst.ranks[0]: 1 for inst in self.disagg.instances("decode")}

    def _take_done(self) -> bool:
        """Read what decode instances said (heartbeats, DONE); whether any said something."""
        got = self.control.receive(self._done_owed)
        for src, kind, *_ in got:
            if kind == DONE:
                del self._done_owed[src]
        return bool(got)

    def _ship(self, engine) -> None:
        """Send the KV of the requests that just ended (their blocks are still whole: no forward ran
        since), then tell their decode instances."""
        engine.flush_transfers()  # with the tiers' copies, if any
        for rid, ok in self.connector.take_outcomes():
            peer = self._peers.pop(rid)
            tag = self._tags.pop(rid)
            blocks = self._blocks.pop(rid)
            if self.disagg.local_rank == 0:
                self.control.send(peer.ranks[0], READY, tag, int(ok), blocks if ok else 0)
        self.worker.poll()

    def has_unfinished(self, engine, busy: bool) -> bool:
        return busy or self.worker.poll() > 0 or bool(self._door) or bool(self._whole) or self.connector.has_outcomes

    def abort(self, engine, request_id: str) -> None:
        """A request still at the door leaves it uncomputed, and its decode instance is told (READY with
        ok = 0) at the next step; one served here whole and not in the engine yet is dropped; one in
        the engine is the engine's to abort (a handed-over one's READY says failed)."""
        for i, args in enumerate(self._door):
            if args[0] == request_id:
                del self._door[i]
                self.connector.refuse(request_id)
                return
        for i, (_, args) in enumerate(self._whole):
            if args[0] == request_id:
                del self._whole[i]
                break
        self._served.discard(request_id)  # (one in the engine ends there, and no step returns it)

    def serves(self, request_id: str) -> bool:
        """Whether this instance returns the request's output: one it serves whole (with decode_token_cost)."""
        return request_id in self._served

    @property
    def num_awaited(self) -> int:
        """Requests served here whole that wait for the door to empty."""
        return len(self._whole)

    def stats(self) -> dict:
        return {**super().stats(), "served": {"requests": self.served_count, **self.served_times.as_dict()}}

    def metrics(self) -> list:
        labels = {"role": self.role, "instance": str(self.disagg.instance.index)}
        served = [Counter("toolkit:disagg_served_whole_requests", labels, self.served_count)] if self.router.cost else []
        return super().metrics() + served

    def reset_times(self) -> None:
        """Also the count of requests served whole (a benchmark's warm-up serves some)."""
        super().reset_times()
        self.served_times = RoleTimes()
        self.served_count = 0

    def finish_call(self, engine) -> None:
        """Global rank 0 waits for every decode instance's DONE before the outputs' gather."""
        if self.disagg.rank != 0:
            return
        if not self._call_open:  # a call that fed no request: every decode instance still says DONE
            self._open_call()
        last = time.monotonic()
        while self._done_owed:
            if self._take_done():
                last = time.monotonic()
            elif time.monotonic() - last > dist_timeout().total_seconds():
                names = ", ".join(self.disagg.describe(r) for r in self._done_owed)
                raise RuntimeError(f"{self.disagg.describe(0)}: no word from {names} for "
                                   f"{time.monotonic() - last:.0f} s (the collective timeout): hung or dead")
            else:
                self._idle()
        self._call_open = False


class DecodeRole(_Role):
    def __init__(self, disagg: Disaggregation, block_size: int, kv_caches, num_kv_heads: int, ahead: int = 64,
                 max_local_prefill: int = 0, decode_token_cost: float = 0.0):
        super().__init__(disagg, max_local_prefill, decode_token_cost)
        self.connector = DecodeConnector(block_size)
        self.worker = KVReceiver(kv_caches, disagg, num_kv_heads, self._peers.__getitem__, self._tags.__getitem__,
                                 ahead=ahead)
        self._expected: dict[int, _Expected] = {}  # seq -> request awaiting its prefill
        self._owed: dict[int, int] = {}  # prefill instance -> READY messages still owed to this instance
        # READY for requests not fed here yet (a prefill rank may read its input ahead of this one)
        self._early: dict[int, bool] = {}
        self._served: set[str] = set()
        self._last_word = time.monotonic()
        self._kv_ready: dict[str, float] = {}  # request id -> when READY came
        self._aborted: set[str] = set()  # aborted while their prefill was elsewhere: dropped when it comes

    def add_request(self, engine, request_id, prompt_token_ids, params: SamplingParams, prompt, priority,
                    arrival_time, cache_salt) -> None:
        handoff = self.handoff(prompt_token_ids, params)
        seq, p, d = self.route(len(prompt_token_ids), params.max_tokens or engine.max_model_len, handoff)
        if d is None or d != self.disagg.instance.index:
            return
        self._served.add(request_id)
        # TTFT counts from the request's arrival here, not from when its prefill comes.
        arrival = time.monotonic() if arrival_time is None else arrival_time
        args = (request_id, prompt_token_ids, params, prompt, priority, arrival, cache_salt)
        if not handoff:
            engine.admit(*args)  # computed here alone
            return
        expected = _Expected(seq, p, args)
        if seq in self._early:
            self._arrive(engine, expected, self._early.pop(seq))
            return
        self._expected[seq] = expected
        self._owed[p] = self._owed.get(p, 0) + 1
        self._last_word = time.monotonic()

    def serves(self, request_id: str) -> bool:
        """Whether this instance returns the request's output (it was routed here)."""
        return request_id in self._served

    @property
    def num_awaited(self) -> int:
        """Requests routed here whose prefill has not come yet."""
        return len(self._expected)

    def before_step(self, engine) -> None:
        self._take_arrivals(engine)

    def after_step(self, engine, finished: list) -> list:
        for out in finished:
            self._served.discard(out.request_id)
            self.times.record(out, self._kv_ready.pop(out.request_id, out.metrics.arrival_time))
        if self.disagg.local_rank == 0:
            self.control.heartbeat()
        if not engine.num_held:
            if self._expected:
                self._check_alive()
            self._idle()
        return finished

    def _take_arrivals(self, engine) -> None:
        """READY messages (polled on the instance's first rank, the same list broadcast to its other
        ranks so every scheduler adds the same requests at the same step)."""
        if not self._expected:
            return
        arrivals = None
        if self.disagg.local_rank == 0:
            sources = {self.disagg.instances("prefill")[p].ranks[0]: n for p, n in self._owed.items() if n}
            arrivals = [(src, a, b, c) for src, kind, a, b, c in self.control.receive(sources) if kind == READY]
        if self.disagg.instance.size > 1:
            box = [arrivals]
            dist.broadcast_object_list(box, src=self.disagg.instance.ranks[0], group=self.disagg.instance_group)
            arrivals = box[0]
        prefill = {inst.ranks[0]: inst for inst in self.disagg.instances("prefill")}
        for src, seq, ok, blocks in arrivals:
            if ok:  # its receives are posted now, in READY order: the order its KV was sent
                self.worker.expect(seq, prefill[src], blocks)
            if seq in self._expected:
                expected = self._expected.pop(seq)
                self._owed[expected.prefill] -= 1
                self._arrive(engine, expected, bool(ok))
            else:
                self._early[seq] = bool(ok)

    def abort(self, engine, request_id: str) -> None:
        if any(e.args[0] == request_id for e in self._expected.values()):
            self._aborted.add(request_id)

    def _arrive(self, engine, expected: _Expected, ok: bool) -> None:
        self._last_word = time.monotonic()
        rid, prompt_token_ids, params, *_ = expected.args
        if rid in self._aborted:  # aborted while awaited: its KV, if any was sent, is received and dropped
            self._aborted.discard(rid)
            self._served.discard(rid)
            self.connector.handoff_stats.aborted += 1
            if ok:
                holder = rid if params.n == 1 else f"{rid}#0"
                self._tags[holder] = expected.seq
                self._peers[holder] = self.disagg.instances("prefill")[expected.prefill]
                self.connector.discard(holder, len(prompt_token_ids) - 1)
            return
        engine.admit(*expected.args)
        self._kv_ready[rid] = time.monotonic()
        if not ok:
            log.warning("request %s: its prefill instance failed it; the decode instance computes its prompt", rid)
            return
        holder = rid if params.n == 1 else f"{rid}#0"  # the first sequence loads the KV; others share or compute
        self._tags[holder] = expected.seq
        self._peers[holder] = self.disagg.instances("prefill")[expected.prefill]
        if not engine.holds(holder):  # rejected at once (it cannot fit this cache): the message is still taken
            self.connector.discard(holder, len(prompt_token_ids) - 1)
        else:
            self.connector.arrived(holder, len(prompt_token_ids) - 1)

    def _check_alive(self) -> None:
        waited = time.monotonic() - self._last_word
        if waited > dist_timeout().total_seconds():
            owing = [self.disagg.instances("prefill")[p] for p, n in self._owed.items() if n]
            names = ", ".join(self.disagg.describe(i.ranks[0]) for i in owing)
            raise RuntimeError(f"{self.disagg.describe(self.disagg.rank)}: {len(self._expected)} request(s) still "
                               f"await their prefill from {names}, silent for {waited:.0f} s (the collective "
                               "timeout): hung or dead")

    def has_unfinished(self, engine, busy: bool) -> bool:
        if busy or self._expected:
            return True
        engine.flush_transfers()  # drops of requests that ended before their KV loaded; the tiers' write-through
        return False

    def finish_call(self, engine) -> None:
        if self.disagg.local_rank == 0:
            self.control.send(0, DONE)


def build_role(disagg: Disaggregation, block_size: int, kv_caches, num_kv_heads: int, backlog: int = 64,
               max_local_prefill: int = 0, decode_token_cost: float = 0.0) -> _Role:
    if disagg.role == "prefill":
        return PrefillRole(disagg, block_size, kv_caches, num_kv_heads, backlog, max_local_prefill, decode_token_cost)
    return DecodeRole(disagg, block_size, kv_caches, num_kv_heads, ahead=backlog, max_local_prefill=max_local_prefill,
                      decode_token_cost=decode_token_cost)


def serving_roles(decode_token_cost: float) -> tuple[str, ...]:
    """The roles whose instances return outputs: decode instances, and prefill ones that serve whole requests."""
    return ("prefill", "decode") if decode_token_cost > 0 else ("decode",)


def gather_served(disagg: Disaggregation, obj, roles: tuple[str, ...]) -> list | None:
    """One picklable object from each instance of `roles` (its first rank), in the layout's order
    (prefill instances first), on global rank 0; None on every other rank. A collective of every rank."""
    mine = obj if disagg.role in roles and disagg.local_rank == 0 else None
    parts = [None] * dist.get_world_size() if disagg.rank == 0 else None
    dist.gather_object(mine, parts, dst=0, group=disagg.gather_group)
    if disagg.rank != 0:
        return None
    return [parts[inst.ranks[0]] for inst in disagg.layout.instances if inst.role in roles]
