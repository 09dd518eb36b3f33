"""Pipeline parallelism's stage split: which layers each stage holds, and the model cut to one stage.

A stage is a run of consecutive decoder layers; the first stage also holds the embedding, the last
the final norm and the lm_head (with tied embeddings the last stage holds the tied tensor as its
lm_head, so both ends have it). The split is applied from outside the model code, on the meta model
before any weight is read (`split_stage`), so loading reads only the stage's own tensors
(`StageSplit.skips`) and its KV cache holds only its layers. The model's forward runs whatever it
holds: a stage without the embedding continues from the hidden states it is given, one without the
lm_head returns every token's hidden state (toolkit/models/llama.py).

The default split balances the stages' work: the last stage also runs the final norm and the lm_head,
counted as `head_layers` decoder layers (its multiply-adds per sampled token over a layer's per token,
halved: only sampled tokens reach it, and a workload with as many prompt as output tokens samples half
of what it feeds), so the last stage takes fewer layers (the 125M Llama shape: 7,5 at pp=2, where
vLLM's even split is 6,6). The other stages split the rest by vLLM's rule (`get_pp_indices`): layers //
n each, the leftovers one each from the second-to-last backwards. `pp_layer_partition="4,4,5,3"`
overrides it.

`PipelineParallel` is one rank's stage and its links (hidden states by point-to-point, the sampled
tokens back by broadcast, per-stage busy and idle time); the pipeline executor drives it
(toolkit/executor/pipeline.py).

Leaf module: torch only; it reads the model's module names, never imports toolkit.
"""

from __future__ import annotations

import pickle
import re
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from toolkit.parallel.distributed import ParallelConfigError

LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.")
# Bytes of a pickled step result sent in its first, fixed-size message (the receives are posted ahead,
# so their size is fixed): a decode plan's tokens fit many times over; prompt logprobs may overflow.
RESULT_HEAD = 1 << 16


def layer_partition(num_layers: int, pp: int, partition: str | None = None, head_layers: float = 0.0) -> list[int]:
    """Layers per stage: `partition` ("4,4,5,3") when given, else the split that balances the stages
    when the last one also runs a head worth `head_layers` layers (see the module's docstring; 0 gives
    vLLM's even split). Raises ParallelConfigError (before any weight is read) for a partition or a
    size that cannot work."""
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ParallelConfigError(f"pipeline_parallel_size must be an integer >= 1, got {pp!r}")
    if pp > num_layers:
        raise ParallelConfigError(f"pipeline_parallel_size {pp} is more than the model's {num_layers} layers: "
                                  "every stage needs at least one layer")
    if partition is None:
        if pp == 1 or head_layers <= 0:
            return _even(num_layers, pp)
        # The last stage's layers: those that keep the costliest stage cheapest (ties: the most, so the
        # other stages' share is spread as evenly as it can be).
        cost = lambda last: max(last + head_layers, -(-(num_layers - last) // (pp - 1)))  # noqa: E731
        last = min(range(num_layers - pp + 1, 0, -1), key=cost)
        return _even(num_layers - last, pp - 1) + [last]
    try:
        sizes = [int(part) for part in str(partition).split(",")]
    except ValueError:
        raise ParallelConfigError(f"pp_layer_partition must be comma-separated layer counts such as '4,4,5,3', "
                                  f"got {partition!r}") from None
    if len(sizes) != pp:
        raise ParallelConfigError(f"pp_layer_partition {partition!r} has {len(sizes)} stages but "
                                  f"pipeline_parallel_size is {pp}")
    if min(sizes) < 1:
        raise ParallelConfigError(f"pp_layer_partition {partition!r}: every stage needs at least one layer")
    if sum(sizes) != num_layers:
        raise ParallelConfigError(f"pp_layer_partition {partition!r} sums to {sum(sizes)} layers but the model has "
                                  f"{num_layers}")
    return sizes


def _even(num_layers: int, stages: int) -> list[int]:
    """vLLM's split: num_layers // stages each, the leftovers one each from the second-to-last back."""
    sizes = [num_layers // stages] * stages
    for i in range(2, num_layers % stages + 2):
        sizes[-i] += 1
    return sizes


def head_layers(config) -> float:
    """The final norm and lm_head's work in decoder layers, for the default split: the lm_head's
    multiply-adds per sampled token over one layer's per token (its attention projections and MLP, or
    its active experts), halved (only sampled tokens reach the head). Attention over the context is
    left out, so on long contexts this is an upper bound."""
    h, hd = config.hidden_size, config.head_dim
    attention = h * hd * (2 * config.num_heads + 2 * config.num_kv_heads)
    moe = getattr(config, "moe", None)
    inner = config.intermediate_size if moe is None else moe.top_k * moe.intermediate_size + \
        moe.shared_expert_intermediate_size
    return 0.5 * config.vocab_size * h / (attention + 3 * h * inner)


@dataclass(frozen=True)
class StageSplit:
    """Stage `index` of `size`: its layers and whether it holds the embedding or the head."""

    index: int
    size: int
    layers: range
    tied_embeddings: bool = False

    @classmethod
    def of(cls, index: int, sizes: list[int], tied_embeddings: bool = False) -> "StageSplit":
        start = sum(sizes[:index])
        return cls(index, len(sizes), range(start, start + sizes[index]), tied_embeddings)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def describe(self) -> str:
        ends = [what for what, held in (("embedding", self.is_first), ("norm + lm_head", self.is_last)) if held]
        return (f"pipeline stage {self.index + 1} of {self.size}: layers {self.layers.start}-{self.layers.stop - 1}"
                + (f" and the {' and '.join(ends)}" if ends else ""))

    def holds_tensor(self, name: str) -> bool:
        """Whether a checkpoint tensor belongs to this stage (the loader skips the rest)."""
        layer = LAYER_TENSOR.match(name)
        if layer is not None:
            return int(layer[1]) in self.layers
        if name.startswith("model.embed_tokens."):
            # A tied checkpoint's embedding is also the last stage's lm_head (weights.load_weights).
            return self.is_first or (self.is_last and self.tied_embeddings)
        if name.startswith(("model.norm.", "lm_head.")):
            return self.is_last
        return True

    def skips(self, name: str) -> bool:
        return not self.holds_tensor(name)


def split_stage(model: nn.Module, stage: StageSplit) -> nn.Module:
    """Cut a (meta) decoder model down to `stage`: other stages' layers removed, the embedding kept
    on the first stage only, the final norm and lm_head on the last only."""
    layers = model.model.layers
    for key in [k for k in layers if int(k) not in stage.layers]:
        del layers[key]
    if not stage.is_first:
        model.model.embed_tokens = None
    if not stage.is_last:
        model.model.norm = None
        model.lm_head = None
    return model


@dataclass
class StageStats:
    """Where one stage's time went: busy (its share of the steps: host work and its layers) or idle
    (waiting for the previous stage's hidden states or for the last stage's tokens), over all step
    plans and over decode-only ones (the steady state), and how many plans were in flight at most."""

    plans: int = 0
    max_in_flight: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0
    compute_s: float = 0.0  # of busy_s: inside the stage's forward (the rest is host work: schedule, inputs, update)
    decode_busy_s: float = 0.0
    decode_idle_s: float = 0.0
    hidden_bytes: int = 0  # sent to the next stage
    long_results: int = 0  # results sent in two messages (longer than RESULT_HEAD), on the result source

    def as_dict(self) -> dict:
        out = dict(vars(self))
        out["idle_fraction"] = _fraction(self.idle_s, self.busy_s)
        out["decode_idle_fraction"] = _fraction(self.decode_idle_s, self.decode_busy_s)
        return out


def _fraction(idle: float, busy: float) -> float:
    return idle / (idle + busy) if idle + busy > 0 else 0.0


@dataclass
class ReplicaGroups:
    """The gloo groups of the replica (or disaggregated instance) this rank's pipeline belongs to."""

    ranks: list[int]  # global ranks, stage-major (a stage's TP ranks consecutive)
    result: object  # each plan's result, broadcast from the last stage (posted ahead)
    # Agreements made while results are in flight need their own group: collectives on one group
    # must come in one order on every rank, and the result broadcasts are posted ahead.
    agree: object
    # A result longer than RESULT_HEAD's room sends its rest here: on the result group the heads are
    # posted ahead, so a rest there would come between two heads on one rank and not the other.
    overflow: object


def replica_groups(replicas: list[list[int]], timeout) -> ReplicaGroups | None:
    """Every replica's groups, built on every rank in the same order (torch.distributed.new_group is
    a collective of the whole world); this rank's, or None when it is in none of `replicas`."""
    mine = None
    for ranks in replicas:
        groups = ReplicaGroups(ranks, *(dist.new_group(ranks, backend="gloo", timeout=timeout) for _ in range(3)))
        if dist.get_rank() in ranks:
            mine = groups
    return mine


class PipelineParallel:
    """This rank's stage and its links, written for inference's varlen steps (torch.distributed.pipelining
    schedules fixed-shape training micro-batches): the previous stage's hidden states arrive by a
    blocking receive, this stage's go on by an asynchronous send (kept alive until it completes), both
    over the mesh's pp group (same TP index, so TP shards meet their own), and each plan's sampled
    tokens go from the last stage's TP rank 0 to every rank of the replica by an asynchronous
    broadcast that the others receive when they retire that plan. Every rank calls these in the
    same plan order, so the collectives match without any further handshake."""

    def __init__(self, mesh, stage: StageSplit, groups: ReplicaGroups, tp_size: int):
        self.stage = stage
        self.group = mesh["pp"].get_group()
        self.replica_group, self.agree_group = groups.result, groups.agree
        self.overflow_group, self.replica_ranks = groups.overflow, groups.ranks
        rank = dist.get_rank()
        self.rank, self.tp_size = rank, tp_size
        self.result_src = self.replica_ranks[(stage.size - 1) * tp_size]  # the last stage's TP rank 0
        self.is_result_src = rank == self.result_src
        self._sends: deque = deque()  # (work, tensor): a tensor must outlive its send
        self._posted: deque = deque()  # on the result source: (works, tensors, result) per plan
        self._expected: deque = deque()  # elsewhere: (work, buffer) of each plan's result head, posted ahead
        self.stats = StageStats()
        self._idle = 0.0
        # Receive-ahead (gloo only; see receive_ahead): the receive posted for the next plan's hidden
        # states, and whether the next stage has one waiting for this stage's (so `drain` must end it).
        self._ahead_rows: int | None = None
        self._ahead = None
        self._owed = None  # a one-row tensor shaped like this stage's last send, when one is owed
        self._cpu = mesh.device_type == "cpu"
        self._turn_end: float | None = None  # when this rank's last engine turn ended (None: idle since)
        self._idle_mark = 0.0

    def receive_ahead(self, max_rows: int) -> None:
        """On CPU (gloo), keep the receive for the next plan's hidden states posted ahead, sized for the
        largest plan (`max_rows` tokens): gloo moves a message only once both ends are posted, and
        when the receive comes after the send it is the sending process's transport thread that
        moves it, which waits for a time slice behind that process's compute while the receiving
        stage idles (measured in docs/benchmarks.md). Posted ahead, the sender writes at once. NCCL needs equal sizes and progresses on the GPU: it receives each plan exactly."""
        if self._cpu and not self.stage.is_first:
            self._ahead_rows = max_rows

    def recv_hidden(self, shape: tuple[int, ...], dtype, device) -> torch.Tensor:
        rows = self._ahead_rows
        what = f"stage {self.stage.index} (rank {self.rank - self.tp_size})'s hidden states"
        if rows is None:
            hidden = torch.empty(shape, dtype=dtype, device=device)
            with self._waiting(what):
                dist.recv(hidden, group=self.group, group_src=self.stage.index - 1)
            return hidden
        if shape[0] > rows:
            raise RuntimeError(f"a plan of {shape[0]} tokens is more than the {rows} the receive was posted for "
                               "(a bug: please report)")
        if self._ahead is None:
            self._ahead = self._post((rows, *shape[1:]), dtype, device)
        work, buffer = self._ahead
        with self._waiting(what):
            work.wait()
        self._ahead = self._post((rows, *shape[1:]), dtype, device)
        return buffer[: shape[0]].clone()  # its own tensor: a compiled step guards on a view's base

    def _post(self, shape, dtype, device):
        buffer = torch.empty(shape, dtype=dtype, device=device)
        return dist.irecv(buffer, group=self.group, group_src=self.stage.index - 1), buffer

    def drain(self) -> None:
        """When no plan is in flight and none is coming (every rank of the replica at once: the engine
        calls it when it has no request left): the receives posted ahead are ended by a one-row
        message from the stage before, so none is left pending for the process group's teardown or
        the next engine; the next plan posts afresh."""
        self._turn_end = None
        if self._owed is not None:
            end, self._owed = self._owed, None
            with self._sending("the end of the run"):
                self._sends.append((dist.isend(end, group=self.group, group_dst=self.stage.index + 1), end))
        if self._ahead is not None:
            work, _ = self._ahead
            self._ahead = None
            with self._waiting(f"stage {self.stage.index} (rank {self.rank - self.tp_size})'s end of the run"):
                work.wait()

    def send_hidden(self, hidden: torch.Tensor) -> None:
        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()
        # A replayed CUDA graph's output is its static buffer, which the next replay overwrites while
        # this send may still be reading it; Inductor's CPU outputs are fresh each step.
        hidden = hidden.clone() if hidden.is_cuda else hidden.contiguous()
        with self._sending("its hidden states"):
            self._sends.append((dist.isend(hidden, group=self.group, group_dst=self.stage.index + 1), hidden))
        self.stats.hidden_bytes += hidden.numel() * hidden.element_size()
        if self._cpu and self._owed is None:  # the next stage posts its receives ahead: it will need an end message
            self._owed = hidden.new_zeros((1, *hidden.shape[1:]))

    def post_result(self, result) -> None:
        """On the result source: start sending one plan's result (any picklable object) to the replica:
        its pickled length and first RESULT_HEAD bytes in one fixed-size message, any rest in a second."""
        data = pickle.dumps(result)
        head = torch.zeros(RESULT_HEAD + 8, dtype=torch.uint8)
        head[:8].view(torch.int64)[0] = len(data)
        first = min(len(data), RESULT_HEAD)
        head[8:8 + first] = torch.frombuffer(bytearray(data[:first]), dtype=torch.uint8)
        tensors = [head]
        works = [dist.broadcast(head, src=self.result_src, group=self.replica_group, async_op=True)]
        if len(data) > first:
            rest = torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8)
            works.append(dist.broadcast(rest, src=self.result_src, group=self.overflow_group, async_op=True))
            tensors.append(rest)
            self.stats.long_results += 1
        self._posted.append((works, tensors, result))

    def expect_result(self) -> None:
        """Elsewhere, when a plan is submitted: post the receive of its result's head now. gloo moves a
        message once both ends are posted; a receive posted only when the result is needed waits for
        the result source's transport thread to get a time slice beside its compute (as the hidden
        states did: `receive_ahead`), which on a busy CPU is milliseconds per plan."""
        if not self.is_result_src:
            head = torch.empty(RESULT_HEAD + 8, dtype=torch.uint8)
            self._expected.append((dist.broadcast(head, src=self.result_src, group=self.replica_group,
                                                  async_op=True), head))

    def take_result(self):
        """The oldest plan's result, on every rank of the replica (waiting for it if need be)."""
        with self._waiting(f"the last stage (rank {self.result_src})'s tokens"):
            if self.is_result_src:
                works, _, result = self._posted.popleft()
                for work in works:
                    work.wait()
                return result
            work, head = self._expected.popleft()
            work.wait()
            size = int(head[:8].view(torch.int64)[0])
            data = head[8:8 + min(size, RESULT_HEAD)].numpy().tobytes()
            if size > RESULT_HEAD:
                rest = torch.empty(size - RESULT_HEAD, dtype=torch.uint8)
                dist.broadcast(rest, src=self.result_src, group=self.overflow_group)
                data += rest.numpy().tobytes()
        return pickle.loads(data)

    def agree_min(self, value: int) -> int:
        """The smallest of the replica's values (KV blocks: every stage schedules the same requests)."""
        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.replica_group)
        return int(t.item())

    def report(self) -> dict:
        """This rank's stage (index, [first, last + 1) layers) and its StageStats so far."""
        return {"stage": self.stage.index, "layers": [self.stage.layers.start, self.stage.layers.stop],
                **self.stats.as_dict()}

    def all_stats(self) -> list[dict]:
        """Every rank of the replica's `report` (a collective over the replica: call on all its ranks)."""
        out = [None] * len(self.replica_ranks)
        dist.all_gather_object(out, self.report(), group=self.replica_group)
        return out

    def end_turn(self, decode: bool, in_flight: int, began: float) -> None:
        """Account the engine turn of this rank that ends now: from the end of the previous turn (or
        `began`, after the engine was idle), its wall time less what it spent waiting is busy.
        `decode`: its plan is decode-only; `in_flight`: plans in flight during it."""
        now = time.perf_counter()
        total = now - (self._turn_end if self._turn_end is not None else began)
        idle = self._idle - self._idle_mark
        s = self.stats
        s.busy_s += total - idle
        s.idle_s += idle
        if decode:
            s.decode_busy_s += total - idle
            s.decode_idle_s += idle
        s.max_in_flight = max(s.max_in_flight, in_flight)
        self._turn_end, self._idle_mark = now, self._idle

    def agree_any(self, flags: list[bool]) -> list[bool]:
        """Per position, whether any rank of the replica set it (a KV load that failed on one stage)."""
        t = torch.tensor([int(f) for f in flags], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.agree_group)
        return [bool(v) for v in t.tolist()]

    @contextmanager
    def _waiting(self, what: str):
        """Time a wait as idle; a peer that died or went silent fails it with both ranks named."""
        start = time.perf_counter()
        try:
            yield
        except (RuntimeError, dist.DistError) as exc:
            raise self._peer_failed(f"stopped waiting for {what}", exc) from exc
        finally:
            self._idle += time.perf_counter() - start

    @contextmanager
    def _sending(self, what: str):
        """A send to the next stage: where that stage died, gloo fails the send itself (its connection
        closed), which can come before any wait notices; named as a wait's failure is."""
        try:
            yield
        except (RuntimeError, dist.DistError) as exc:
            raise self._peer_failed(f"could not send {what} to stage {self.stage.index + 2} "
                                    f"(rank {self.rank + self.tp_size})", exc) from exc

    def _peer_failed(self, doing: str, exc: Exception) -> RuntimeError:
        return RuntimeError(f"pipeline stage {self.stage.index + 1} of {self.stage.size} (rank {self.rank}) "
                            f"{doing}: {exc}")
