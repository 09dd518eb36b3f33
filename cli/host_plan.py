"""What a CPU run takes on this host, per process and in all, for `toolkit info`: the same sizing the
engine applies at start (toolkit/kv_sizing.py), before any process starts.

Per process of a tp x pp x dp layout: the weights split over tp and pp (a lower bound, as the engine's
check counts them), and a KV cache of 0.3 of the available memory shared by every process, never more
than max_num_seqs requests of the longest request use. A disaggregated layout (`disaggregated_plan`):
the same per role, every instance's processes sharing the host, and the KV tokens each instance holds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from toolkit.attention.kv_cache import available_memory_bytes, kv_cache_bytes_per_token
from toolkit.config import ModelConfig
from toolkit.kv_sizing import KVSizing, request_tokens

CPU_FRACTION = 0.3  # EngineConfig.kv_cache_memory_fraction's default on a CPU host


@dataclass
class HostRow:
    tp: int
    pp: int
    dp: int
    processes: int
    weight_bytes_per_process: int
    kv_bytes_per_process: int
    total_bytes: int  # every process's weights and KV cache
    min_total_bytes: int  # with each KV cache holding one longest request only
    fits: bool  # min_total_bytes within the available memory: otherwise the run refuses to start

    def as_dict(self) -> dict:
        return asdict(self)


def host_row(config: ModelConfig, dtype: torch.dtype, tp: int, pp: int, dp: int, available: int, block_size: int,
             max_num_seqs: int, max_model_len: int, max_request_tokens: int | None) -> HostRow:
    processes = tp * pp * dp
    weights = config.num_parameters * dtype.itemsize // (tp * pp)
    # The busiest stage: pipeline stages take the layers in near-even shares.
    per_token = kv_cache_bytes_per_token(math.ceil(config.num_layers / pp), math.ceil(config.num_kv_heads / tp),
                                         config.head_dim, dtype)
    sizing = KVSizing(per_token, block_size, max_num_seqs, request_tokens(max_model_len, max_request_tokens), processes)
    kv = sizing.num_blocks(sizing.budget(available, CPU_FRACTION)) * sizing.block_bytes
    minimum = processes * (weights + sizing.min_bytes)
    return HostRow(tp, pp, dp, processes, weights, kv, processes * (weights + kv), minimum, minimum <= available)


@dataclass
class InstanceRow:
    role: str
    instances: int
    tp: int
    pp: int
    processes: int  # of all this role's instances
    weight_bytes_per_process: int
    kv_bytes_per_process: int
    kv_tokens_per_instance: int  # every rank of a TP instance holds its heads of the same tokens
    min_bytes_per_process: int  # weights and one longest request's KV

    def as_dict(self) -> dict:
        return asdict(self)


def disaggregated_plan(config: ModelConfig, dtype: torch.dtype, prefill: int, decode: int, prefill_tp: int,
                       decode_tp: int, block_size: int, max_num_seqs: int, max_model_len: int,
                       max_request_tokens: int | None, available: int | None = None, prefill_pp: int = 1,
                       decode_pp: int = 1) -> dict:
    """P prefill instances of prefill_pp x prefill_tp processes and D decode instances of decode_pp x
    decode_tp, all on this host."""
    available = available_memory_bytes("cpu") if available is None else available
    world = prefill * prefill_pp * prefill_tp + decode * decode_pp * decode_tp
    tokens = request_tokens(max_model_len, max_request_tokens)
    rows = []
    for role, count, tp, pp in (("prefill", prefill, prefill_tp, prefill_pp), ("decode", decode, decode_tp, decode_pp)):
        # The busiest stage's share of the layers, and the TP rank's of the heads.
        per_token = kv_cache_bytes_per_token(math.ceil(config.num_layers / pp), math.ceil(config.num_kv_heads / tp),
                                             config.head_dim, dtype)
        sizing = KVSizing(per_token, block_size, max_num_seqs, tokens, world)
        blocks = sizing.num_blocks(sizing.budget(available, CPU_FRACTION))
        weights = config.num_parameters * dtype.itemsize // (tp * pp)
        rows.append(InstanceRow(role, count, tp, pp, count * tp * pp, weights, blocks * sizing.block_bytes,
                                blocks * block_size, weights + sizing.min_bytes))
    total = sum(r.processes * (r.weight_bytes_per_process + r.kv_bytes_per_process) for r in rows)
    minimum = sum(r.processes * r.min_bytes_per_process for r in rows)
    return {"available_bytes": available, "kv_cache_memory_fraction": CPU_FRACTION, "max_num_seqs": max_num_seqs,
            "request_tokens": tokens, "processes": world, "total_bytes": total, "min_total_bytes": minimum,
            "fits": minimum <= available, "rows": [r.as_dict() for r in rows]}


def format_disaggregated(plan: dict) -> str:
    from toolkit.cli.sizes import format_size

    fits = "fits" if plan["fits"] else f"does not fit: needs {format_size(plan['min_total_bytes'])}"
    title = (f"Disaggregated on this host ({plan['processes']} processes, {format_size(plan['total_bytes'])} in "
             f"all of {format_size(plan['available_bytes'])} available: {fits}):")
    header = ["role", "instances", "TP", "PP", "processes", "weights/process", "KV cache/process", "KV tokens/instance"]
    rows = [[r["role"], str(r["instances"]), str(r["tp"]), str(r["pp"]), str(r["processes"]),
             format_size(r["weight_bytes_per_process"]),
             format_size(r["kv_bytes_per_process"]), f"{r['kv_tokens_per_instance']:,}"] for r in plan["rows"]]
    widths = [max(len(c) for c in column) for column in zip(header, *rows)]
    return "\n".join([title, *("  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in (header, *rows))])


def default_layouts(tp_sizes: list[int], num_layers: int) -> list[tuple[int, int, int]]:
    """Every TP size alone, then --dp 2 and --pp 2 (tp, pp, dp)."""
    layouts = [(tp, 1, 1) for tp in tp_sizes] + [(1, 1, 2)]
    return layouts + [(1, 2, 1)] if num_layers >= 2 else layouts


def host_plan(config: ModelConfig, dtype: torch.dtype, layouts: list[tuple[int, int, int]], block_size: int,
              max_num_seqs: int, max_model_len: int, max_request_tokens: int | None) -> dict:
    available = available_memory_bytes("cpu")
    rows = [host_row(config, dtype, tp, pp, dp, available, block_size, max_num_seqs, max_model_len,
                     max_request_tokens) for tp, pp, dp in layouts]
    return {"available_bytes": available, "kv_cache_memory_fraction": CPU_FRACTION, "max_num_seqs": max_num_seqs,
            "request_tokens": request_tokens(max_model_len, max_request_tokens),
            "rows": [row.as_dict() for row in rows]}


def for_model(path, dtype: str, layouts: list[tuple[int, int, int]] | None, block_size: int, max_num_seqs: int,
              max_model_len: int | None, max_request_tokens: int | None) -> dict:
    """The host plan of the model at `path` (read by `toolkit info`'s report already: errors are its)."""
    from toolkit.config import load_model_config, resolve_dtype
    from toolkit.parallel.tensor_parallel import valid_tp_sizes

    config = load_model_config(path)
    layouts = layouts or default_layouts(valid_tp_sizes(config), config.num_layers)
    return host_plan(config, resolve_dtype(dtype, config.checkpoint_dtype), layouts, block_size, max_num_seqs,
                     max_model_len or config.max_position_embeddings, max_request_tokens)


def format_plan(plan: dict) -> str:
    """Aligned plain text: a title line and a row per layout."""
    from toolkit.cli.sizes import format_size

    title = (f"On this host (CPU, {format_size(plan['available_bytes'])} available; the KV cache takes "
             f"{plan['kv_cache_memory_fraction']} of it shared by the processes, at most {plan['max_num_seqs']} "
             f"requests of {plan['request_tokens']:,} tokens):")
    header = ["TP", "PP", "DP", "processes", "weights/process", "KV cache/process", "total", "fits"]
    rows = [[str(r["tp"]), str(r["pp"]), str(r["dp"]), str(r["processes"]), format_size(r["weight_bytes_per_process"]),
             format_size(r["kv_bytes_per_process"]), format_size(r["total_bytes"]),
             "yes" if r["fits"] else f"no: needs {format_size(r['min_total_bytes'])}"] for r in plan["rows"]]
    widths = [max(len(c) for c in column) for column in zip(header, *rows)]
    return "\n".join([title, *("  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in (header, *rows))])
