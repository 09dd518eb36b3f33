"""The CPU kernels as torch ops: built (build.py), loaded into the dispatcher, given fake kernels.

- `toolkit::linear_cpu(x, panels, onednn_weight, bias, out_features, small_m)` (csrc/linear.cpp):
  the linear, panel kernel for small row counts, oneDNN for the rest (toolkit/backends/cpu/linear.py).
- `toolkit::linear_int8_cpu(x, panels, scales, bias, out_features, small_m)`: the panel kernel over int8 panels
  with a float32 scale per output column (weight-only int8, toolkit/quantization.py).
- `toolkit::pack_panels(weight, panels)`: a weight into the panel layout, once at load.
- `toolkit::experts_cpu(x, topk_weights, topk_ids, first_expert, w13_panels, w2_panels, w13_onednn,
  w2_onednn, small_m, tokens_per_expert=None)` (csrc/experts.cpp): an MoE layer's routed experts in one
  call, counting the pairs each expert received into tokens_per_expert where given; the compiled step
  calls it straight (toolkit/backends/cpu/experts.py), and it is the CPU implementation of
  `toolkit::moe_experts` under expert parallelism.
- `toolkit::paged_attention_cpu(q, kv_cache, query_start_loc, seq_lens, block_tables, scale, flash_min=0)` and
  `toolkit::write_kv_cpu(k, v, kv_cache, slot_mapping)` (csrc/attention.cpp): attention for every
  step kind and the KV write; `attention/` dispatches to them once the CPU backend registers them.
  Requests with at least `flash_min` (> 0) new tokens go to ATen's CPU flash attention on their
  gathered K/V instead (csrc/flash_prefill.h; attention_plan.py measures where that pays), and so
  do the shared leading blocks of `flash_min` or more decodes that begin with them (cascade).

The ops are C++ end to end (no Python kernel), so an eager call costs a dispatcher call, and a graph
compiled with Inductor's C++ wrapper calls them without entering Python. Their fake kernels, for
tracing, are the Python functions below.
"""

from __future__ import annotations

import functools
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from toolkit.backends.cpu import build

SOURCES = {"linear": build.CSRC / "linear.cpp", "attention": build.CSRC / "attention.cpp",
           "experts": build.CSRC / "experts.cpp"}
EVERY_MODEL = ("linear", "attention")  # the kernels every model uses; "experts" only an MoE model's
_loaded: dict[str, Path] = {}
_failed: dict[str, str] = {}
_building: dict[str, Future] = {}
_pool: ThreadPoolExecutor | None = None


def start_build(names=tuple(SOURCES)) -> None:
    """Start building the kernels `names` not loaded or building yet, in the background: the compilers
    are subprocesses, so the caller's own start-up work (reading the tokenizer and weights) overlaps
    them. `load` waits."""
    global _pool
    for name in names:
        if name not in _loaded and name not in _failed and name not in _building:
            if _pool is None:
                _pool = ThreadPoolExecutor(len(SOURCES), thread_name_prefix="kernel-build")
            _building[name] = _pool.submit(build.build_or_error, SOURCES[name])


def load(names=tuple(SOURCES)) -> dict[str, str]:
    """Build (or wait for `start_build`) and load the kernels `names` not loaded yet; returns {kernel: why
    it is unavailable}. Each failure warns once, naming the source file; callers use torch's own ops instead."""
    global _pool
    start_build(names)
    for name in names:
        if name not in _building:
            continue
        result = _building.pop(name).result()
        if isinstance(result, Exception):
            _failed[name] = str(result)
            warnings.warn(f"the CPU {name} kernel ({SOURCES[name]}) is unavailable, so torch's own ops run instead, "
                          f"several times slower: {result}", RuntimeWarning, stacklevel=2)
            continue
        torch.ops.load_library(str(result))
        _register_fakes(name)
        _loaded[name] = result
    if not _building and _pool is not None:  # nothing left to build: no idle thread outlives the builds
        _pool.shutdown()
        _pool = None
    return {name: why for name, why in _failed.items() if name in names}


def library(name: str) -> Path | None:
    """The library kernel `name` was loaded from in this process (its file name keys its sources, flags,
    compiler and CPU), or None."""
    return _loaded.get(name)


def available(name: str) -> bool:
    """Whether kernel `name` ("linear", "attention" or "experts") was built and loaded in this process."""
    return name in _loaded


@functools.cache
def _register_fakes(name: str) -> None:
    if name == "linear":
        torch.library.register_fake("toolkit::linear_cpu")(_linear_fake)
        torch.library.register_fake("toolkit::linear_int8_cpu")(_linear_int8_fake)
    elif name == "experts":
        torch.library.register_fake("toolkit::experts_cpu")(_experts_fake)
    elif name == "attention":
        torch.library.register_fake("toolkit::paged_attention_cpu")(_attention_fake)
        torch.library.register_fake("toolkit::write_kv_cpu")(_write_fake)


def _linear_fake(x, panels, onednn_weight, bias, out_features, small_m):
    return x.new_empty(x.shape[0], out_features)


def _linear_int8_fake(x, panels, scales, bias, out_features, small_m):
    return x.new_empty(x.shape[0], out_features)


def _experts_fake(x, topk_weights, topk_ids, first_expert, w13_panels, w2_panels, w13_onednn, w2_onednn, small_m,
                  tokens_per_expert=None):
    return x.new_empty(x.shape)


def _attention_fake(q, kv_cache, query_start_loc, seq_lens, block_tables, scale, flash_min=0):
    return q.new_empty(q.shape).contiguous()


def _write_fake(k, v, kv_cache, slot_mapping):
    return None
