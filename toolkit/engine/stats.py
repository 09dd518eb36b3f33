"""What an engine reports: `Engine.stats()` (what it built and chose, where it stands) and
`Engine.get_metrics()` (vLLM's metric reader objects, named toolkit:*), gathered from its parts."""

from __future__ import annotations

from toolkit.metrics import Counter, Gauge


def engine_stats(engine) -> dict:
    """The runner's load and compile times, KV cache and backend choices, the scheduler's queues, and
    each part's own report (tiers, expert and pipeline parallelism, a disaggregated role, drafts)."""
    scheduler = engine.scheduler
    stats = {**engine.runner.stats(), "running": scheduler.num_running, "waiting": scheduler.num_waiting,
             "free_blocks": scheduler.num_free_blocks, "preemptions": scheduler.num_preemptions}
    stats["prefix_cache"] = vars(scheduler.prefix_cache_stats).copy()
    if engine.kv_tiers is not None:
        stats["kv_tiers"] = engine.kv_tiers.stats()
    ep = engine.parallel.ep if engine.parallel is not None else None
    if ep is not None:
        stats["expert_parallel"] = _ep_stats(engine, ep)
    stats.update(engine.executor.stats())
    if engine.disagg is not None:
        stats["disaggregated"] = engine.disagg.stats()
    speculator = engine.speculator
    if speculator is not None:
        stats["spec_decode"] = speculator.stats.as_dict()
        draft = stats["draft_runner"] = speculator.runner_stats()
        if draft is not None:  # compile_s: every graph this engine compiled, the draft's included
            stats["compile_s"] += draft["compile_s"] + draft["greedy_loop_compile_s"]
    return stats


def _ep_stats(engine, ep) -> dict:
    """This rank's experts and its all-to-all traffic and time since start (parallel.EPStats), and,
    with replicas in lockstep, the steps they agreed on and the dummy forwards this replica ran."""
    stats = {"experts": [ep.experts.start, ep.experts.stop], "ranks": ep.size, **ep.stats.as_dict()}
    lockstep = engine.parallel.lockstep
    if lockstep is not None:
        stats.update(lockstep_steps=lockstep.steps, dummy_steps=lockstep.dummy_steps)
    return stats


def engine_metrics(engine) -> list:
    scheduler = engine.scheduler
    prefix = scheduler.prefix_cache_stats
    metrics = [Gauge("toolkit:num_requests_running", value=scheduler.num_running),
               Gauge("toolkit:num_requests_waiting", value=scheduler.num_waiting),
               Counter("toolkit:prefix_cache_queries", value=prefix.queries),
               Counter("toolkit:prefix_cache_hits", value=prefix.hits),
               Counter("toolkit:prefix_cache_hits_tier", {"tier": "device"}, prefix.device_hits),
               Gauge("toolkit:compiled_graphs", value=engine.runner.graphs)]  # one per step kind once warm
    mover = engine.worker.kv_mover
    if mover is not None:
        metrics += mover.metrics()
    if engine.speculator is not None:
        metrics += engine.speculator.stats.metrics()
    metrics += _moe_metrics(engine)
    metrics += engine.executor.metrics()
    ep = engine.parallel.ep if engine.parallel is not None else None
    if ep is not None:
        lockstep = engine.parallel.lockstep
        metrics += [Counter("toolkit:ep_all_to_all_bytes", {"direction": "dispatch"}, ep.stats.dispatch_bytes),
                    Counter("toolkit:ep_all_to_all_bytes", {"direction": "combine"}, ep.stats.combine_bytes),
                    Gauge("toolkit:ep_all_to_all_seconds", value=ep.stats.all_to_all_s),
                    Counter("toolkit:ep_dummy_steps", value=lockstep.dummy_steps if lockstep else 0)]
    return metrics


def _moe_metrics(engine) -> list:
    """toolkit:moe_expert_tokens{layer, expert}: (token, slot) pairs routed to each expert since start
    (under expert parallelism, those this rank's experts computed)."""
    from toolkit.models.moe import expert_token_counts

    return [Counter("toolkit:moe_expert_tokens", {"layer": str(layer), "expert": str(e)}, int(n))
            for layer, counts in expert_token_counts(engine.runner.model) for e, n in enumerate(counts.tolist())]
