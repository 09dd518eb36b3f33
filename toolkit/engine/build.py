"""Everything an engine core is made of, built once from the config: the process layout, this rank's
worker (model runner, sampler, speculator, KV mover), the scheduler and its connector, the executor,
the output processor, and the hooks of a disaggregated role. The core (core.py) only runs phases."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import torch

from toolkit import backends
from toolkit.config import EngineConfig, UnsupportedModelError, check_device, check_sliding_window, load_model_config
from toolkit.engine.output_processor import OutputProcessor
from toolkit.executor import build_executor
from toolkit.front_end import build_front
from toolkit.kv_hierarchy import build_kv_hierarchy, combine_kv_movers
from toolkit.parallel import ParallelDims, build_parallel
from toolkit.runner import ModelRunner
from toolkit.sampler import Sampler
from toolkit.scheduling import Scheduler, SchedulerConfig
from toolkit.tokenizer import TOKENIZER_FILES, eos_token_ids, load_tokenizer
from toolkit.worker import Worker

log = logging.getLogger("toolkit")


class NoHooks:
    """What an engine that is no disaggregated role does around its steps: nothing."""

    disagg = None

    def add_request(self, engine, *args) -> None:
        engine.admit(*args)

    def abort(self, engine, request_id: str) -> None:
        pass  # the engine's own abort ends what it holds

    def before_step(self, engine) -> None:
        pass

    def after_step(self, engine, finished: list) -> list:
        return finished

    def has_unfinished(self, engine, busy: bool) -> bool:
        return busy

    def serves(self, request_id: str) -> bool:
        return True

    num_awaited = 0


def build_engine(config: EngineConfig) -> SimpleNamespace:
    check_device(config)
    mc = _load_model_config(config)
    parallel, disagg, config = _join(config, mc)
    tp = parallel.tp if parallel is not None else None
    pp = parallel.pp if parallel is not None else None
    ep = parallel.ep if parallel is not None else None
    if ep is not None and config.cuda_graphs:
        # The all-to-all's sizes depend on the routing, read on the host: no graph can replay it.
        config = dataclasses.replace(config, cuda_graphs=False)
    device = parallel.device if parallel is not None else torch.device(
        config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = backends.runnable(config.resolve(mc, device))
    check_sliding_window(mc, config.max_model_len)
    backend = backends.for_device(config, mc)  # the device's kernels (built at once on CPU), attention, model changes
    tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or config.model)
    if tokenizer is None and config.tokenizer is not None and not config.skip_tokenizer_init:
        raise FileNotFoundError(f"tokenizer={config.tokenizer!r} has none of {', '.join(TOKENIZER_FILES)}")
    runner = ModelRunner(config, mc, backend, tp, ep=ep, pp=pp)
    kv = runner.kv_spec
    sampler = Sampler(config.seed)
    holds_logits = pp.is_result_src if pp is not None else (tp is None or tp.rank == 0)
    speculator = None
    if config.speculative_config is not None:
        from toolkit.speculative.speculator import Speculator  # here: speculative/ imports the toolkit's sampler

        speculator = Speculator(config.speculative_config, config, mc, sampler, kv.num_blocks, holds_logits)
    # CPU and disk tiers below the device cache (None when none is configured or none could be had).
    group = pp.agree_group if pp is not None else (tp.group if tp is not None else None)
    kv_tiers = build_kv_hierarchy(config, mc, runner.kv_caches, kv.bytes_per_token * kv.block_size, tp,
                                  pp.stage if pp is not None else None, group)
    hooks, kv_mover = NoHooks(), kv_tiers  # the mover carries out each plan's block copies
    if disagg is not None:  # this instance's role, and its KV connector beside the tiers (toolkit/disaggregated.py)
        from toolkit.disaggregated import build_role

        hooks = build_role(disagg, config.block_size, runner.kv_caches, mc.num_kv_heads, config.prefill_backlog,
                           config.max_local_prefill_tokens, config.decode_token_cost)
        kv_mover = combine_kv_movers(kv_tiers, hooks)
    scheduler = Scheduler(_scheduler_config(config, kv, speculator, kv_tiers), kv_mover.connector if kv_mover else None)
    worker = Worker(runner, sampler, scheduler, kv_mover or None, speculator, holds_logits)
    return SimpleNamespace(
        config=config, model_config=mc, parallel=parallel, backend=backend, tokenizer=tokenizer, scheduler=scheduler, worker=worker, kv_tiers=kv_tiers,
        executor=build_executor(worker, parallel, config), hooks=hooks, speculator=speculator,
        front=build_front(parallel, hooks),
        outputs=OutputProcessor(scheduler, tokenizer, eos_token_ids(mc, tokenizer), config.max_model_len))


def _join(config: EngineConfig, mc):
    """Join the process group when tp * dp * pp > 1 (or as one instance of a disaggregated job); the
    sizes are checked against the world, the heads and the layers first."""
    if config.disaggregated:
        from toolkit.parallel.disaggregated import DisaggLayout, setup_disaggregated

        layout = DisaggLayout(config.prefill_instances, config.decode_instances, config.tensor_parallel_size,
                              config.prefill_tensor_parallel_size, config.pipeline_parallel_size,
                              config.prefill_pipeline_parallel_size, config.data_parallel_size)
        parallel, disagg = setup_disaggregated(layout, config.device, mc, config.enable_expert_parallel,
                                               config.pp_layer_partition)
        # This rank's instance is an ordinary engine of its own shape from here on.
        config = dataclasses.replace(config, tensor_parallel_size=disagg.instance.tp,
                                     pipeline_parallel_size=disagg.instance.pp, data_parallel_size=disagg.instance.dp)
        if disagg.role == "prefill" and not config.decode_token_cost:
            # Its one thrown-away token needs no drafts: speculation is the decode side's (and, where it
            # serves requests whole, its own for those).
            config = dataclasses.replace(config, speculative_config=None)
        return parallel, disagg, config
    dims = ParallelDims(dp=config.data_parallel_size, pp=config.pipeline_parallel_size,
                        tp=config.tensor_parallel_size, expert_parallel=config.enable_expert_parallel,
                        pp_layer_partition=config.pp_layer_partition)
    parallel = build_parallel(dims, config.device, mc)
    return parallel, None, config


def _scheduler_config(config, kv, speculator, kv_tiers) -> SchedulerConfig:
    preemption = config.preemption_mode
    if preemption == "swap" and (kv_tiers is None or not kv_tiers.connector.cpu_blocks):
        log.warning("preemption_mode='swap' has no CPU tier to swap to; preempting by recompute")
        preemption = "recompute"
    return SchedulerConfig(
        num_blocks=kv.num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
        policy=config.scheduling_policy,
        num_lookahead_tokens=speculator.num_lookahead_tokens if speculator else 0,
        enable_prefix_caching=config.enable_prefix_caching, preemption_mode=preemption,
        max_plans_in_flight=config.pipeline_parallel_size)


def _load_model_config(config: EngineConfig):
    try:
        return load_model_config(config.model)
    except UnsupportedModelError as e:
        if not config.trust_remote_code:
            raise
        raise UnsupportedModelError(f"{e}; trust_remote_code=True cannot help: the toolkit never runs a "
                                    "checkpoint's own code, only the architectures it implements") from None
