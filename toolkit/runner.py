"""The model runner: owns the model and its KV cache, turns a scheduled step into tensors, runs it.

Host work per step is a handful of numpy operations over the whole batch (no per-token Python
loops); decode-only steps for the C++ decode step are built in one pass over the requests instead
(`_prepare_decode`: fewer library calls, which is what a batch-1 step's cold caches charge for). Each decoder layer is `torch.compile`d with `fullgraph=True` unless `enforce_eager`:

- Shapes: the compiled graphs are dynamic in the packed token count T, the batch size B and the
  block-table width, and T is padded to at least MIN_BUCKET, so a long run with varied batches
  compiles a handful of graphs (dynamo specializes sizes 0 and 1) instead of one per step.
- When: lazily, on the first step that needs a new graph; each compile is logged with its time.
  Inductor's on-disk caches (FX graph and AOTAutograd caches, under $TOOLKIT_CACHE/inductor, default
  ~/.cache/toolkit/inductor, unless TORCHINDUCTOR_CACHE_DIR is set) make a second start of the same
  model and shapes fast.
- On CPU the two graphs (mixed steps, decode-only steps) are precompiled and saved whole
  (`toolkit/precompiled.py`): a warm start loads them without re-tracing, and calls skip Dynamo's
  guards. Elsewhere, with TOOLKIT_PRECOMPILE=0, or where that fails, layers use `layer.compile`.
- Decode-only steps on CPU run the whole model as one C++ call (`toolkit/decode_step_cpu.py`),
  installed over the model's forward where it takes the model, and called by `execute` directly. Elsewhere they get a
  graph of their own: there the torch backend calls the CPU decode kernel (`attention/decode_cpu.py`,
  built before the first trace) or, off CPU, traces decode attention into the graph
  (`attention/decode_torch.py`) instead of calling the opaque reference op.
- CUDA: decode-only steps replay CUDA graphs captured per batch bucket (`toolkit.cuda_graphs`).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from attention import AttentionMetadata, allocate_kv_cache, available_memory_bytes, decode_cpu, kv_cache_bytes_per_token
from scheduling import ScheduledRequest
from parallel import processes_per_device
from toolkit.config import ModelConfig
from toolkit.cuda_graphs import DecodeGraphs
from toolkit import decode_step_cpu
from toolkit.merged_linear import merge_linears
from toolkit import precompiled
from toolkit.packed_linear import pack_linears, packing_supported
from toolkit.paths import cache_root
from toolkit.weights import load_model

log = logging.getLogger("toolkit")

# Compiled steps pad the packed token count to at least this.
MIN_BUCKET = 2  # not 1: dynamo specializes size 1. (Not 8: a batch-1 decode padded to 8 rows ran 1.6x slower.)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T_padded]
    positions: torch.Tensor  # [T_padded]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S]: the last packed token of each request that samples
    num_tokens: int  # T before padding
    decode_only: bool = False  # every request feeds one token and samples


@dataclass
class KVCacheSpec:
    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        kv_cache_memory_bytes: int | None,
        kv_cache_memory_fraction: float | None,
        enforce_eager: bool,
        attention_backend: str,
        load_format: str = "safetensors",
        compile_backend: str = "inductor",
        cuda_graphs: bool = True,
        prepack_weights: bool = True,
        tp=None,  # parallel.TensorParallel: this rank's shard of the weights and of the kv heads
    ):
        self.config = config
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.attention_backend = attention_backend
        start = time.perf_counter()
        self.model = load_model(config, dtype, device, max_positions=max_model_len, load_format=load_format, tp=tp)
        self.tp = tp
        # Merged q/k/v and gate/up matmuls (toolkit/merged_linear.py); a TP plan shards them apart.
        self.merged_linears = merge_linears(self.model) if tp is None else 0
        self.packed_linears = 0
        if prepack_weights and tp is None and packing_supported(device, dtype):
            self.packed_linears = pack_linears(self.model, batch_hint=min(max_num_seqs, 64))
        self.num_kv_heads = tp.num_kv_heads_local if tp is not None else config.num_kv_heads
        self.load_seconds = time.perf_counter() - start
        self.kv_spec = self._size_kv_cache(
            max_model_len, max_num_seqs, kv_cache_memory_bytes, kv_cache_memory_fraction
        )
        self.kv_caches = allocate_kv_cache(
            config.num_layers, self.kv_spec.num_blocks, block_size, self.num_kv_heads, config.head_dim, dtype, device
        )
        self.enforce_eager = enforce_eager
        self.compile_seconds = 0.0
        self.precompiled = None
        if enforce_eager:
            self.forward = self.model
        else:
            _use_persistent_inductor_cache()
            # Regional compilation: the decoder layer is compiled, not the whole model. The layers share
            # one code object and their weights are graph inputs, so one graph serves all of them: a
            # 12-layer model compiles 1/12 of the code (cold start-up 50+60 s -> 22+12 s for the 125M
            # benchmark model's two graphs here), and nothing but the embedding, the final norm and
            # the lm_head runs outside the graphs.
            # Inductor checks every indirect index (block table, slot) inside its loops; those indices come
            # from our own block pool and prepare() range-checks them once per step on the host instead
            # (decode attention ran ~15% faster without the per-vector checks).
            options = {"assert_indirect_indexing": False} if compile_backend == "inductor" else None
            if torch.device(device).type == "cpu":
                decode_cpu.kernel_available()  # build it now: the graphs read its availability as a constant
            layers = self.model.model.layers
            if precompiled.enabled(device, compile_backend, tp):
                # Graphs traced once and kept on disk, called without Dynamo's guards (toolkit/precompiled.py).
                self.precompiled = precompiled.PrecompiledLayers(type(layers[0]).forward, options)
                self.precompiled.install(layers)
            else:
                for layer in layers:
                    layer.compile(fullgraph=True, dynamic=True, backend=compile_backend, options=options)
            self.forward = self.model
            for cache in self.kv_caches:
                # Its shape never changes: static sizes let Inductor unroll the head and block loops.
                torch._dynamo.mark_static(cache)
        self.decode_step = self._install_decode_step() if self.device.type == "cpu" and tp is None else None
        self._ranges: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # see _row_ranges
        self.decode_graphs = None
        if cuda_graphs and DecodeGraphs.supported(device, attention_backend, enforce_eager):
            max_blocks = math.ceil(max_model_len / block_size)
            self.decode_graphs = DecodeGraphs(self.forward, self.kv_caches, max_num_seqs, max_blocks, device, attention_backend)

    def _install_decode_step(self):
        """Decode-only steps through C++ (toolkit/decode_step_cpu.py) where it takes the model. It wraps
        the model's forward, which is never compiled itself, so whatever runs the layers otherwise
        (eager, precompiled or `layer.compile`d) serves the other steps."""
        if os.environ.get(decode_step_cpu.SWITCH, "1") == "0":
            return None
        reason = decode_step_cpu.unsupported(self.model, self.kv_caches)
        if self.attention_backend != "torch":  # the C++ path is the torch backend's math, on its cache layout
            reason = f"the {self.attention_backend} attention backend was chosen"
        if reason is None and decode_step_cpu._library() is None:
            reason = "the kernel is unavailable"
        if reason is not None:
            log.info("decode steps run the decoder layers one by one, not in C++: %s", reason)
            return None
        # execute() hands the decode-only steps prepare() built (unpadded, unmarked) straight to
        # run_prepared. Strict: should such a step reach the model's forward another way and be
        # refused there, it raises rather than run the layer graphs on sizes they were not built for.
        decode_step = decode_step_cpu.DecodeStep(self.model, self.kv_caches, strict=True)
        decode_step.install(self.model)
        return decode_step

    # --- KV cache sizing -------------------------------------------------------------------

    def _size_kv_cache(self, max_model_len, max_num_seqs, budget_bytes, fraction) -> KVCacheSpec:
        c = self.config
        per_token = kv_cache_bytes_per_token(c.num_layers, self.num_kv_heads, c.head_dim, self.dtype)
        per_block = per_token * self.block_size
        if budget_bytes is None:
            if fraction is None:
                # On a GPU the KV cache is the point of the free memory; on a CPU host memory is shared
                # with everything else, so take less by default.
                fraction = 0.9 if self.device.type == "cuda" else 0.3
            # Every process of a multi-process job on one CPU host draws on the same free memory.
            budget_bytes = int(available_memory_bytes(self.device) * fraction) // processes_per_device(self.device)
        # More blocks than max_num_seqs full-length requests can use would only waste memory.
        useful = max_num_seqs * math.ceil(max_model_len / self.block_size)
        num_blocks = min(budget_bytes // per_block, useful)
        if self.tp is not None:
            num_blocks = self.tp.agree_min(num_blocks)  # one schedule for the TP group: one cache size
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {budget_bytes} bytes holds no block of {self.block_size} tokens "
                f"({per_block} bytes per block); raise kv_cache_memory_bytes"
            )
        return KVCacheSpec(int(num_blocks), self.block_size, per_token)

    # --- one step ---------------------------------------------------------------------------

    def prepare(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        if self.decode_step is not None and scheduled:
            inputs = self._prepare_decode(scheduled)
            if inputs is not None:
                return inputs
        bs = self.block_size
        q_lens = np.fromiter((len(r.token_ids) for r in scheduled), dtype=np.int64, count=len(scheduled))
        starts = np.fromiter((r.start_position for r in scheduled), dtype=np.int64, count=len(scheduled))
        seq_lens = starts + q_lens
        num_tokens = int(q_lens.sum())
        cu = np.zeros(len(scheduled) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        req_of_token = np.repeat(np.arange(len(scheduled)), q_lens)
        positions = np.arange(num_tokens) - cu[req_of_token] + starts[req_of_token]

        blocks_needed = (seq_lens + bs - 1) // bs
        block_tables = np.zeros((len(scheduled), int(blocks_needed.max())), dtype=np.int64)
        for i, r in enumerate(scheduled):
            block_tables[i, : blocks_needed[i]] = r.block_table[: blocks_needed[i]]
        _check_block_ids(block_tables, self.kv_spec.num_blocks)
        slots = block_tables[req_of_token, positions // bs] * bs + positions % bs

        sampled = np.fromiter((r.samples for r in scheduled), dtype=bool, count=len(scheduled))
        logits_indices = cu[1:][sampled] - 1

        input_ids = np.fromiter(itertools.chain.from_iterable(r.token_ids for r in scheduled), np.int64, num_tokens)
        decode_only = num_tokens == len(scheduled) and bool(sampled.all())
        padded = num_tokens if self.enforce_eager else self._bucket(num_tokens)
        pad = padded - num_tokens
        if pad:
            input_ids = np.concatenate([input_ids, np.zeros(pad, np.int64)])
            positions = np.concatenate([positions, np.zeros(pad, np.int64)])
            slots = np.concatenate([slots, np.full(pad, -1, np.int64)])
            if decode_only:
                # One row per token, padding included, so traced decode attention needs no slicing:
                # a padding row attends to slot 0 of block 0 (always allocated) and is never read.
                cu = np.concatenate([cu, cu[-1] + np.arange(1, pad + 1)])
                seq_lens = np.concatenate([seq_lens, np.ones(pad, np.int64)])
                block_tables = np.concatenate([block_tables, np.zeros((pad, block_tables.shape[1]), np.int64)])

        to = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to(dtype=dt, device=self.device)  # noqa: E731
        meta = AttentionMetadata(
            query_start_loc=to(cu, torch.int32),
            seq_lens=to(seq_lens, torch.int32),
            block_tables=to(block_tables, torch.int32),
            slot_mapping=to(slots, torch.int64),
            backend=self.attention_backend,
            decode_only=decode_only,
        )
        logits_indices = to(logits_indices, torch.int64)
        if not self.enforce_eager:
            _mark_sizes_unbacked(meta, logits_indices, rows_are_tokens=decode_only)
        return StepInputs(to(input_ids, torch.int64), to(positions, torch.int64), meta, logits_indices,
                          num_tokens, decode_only)

    def _prepare_decode(self, scheduled: list[ScheduledRequest]) -> StepInputs | None:
        """prepare() for a decode-only step that goes to the C++ decode step (None for any other
        step): the same tensors, unpadded, built in one pass over the requests with four torch calls.
        The general path enters numpy ~40 times a step; after the step's weight stream has evicted
        their code and data from the caches, that took ~0.45 ms of a 12 ms batch-1 step. Block ids
        and slots are checked by the C++ step itself."""
        bs = self.block_size
        ids, positions, slots, lens, tables = [], [], [], [], []
        for r in scheduled:
            if len(r.token_ids) != 1 or not r.samples:
                return None
            p = r.start_position
            table = r.block_table[: p // bs + 1]
            if len(table) <= p // bs:
                raise RuntimeError(f"request {r.request_id}'s block table does not reach position {p}: "
                                   "a scheduler bug, please report")
            ids.append(r.token_ids[0])
            positions.append(p)
            slots.append(table[-1] * bs + p % bs)
            lens.append(p + 1)
            tables.append(table)
        width = max(len(t) for t in tables)
        rows = len(ids)
        ids_t, positions_t, slots_t = torch.tensor([ids, positions, slots], dtype=torch.int64).unbind()
        query_start_loc, logits_indices = self._row_ranges(rows)
        meta = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            slot_mapping=slots_t,
            backend=self.attention_backend,
            decode_only=True,
        )
        return StepInputs(ids_t, positions_t, meta, logits_indices, rows, True)

    def _row_ranges(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """arange(rows + 1) as int32 query starts and arange(rows) as int64 logits indices, made once
        per batch size: a decode step's are the same every step (nothing writes to them)."""
        ranges = self._ranges.get(rows)
        if ranges is None:
            ranges = self._ranges[rows] = (torch.arange(rows + 1, dtype=torch.int32), torch.arange(rows))
        return ranges

    def _bucket(self, n: int) -> int:
        # Sizes are symbolic in the graphs, so any n >= 2 reuses them; rounding up further would only
        # multiply padding rows (a 33-request decode padded to 64 cost as much as 64 requests).
        return max(MIN_BUCKET, n)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Float32 logits [S, V] for the requests that sample this step, in scheduled order."""
        if self.decode_step is not None and inputs.decode_only:
            # Built by _prepare_decode, so not checked again on the way in (~0.1 ms of cold Python a step).
            return self.decode_step.run_prepared(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices)
        if self.decode_graphs is not None and inputs.decode_only and self.decode_graphs.bucket_for(inputs.num_tokens):
            return self.decode_graphs.run(inputs.input_ids[: inputs.num_tokens], inputs.positions[: inputs.num_tokens],
                                          inputs.meta, inputs.logits_indices)
        graphs_before = num_compiled_graphs()
        precompiled_before = self.precompiled.seconds if self.precompiled else 0.0
        start = time.perf_counter()
        logits = self.forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, inputs.logits_indices)
        if self.precompiled and self.precompiled.seconds > precompiled_before:
            self.compile_seconds += self.precompiled.seconds - precompiled_before  # logged where it happened
        elif num_compiled_graphs() > graphs_before:
            seconds = time.perf_counter() - start
            self.compile_seconds += seconds
            log.info("compiled a graph for %d packed tokens in %.1f s (first run included)", inputs.input_ids.shape[0], seconds)
        return logits


def _use_persistent_inductor_cache() -> None:
    """Point Inductor's on-disk caches at $TOOLKIT_CACHE/inductor (default ~/.cache/toolkit/inductor),
    which outlives a reboot, unless the user chose a directory. Importing torch._dynamo (which
    something may have done already) fills the variable with torch's default under /tmp, so a
    value equal to that default counts as unset; Inductor reads the variable on every lookup."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")


def _check_block_ids(block_tables: np.ndarray, num_blocks: int) -> None:
    # The compiled graphs index the cache through these without bounds checks (see __init__).
    if block_tables.size and not (0 <= block_tables.min() and block_tables.max() < num_blocks):
        raise RuntimeError(f"block table holds ids outside [0, {num_blocks}): a scheduler bug, please report")


def _mark_sizes_unbacked(meta: AttentionMetadata, logits_indices: torch.Tensor, rows_are_tokens: bool) -> None:
    """Batch sizes of 0 or 1 and coincidentally equal sizes would each cost a recompile (dynamo
    specializes 0/1 and "duck-sizes" equal dims); unbacked sizes make one graph serve them all.

    In a padded decode-only step the rows are the (padded, >= MIN_BUCKET) tokens: those sizes stay
    backed, so the graph knows block_tables.shape[0] == q.shape[0].
    """
    from torch._dynamo.decorators import mark_unbacked

    per_row = () if rows_are_tokens else (meta.query_start_loc, meta.seq_lens, meta.block_tables)
    for t in (*per_row, meta.slot_mapping, logits_indices):
        mark_unbacked(t, 0)
    mark_unbacked(meta.block_tables, 1)


def num_compiled_graphs() -> int:
    """Graphs dynamo has produced in this process: a new one means a (re)compile happened."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
