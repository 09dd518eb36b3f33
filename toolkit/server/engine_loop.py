"""The engine core in its own thread, fed by the HTTP front end and streaming outputs back as they grow.

Every rank of the job runs the same loop: take the requests and aborts that arrived, apply them to
the engine, step it. Only global rank 0 has an HTTP front end; it broadcasts what arrived to the
other ranks before each step (`RankSync.share`, the one place ranks agree on the input), so every
rank of a tensor- or pipeline-parallel engine adds, aborts and steps in the same order, as the
engine requires. When nothing runs, rank 0 still sends an empty batch every `HEARTBEAT_S`, so the
other ranks' wait in the broadcast never reaches the collective timeout of an idle server.

With data parallelism rank 0 also routes each new request to one replica (`ReplicaRouter`: the one
with the fewest tokens still to compute), and only that replica adds it. In a disaggregated job every
rank adds every request and the roles route it to its prefill and decode instances, as offline.

After each step each speaking rank (a replica's first rank, or a decode instance's: the engine's front
end, toolkit/front_end.py) cuts each of its live requests' new tokens, text and logprobs from the
output processor (`OutputProcessor.partial`) as `Update`s; with several speakers those are gathered
to rank 0 (one gather per step). Rank 0 hands each to its request's `Stream`, an asyncio queue read by
the HTTP handler on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from toolkit.outputs import CompletionOutput, Logprob, RequestOutput
from toolkit.parallel import request_cost
from toolkit.sampling_params import SamplingParams

log = logging.getLogger("toolkit")

HEARTBEAT_S = 1.0  # an idle rank 0 still broadcasts (empty) this often


class Overloaded(Exception):
    """More sequences wait than --max-waiting allows (the HTTP side answers 503)."""


@dataclass
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    replica: int = 0  # the data-parallel replica that serves it (rank 0 routes)


@dataclass
class StepInput:
    """What rank 0 hands every rank before a step: requests to add and abort, or the order to stop."""

    adds: list[NewRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    stop: bool = False


@dataclass
class SequenceDelta:
    """What one of a request's n sequences gained in a step."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Update:
    """One step's news for a request: its sequences' deltas; `final` (the whole RequestOutput) once
    done; `error` when the engine refused or failed it with nothing generated."""

    deltas: list[SequenceDelta]
    final: RequestOutput | None = None
    error: str | None = None
    status: int = 400  # of the error: the request's fault (400), or the engine's (500)


@dataclass
class ReplicaNews:
    """What a replica's first rank tells rank 0 after each step."""

    updates: dict[str, Update]
    busy: bool  # it still has requests
    waiting: int  # sequences its scheduler has waiting
    kv_blocks: tuple[int, int]  # its KV cache's blocks: (all, free)


class Stream:
    """One engine request's updates, put by the engine thread on an asyncio queue read on the event
    loop, tagged (a request with several prompts reads all of theirs from one queue)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, updates: asyncio.Queue, tag=None):
        self.loop, self.updates, self.tag = loop, updates, tag

    def put(self, update: Update) -> None:
        self.loop.call_soon_threadsafe(self.updates.put_nowait, (self.tag, update))


class _Sent:
    """What has been handed out of one request's sequences: tokens and characters of text (kept on the
    first rank of the replica that runs it)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.tokens = [0] * params.n
        self.text = [0] * params.n
        self.done = [False] * params.n


class ReplicaRouter:
    """Rank 0's choice of data-parallel replica for each new request: the one with the fewest tokens
    still to compute (a request counts its `request_cost` until it ends, as the offline split
    weighs it), ties to the lowest index."""

    def __init__(self, replicas: int, max_model_len: int):
        self.load = [0] * replicas
        self.routed = [0] * replicas  # requests sent to each, since start
        self.max_model_len = max_model_len
        self._held: dict[str, tuple[int, int]] = {}  # request id -> (replica, cost)

    def route(self, request: NewRequest) -> int:
        cost = request_cost(len(request.prompt_token_ids), request.params.max_tokens, request.params.n,
                            self.max_model_len)
        replica = min(range(len(self.load)), key=self.load.__getitem__)
        self.load[replica] += cost
        self.routed[replica] += 1
        self._held[request.request_id] = (replica, cost)
        return replica

    def ended(self, request_id: str) -> None:
        replica, cost = self._held.pop(request_id, (0, 0))
        self.load[replica] -= cost


class RankSync:
    """The ranks' agreement on each step's input: rank 0's StepInput broadcast to the job's other
    ranks on a gloo group of their own (built once, by every rank, after the engine's groups)."""

    def __init__(self):
        import torch.distributed as dist

        from toolkit.parallel.distributed import dist_timeout

        self.dist = dist
        self.rank = dist.get_rank()
        self.group = dist.new_group(backend="gloo", timeout=dist_timeout())

    def share(self, batch: StepInput | None) -> StepInput:
        box = [batch]
        self.dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


class EngineLoop:
    def __init__(self, engine, max_waiting: int, sync: RankSync | None = None, on_finished=None, on_failure=None):
        self.engine, self.max_waiting, self.sync = engine, max_waiting, sync
        self.on_finished = on_finished  # called with each finished RequestOutput (the server's metrics)
        self.on_failure = on_failure  # called once if the loop dies (the server then shuts down)
        self.serving = sync is None or sync.rank == 0  # this rank takes requests (HTTP)
        state = engine.parallel
        self.replica = state.dp_rank if state is not None else 0
        self.dp = state.dp_size if state is not None else 1
        # A rank whose requests' news rank 0 gathers: a replica's first rank, or a decode instance's
        # (toolkit/front_end.py).
        self.reporting = engine.front.speaks
        self.router = ReplicaRouter(self.dp, engine.max_model_len) if self.serving and self.dp > 1 else None
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, Stream] = {}  # engine thread only
        self._sent: dict[str, _Sent] = {}  # engine thread, reporting ranks: this replica's requests
        self._lock = threading.Lock()
        self._pending_sequences = 0  # submitted, not yet in the engine (under _lock)
        self.num_waiting = 0  # every replica's waiting sequences after the last step (read by submit)
        self.kv_blocks: list[tuple[int, int]] = []  # each replica's (all, free) KV blocks after the last step
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # what ended the loop, if not a stop

    # --- the HTTP side (any thread) ---------------------------------------------------------------

    def submit(self, request: NewRequest, stream: Stream) -> None:
        """Queue a checked request; raises Overloaded when too many sequences already wait."""
        with self._lock:
            waiting = self.num_waiting + self._pending_sequences
            if waiting + request.params.n > self.max_waiting:
                raise Overloaded(f"{waiting} sequences are waiting and --max-waiting is {self.max_waiting}; "
                                 "retry later")
            self._pending_sequences += request.params.n
        self._inbox.put(("add", request, stream))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def call(self, fn) -> Future:
        """Run fn(engine) on the engine thread between steps (the engine is not thread-safe)."""
        future: Future = Future()
        self._inbox.put(("call", fn, future))
        return future

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Abort what is still running, tell the other ranks to stop, and wait for the thread."""
        self._inbox.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)

    # --- the loop (every rank) --------------------------------------------------------------------

    def run(self) -> None:
        busy = False
        try:
            while True:
                batch = self._collect(wait=not busy) if self.serving else None
                if self.sync is not None:
                    batch = self.sync.share(batch)
                refused, finished = self._apply(batch)
                mine = False
                if not batch.stop:
                    # Asked once per step on every rank (a collective under some layouts: Engine.has_unfinished).
                    mine = self.engine.has_unfinished()
                    if mine:
                        finished += self.engine.step()
                busy = self._deliver({**self._updates(finished), **refused}, mine)
                if batch.stop:
                    return
        except BaseException as e:  # noqa: BLE001  its clients get a 500 and the server stops, instead of hanging
            self.failure = e
            log.exception("the engine loop failed")
            for stream in self._streams.values():
                stream.put(Update([], error=f"the engine failed: {type(e).__name__}: {e}", status=500))
            self._streams.clear()
            if not self.serving:
                raise
            if self.on_failure is not None:
                self.on_failure()

    def _collect(self, wait: bool) -> StepInput:
        """Rank 0: everything that arrived since the last step; when the engine was idle, wait for
        something first (at most a heartbeat)."""
        batch = StepInput()
        try:
            item = self._inbox.get(timeout=HEARTBEAT_S) if wait else self._inbox.get_nowait()
            while True:
                self._take(item, batch)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        return batch

    def _take(self, item: tuple, batch: StepInput) -> None:
        kind = item[0]
        if kind == "add":
            _, request, stream = item
            self._streams[request.request_id] = stream
            if self.router is not None:
                request.replica = self.router.route(request)
            batch.adds.append(request)
        elif kind == "abort":
            batch.aborts.append(item[1])
        elif kind == "call":
            _, fn, future = item
            try:
                future.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001  the caller gets it
                future.set_exception(e)
        else:  # stop: what still runs is aborted with it
            batch.stop = True
            batch.aborts.extend(self._streams)

    def _apply(self, batch: StepInput) -> tuple[dict[str, Update], list[RequestOutput]]:
        """This replica's adds and the aborts of requests it holds; the adds it refused (their errors)
        and the aborted requests' final outputs."""
        refused = {}
        for request in batch.adds:
            if request.replica != self.replica:
                continue
            try:
                self.engine.add_request(request.request_id, request.prompt_token_ids, request.params,
                                        prompt=request.prompt)
                if self.reporting and self.engine.serves(request.request_id):  # (a decode instance: routed here)
                    self._sent[request.request_id] = _Sent(request.params)
            except ValueError as e:  # every rank of the replica refuses it alike; the HTTP side checked most
                refused[request.request_id] = Update([], error=str(e))
        if self.serving:
            with self._lock:
                self._pending_sequences -= sum(request.params.n for request in batch.adds)
        aborted = []
        for request_id in batch.aborts:
            if request_id in self.engine.outputs.groups:
                aborted.append(self._abort(request_id))
            else:  # not in this engine (yet): a disaggregated role's to drop when its prefill is done
                self.engine.abort_request(request_id)
                self._sent.pop(request_id, None)
        return refused, [out for out in aborted if out is not None]

    def _abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request in the engine (its blocks are freed now); its final output, as it stood."""
        group = self.engine.outputs.groups[request_id]
        self.engine.abort_request(request_id)
        if request_id in self.engine.outputs.groups:  # not every sequence ended (cannot happen today)
            return None
        return RequestOutput(request_id=request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
                             outputs=[group.done[i] for i in sorted(group.done)], finished=True,
                             metrics=group.metrics, error=group.error, num_cached_tokens=group.num_cached_tokens)

    def _updates(self, finished: list[RequestOutput]) -> dict[str, Update]:
        """This replica's news from the step (on its first rank): each live request's growth, and the
        end of the finished."""
        if not self.reporting:
            return {}
        ended = {out.request_id: out for out in finished}
        updates = {}
        for request_id, sent in list(self._sent.items()):
            final = ended.get(request_id)
            if final is None and request_id not in self.engine.outputs.groups:
                continue
            sequences = final.outputs if final is not None else self.engine.outputs.partial(request_id)
            deltas = [d for d in (_delta(sent, seq) for seq in sequences) if d is not None]
            if final is not None:
                del self._sent[request_id]
                generated = any(seq.token_ids for seq in final.outputs)
                updates[request_id] = Update(deltas, final=final, error=final.error if not generated else None)
            elif deltas:
                updates[request_id] = Update(deltas)
        return updates

    def _deliver(self, updates: dict[str, Update], busy: bool) -> bool:
        """Every replica's news into rank 0's streams (gathered there under data parallelism); on rank
        0, whether any replica is still busy."""
        news = None
        if self.reporting:
            kv = self.engine.scheduler.kv_cache
            news = ReplicaNews(updates, busy, self.engine.scheduler.num_waiting, (kv.num_blocks, kv.num_free_blocks))
        parts = self.engine.front.gather(news)
        if not self.serving:
            return busy
        for part in parts:
            for request_id, update in part.updates.items():
                self._hand_out(request_id, update)
        self.num_waiting = sum(part.waiting for part in parts)
        self.kv_blocks = [part.kv_blocks for part in parts]
        return busy or any(part.busy for part in parts)  # rank 0 itself may be a prefill rank

    def _hand_out(self, request_id: str, update: Update) -> None:
        """Rank 0: one request's update to its stream; an ended request leaves the loop."""
        stream = self._streams.get(request_id)
        if update.final is not None or update.error is not None:
            self._streams.pop(request_id, None)
            if self.router is not None:
                self.router.ended(request_id)
            if update.final is not None and self.on_finished is not None:
                self.on_finished(update.final)
        if stream is not None:
            stream.put(update)


def _delta(sent: _Sent, seq: CompletionOutput) -> SequenceDelta | None:
    """What `seq` gained since it was last handed out. Text that could still turn out to be the
    start of a stop string is held back until the sequence ends (the stop string is then cut off)."""
    i = seq.index
    if sent.done[i]:
        return None
    finished = seq.finish_reason is not None
    hold = 0 if finished or not sent.params.stop else max(map(len, sent.params.stop)) - 1
    text_end = max(sent.text[i], len(seq.text) - hold)
    tokens = list(seq.token_ids[sent.tokens[i]:])
    text = seq.text[sent.text[i]:text_end]
    if not tokens and not text and not finished:
        return None
    logprobs = None if seq.logprobs is None else list(seq.logprobs[sent.tokens[i]:])
    sent.tokens[i] += len(tokens)
    sent.text[i] = text_end
    sent.done[i] = finished
    return SequenceDelta(i, tokens, text, logprobs, seq.finish_reason, seq.stop_reason)
