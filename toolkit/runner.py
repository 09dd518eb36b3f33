"""The model runner: owns the model and its KV cache, turns a scheduled step into tensors, runs it.

Built from the resolved `EngineConfig` (toolkit/config.py) and the device backend (toolkit/backends):
load the weights (this rank's slices under tensor parallelism), size and allocate the KV cache, then
`transforms.apply` every post-load change in its one order, ending in the step every step kind runs:
the whole model compiled (unless enforce_eager), on CPU with Inductor's C++ wrapper.

Compiled steps are dynamic in every batch size: the token and request counts are marked unbacked,
so one graph serves prefill chunks, decodes and mixed steps alike, unpadded. (Tensor-parallel steps
pad the token count to 2 and keep it backed, for DTensor's sharding rules; the torch attention
backend does too and makes two graphs: its decode-only steps trace their own attention; see
toolkit/inputs.py.) A test bounds the count. Graphs compile on the first step that needs
them, each logged with its time; Inductor's on-disk caches under $TOOLKIT_CACHE/inductor make the
next start of the same model and shapes fast.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from toolkit.attention import allocate_kv_cache, available_memory_bytes, kv_cache_bytes_per_token
from toolkit.parallel import processes_per_device
from toolkit.scheduling import ScheduledRequest
from toolkit import inputs as step_inputs
from toolkit import transforms
from toolkit.config import EngineConfig, ModelConfig
from toolkit.inputs import StepInputs
from toolkit.kv_sizing import KVSizing, check_fits, request_tokens
from toolkit.weights import load_model

log = logging.getLogger("toolkit")


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
    def __init__(self, config: EngineConfig, model_config: ModelConfig, backend, tp=None, num_blocks: int | None = None,
                 ep=None, pp=None):
        """`config` is resolved (EngineConfig.resolve); `tp` is this rank's parallel.TensorParallel;
        `num_blocks` fixes the KV cache's block count (a draft model's: the target's) instead of sizing it;
        `ep` is this rank's parallel.ExpertParallel (MoE models with enable_expert_parallel); `pp` is this
        rank's parallel.pipeline.PipelineParallel: the runner holds its stage's layers and their KV only."""
        self.config = config
        self.model_config = model_config
        self.backend = backend
        self.tp, self.pp = tp, pp
        self.device = torch.device(config.device)
        start = time.perf_counter()
        stage = pp.stage if pp is not None else None
        self.num_kv_heads = tp.num_kv_heads_local if tp is not None else model_config.num_kv_heads
        self.num_layers = len(stage.layers) if stage is not None else model_config.num_layers
        self.sizing = self._kv_sizing()
        if num_blocks is None:
            self._check_host_fits()  # before loading: a run that cannot fit says so instead of being killed
        self.model = load_model(model_config, config.dtype, self.device, max_positions=config.max_model_len,
                                load_format=config.load_format, tp=tp, ep=ep, stage=stage)
        self.attention_backend = backend.attention_backend()  # after loading: the CPU kernels build meanwhile
        self.kv_spec = self._size_kv_cache() if num_blocks is None else KVCacheSpec(
            num_blocks, config.block_size,
            kv_cache_bytes_per_token(self.num_layers, self.num_kv_heads, model_config.head_dim, config.dtype))
        self.kv_caches = allocate_kv_cache(self.num_layers, self.kv_spec.num_blocks, config.block_size,
                                           self.num_kv_heads, model_config.head_dim, config.dtype, self.device,
                                           empty=backend.empty_kv)
        if not config.enforce_eager:
            for cache in self.kv_caches:
                # Static block, head and head_dim sizes let Inductor unroll those loops; the block count
                # stays dynamic, so one compiled graph (and Inductor's cache of it) serves any KV budget.
                for dim in (0, 2, 3, 4):
                    torch._dynamo.mark_static(cache, dim)
        self.step, self.applied = transforms.apply(self.model, self.kv_caches, config, backend, tp, ep=ep)
        self.load_seconds = time.perf_counter() - start  # loading, the KV cache and every model change
        # The torch backend's traced decode attention reads a decode-only step's rows as its tokens, and it
        # and DTensor's sharding rules need a backed token count (toolkit/inputs.py).
        compiled = not config.enforce_eager
        self._rows_are_tokens = compiled and self.attention_backend == "torch"
        self._tokens_backed = compiled and (self._rows_are_tokens or tp is not None)
        self.compile_seconds = 0.0
        self.graphs = 0  # compiled by this runner's step
        self.num_forwards = 0  # model calls (steps run, dummy ones included)

    # --- KV cache sizing -------------------------------------------------------------------

    def _kv_sizing(self) -> KVSizing:
        c, mc = self.config, self.model_config
        spec = c.speculative_config
        lookahead = getattr(spec, "num_speculative_tokens", 0) if spec is not None else 0
        return KVSizing(kv_cache_bytes_per_token(self.num_layers, self.num_kv_heads, mc.head_dim, c.dtype),
                        c.block_size, c.max_num_seqs, request_tokens(c.max_model_len, c.max_request_tokens, lookahead),
                        processes_per_device(self.device))

    def _check_host_fits(self) -> None:
        """This process's weights and its smallest useful KV cache, times the processes on this host,
        against the host's available memory (CPU only: a GPU's budget is its own)."""
        if self.device.type != "cpu":
            return
        c, sizing = self.config, self.sizing
        # A lower bound (never a refusal of a run that fits): weights split evenly over the TP ranks and
        # stages (and experts over every rank), neither replicated norms nor a second weight layout counted.
        shards = c.tensor_parallel_size * c.pipeline_parallel_size
        shards *= c.data_parallel_size if c.enable_expert_parallel else 1
        weights = self.model_config.num_parameters * c.dtype.itemsize // shards
        kv = sizing.min_bytes if c.kv_cache_memory_bytes is None else min(
            c.kv_cache_memory_bytes, sizing.useful_blocks * sizing.block_bytes)
        check_fits(weights, kv, sizing.processes, available_memory_bytes(self.device), sizing.request_tokens)

    def _size_kv_cache(self) -> KVCacheSpec:
        c, sizing = self.config, self.sizing
        budget_bytes, fraction = c.kv_cache_memory_bytes, c.kv_cache_memory_fraction
        if c.gpu_memory_utilization is not None and self.device.type == "cuda":
            budget_bytes = utilization_budget(*torch.cuda.mem_get_info(self.device), c.gpu_memory_utilization)
        elif c.gpu_memory_utilization is not None:
            log.warning("gpu_memory_utilization=%s does not apply on %s: the KV cache takes kv_cache_memory_fraction "
                        "(default 0.3) of the host's available memory", c.gpu_memory_utilization, self.device.type)
        if budget_bytes is None:
            if fraction is None:
                # On a GPU the KV cache is the point of the free memory; on a CPU host memory is shared
                # with everything else, so take less by default.
                fraction = 0.9 if self.device.type == "cuda" else 0.3
            # Every process of a multi-process job on one CPU host draws on the same free memory.
            budget_bytes = sizing.budget(available_memory_bytes(self.device), fraction)
        num_blocks = sizing.num_blocks(budget_bytes)  # never more than the run can use
        if self.pp is not None:
            num_blocks = self.pp.agree_min(num_blocks)  # one schedule for the replica's stages and TP ranks
        elif self.tp is not None:
            num_blocks = self.tp.agree_min(num_blocks)  # one schedule for the TP group: one cache size
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {budget_bytes} bytes holds no block of {c.block_size} tokens "
                f"({sizing.block_bytes} bytes per block); raise kv_cache_memory_bytes"
            )
        return KVCacheSpec(int(num_blocks), c.block_size, sizing.bytes_per_token)

    # --- one step ---------------------------------------------------------------------------

    def prepare(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        inputs = step_inputs.build(scheduled, block_size=self.config.block_size, num_blocks=self.kv_spec.num_blocks,
                                   backend=self.attention_backend, device=self.device,
                                   pad_tokens=self._tokens_backed, rows_are_tokens=self._rows_are_tokens)
        if not self.config.enforce_eager:
            step_inputs.mark_dynamic_sizes(inputs, self._tokens_backed, self._rows_are_tokens)
        return inputs

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits [S + P, V]: the requests that sample this step, in scheduled order, then the
        prompt positions that want logits (StepInputs.num_prompt_rows). A pipeline stage after the first
        continues from the previous stage's `hidden` [T_padded, H]; one before the last returns its own."""
        self.num_forwards += 1
        if self.config.enforce_eager:
            return self.step(inputs, hidden)
        if hidden is not None:
            step_inputs.mark_dynamic_hidden(hidden, self._tokens_backed or self._rows_are_tokens)
        before = num_compiled_graphs()
        start = time.perf_counter()
        logits = self.step(inputs, hidden)
        if num_compiled_graphs() > before:
            seconds = time.perf_counter() - start
            self.compile_seconds += seconds
            self.graphs += num_compiled_graphs() - before
            log.info("compiled the step for %d packed tokens in %.1f s (first run included)",
                     inputs.input_ids.shape[0], seconds)
        return logits

    def execute_dummy(self) -> None:
        """A one-token forward that reads and writes nothing of any request: what a data-parallel replica
        with nothing scheduled runs under expert parallelism, so that it still enters every MoE layer's
        all-to-all with the other replicas (executor/spmd.py)."""
        self.execute(self.prepare_dummy())

    def prepare_dummy(self) -> StepInputs:
        """The dummy batch's inputs: one token whose KV slot is -1 (never written)."""
        from toolkit.scheduling import ScheduledRequest

        dummy = ScheduledRequest(request_id="<dummy>", token_ids=[0], start_position=0, block_table=[0], samples=True)
        inputs = self.prepare([dummy])
        inputs.meta.slot_mapping.fill_(-1)
        return inputs

    def stats(self) -> dict:
        """What the runner built and spent, for Engine.stats()."""
        return {"load_s": self.load_seconds, "compile_s": self.compile_seconds, "graphs": self.graphs,
                "kv_cache": {"blocks": self.kv_spec.num_blocks, "block_size": self.kv_spec.block_size,
                             "bytes": self.kv_spec.bytes},
                "attention_backend": self.attention_backend, "model_changes": list(self.applied),
                "backend": self.backend.stats()}


def num_compiled_graphs() -> int:
    """Graphs dynamo has produced in this process, and compiled steps loaded from disk
    (toolkit/compiled_cache.py): a new one means a (re)compile, or a load in its place, happened."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"] + counters["toolkit"]["loaded_steps"]


def utilization_budget(free: int, total: int, utilization: float) -> int:
    """vLLM's gpu_memory_utilization: the KV cache's bytes when the GPU may be `utilization` full and
    total - free bytes are in use already (the weights, other processes). vLLM also sets aside its
    profiled activation peak; here the activations live in the 1 - utilization left over."""
    budget = int(utilization * total) - (total - free)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization} allows {utilization * total / 2**30:.2f} GiB of the "
                         f"GPU's {total / 2**30:.2f} GiB, but {(total - free) / 2**30:.2f} GiB are in use already "
                         "(the weights, other processes): raise it")
    return budget
