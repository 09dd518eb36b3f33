"""Which prefill chunks the CPU attention op hands to ATen's flash attention, chosen by the machine.

`toolkit::paged_attention_cpu` serves every step kind with its own tiles (csrc/attention.cpp); given
`flash_min` > 0, a request with at least that many new tokens goes to ATen's CPU flash attention on its
gathered K/V instead (csrc/flash_prefill.h), whose GEMMs run on the CPU's matrix units (AMX, AVX-512
BF16) through oneDNN. The same threshold groups requests that begin with the same blocks (a shared
prompt prefix): where such decodes and flash chunks bring flash_min or more new tokens between them, all
their queries attend to those blocks together, as one chunk of that many rows, and each request to its
own positions alone (cascade attention).

On some CPUs flash is several times faster for long chunks, on others slower, so with
`cpu_prefill_attention="auto"` the engine measures both on the model's head shape at start, per chunk
length, and keeps the shortest length from which flash wins for good (choices.py; cached in
`$TOOLKIT_CACHE/kernels/attention-choices.json`); float16 keeps the tiles (see `choose`). "flash" sends
every chunk of 2+ tokens (prefill chunks, speculative verify steps) there, and cascades groups of 2+
requests over shared blocks; "tiles" neither.

The op takes `flash_min` as an argument, which the registered attention function (`__init__.py`) reads
from here by the step's shapes when it traces or runs a step: a draft model and its target, each with
its own head shape, each get their own.
"""

from __future__ import annotations

import logging
import time

import torch

from toolkit import envs
from toolkit.backends.cpu import choices, kernels

log = logging.getLogger("toolkit")

CANDIDATE_TOKENS = (8, 16, 24, 32, 48, 64, 96, 128, 256)
MARGIN = 0.9  # flash must be 10% faster to take a chunk length: the tiles read K/V in place, no gather
# The cached prefix of half the measured requests (the other half are first chunks): attention matters
# next to the linears only over long contexts, so the choice is made there.
PREFIX = 1024
FLASH_ALWAYS = 2  # "flash": every request of more than one new token

# (dtype, query heads, kv heads, head_dim, block_size) -> flash_min, set by `choose` for this process.
_FLASH_MIN: dict[tuple, int] = {}


def flash_min_for(q: torch.Tensor, kv_cache: torch.Tensor) -> int:
    """The op's flash_min for a step's q [tokens, heads, head_dim] and cache [2, blocks, block_size,
    kv_heads, head_dim]: what `choose` set for these shapes, else 0 (the tiles serve every chunk)."""
    return _FLASH_MIN.get(_shape_key(q.dtype, q.shape[1], kv_cache.shape[3], q.shape[2], kv_cache.shape[2]), 0)


def choose(setting: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int) -> str:
    """Set flash_min for this head shape from `setting` ("auto", "flash" or "tiles"), measuring or reading
    back the measurement for "auto"; returns what was chosen, for the engine's list of model changes."""
    if setting not in envs.CPU_PREFILL_ATTENTION_CHOICES:
        raise ValueError(f"cpu_prefill_attention must be one of {', '.join(envs.CPU_PREFILL_ATTENTION_CHOICES)}, "
                         f"got {setting!r}")
    if setting == "auto" and dtype == torch.float16:
        # ATen's kernel multiplies P by V with P rounded to float16, which the tiles keep in float32; and
        # it gains least here (at most 1.8x on long chunks on an AMX Xeon, losing below 64 tokens). In the
        # compiled step its float16 path landed past the half-dtype error bound on one MoE family
        # (tests/toolkit/test_bf16_error.py), so float16 keeps the tiles unless "flash" is asked for.
        flash_min, source = 0, "rule: float16"
    elif setting == "auto":
        library = kernels.library("attention")
        choice_key = choices.key(dtype, heads, kv_heads, head_dim, block_size, library.name if library else "",
                                 CANDIDATE_TOKENS, MARGIN, PREFIX)
        choice, read_back = choices.cached(
            "attention-choices", choice_key,
            lambda: {"flash_min": _measure(dtype, heads, kv_heads, head_dim, block_size)})
        flash_min, source = choice["flash_min"], "cached" if read_back else "measured"
    else:
        flash_min, source = (FLASH_ALWAYS if setting == "flash" else 0), "config"
    _FLASH_MIN[_shape_key(dtype, heads, kv_heads, head_dim, block_size)] = flash_min
    log.info("CPU prefill attention: %s (%s)", describe(flash_min), source)
    # Without its source: the compiled step's cache key holds this line, and a choice read back must
    # find the step compiled when it was measured.
    return f"prefill attention: {describe(flash_min)}"


def describe(flash_min: int) -> str:
    if flash_min == 0:
        return "the tiles for every chunk"
    return f"ATen's flash attention for chunks of {flash_min}+ tokens, the tiles below"


def _shape_key(dtype, heads, kv_heads, head_dim, block_size) -> tuple:
    return (dtype, int(heads), int(kv_heads), int(head_dim), int(block_size))


def _measure(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int) -> int:
    """The shortest candidate chunk length from which flash beats the tiles (by MARGIN) for good, 0 if
    it never does: four requests per length, two first chunks and two over a PREFIX-token cached prefix."""
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    op = torch.ops.toolkit.paged_attention_cpu.default

    def timings(n: int) -> tuple[float, float]:
        lens = [n, n, n + PREFIX, n + PREFIX]
        per = [-(-length // block_size) for length in lens]
        cache = torch.randn(2, sum(per) + 1, block_size, kv_heads, head_dim, generator=generator).to(dtype)
        ids = torch.randperm(sum(per), generator=generator).to(torch.int32) + 1
        tables = torch.zeros(len(lens), max(per), dtype=torch.int32)
        for r, row in enumerate(ids.split(per)):
            tables[r, :len(row)] = row
        q = torch.randn(4 * n, heads, head_dim, generator=generator).to(dtype)
        qsl = torch.arange(0, 4 * n + 1, n, dtype=torch.int32)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        return choices.best_of_each(
            lambda tiles: op(q, cache, qsl, seq_lens, tables, head_dim ** -0.5, 0 if tiles else n), reps=3)

    # Longer chunks only grow more GEMM-shaped: from the first lasting win on, flash keeps them.
    with torch.inference_mode():
        i = choices.first_lasting_win_measured(CANDIDATE_TOKENS, timings, MARGIN,
                                               "prefill attention, chunk tokens (tiles, flash)")
    log.info("measured the CPU prefill attention on the model's head shape in %.1f s", time.perf_counter() - start)
    return 0 if i is None else CANDIDATE_TOKENS[i]
