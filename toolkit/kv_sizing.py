"""How much KV cache a process takes, and whether a run fits the host: arithmetic only, no torch state.

One process's cache is the smaller of two amounts:
- its budget: kv_cache_memory_bytes, or a fraction of the available memory split over the processes
  that share it (every process of a job on one CPU host; a GPU is its own);
- what the run can use: max_num_seqs requests at once, each as long as the longest request it admits
  (max_request_tokens when the workload's length is known, else max_model_len), in whole blocks.

The ModelRunner sizes its cache with this; `toolkit info` shows the same numbers before any run; the
runner (and the CLI, before starting processes) refuses a run whose weights and smallest useful cache
cannot fit the host's available memory, instead of being killed by the kernel halfway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVSizing:
    bytes_per_token: int  # this process's share: its layers (pipeline stage) and kv heads (tensor parallel)
    block_size: int
    max_num_seqs: int
    request_tokens: int  # the longest request the run will admit
    processes: int = 1  # processes drawing on the same memory

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def request_blocks(self) -> int:
        return math.ceil(self.request_tokens / self.block_size)

    @property
    def useful_blocks(self) -> int:
        """More blocks than max_num_seqs longest requests hold would never be used."""
        return self.max_num_seqs * self.request_blocks

    @property
    def min_bytes(self) -> int:
        """The smallest cache that runs the longest request at all."""
        return self.request_blocks * self.block_bytes

    def budget(self, available_bytes: int, fraction: float) -> int:
        """A fraction of the available memory, shared out over the processes that draw on it."""
        return int(available_bytes * fraction) // self.processes

    def num_blocks(self, budget_bytes: int) -> int:
        return max(0, min(int(budget_bytes) // self.block_bytes, self.useful_blocks))


def request_tokens(max_model_len: int, max_request_tokens: int | None, lookahead: int = 0) -> int:
    """The longest request a run admits: the workload's (prompt + output, when known) or max_model_len,
    plus the draft tokens a speculative step writes past it."""
    longest = max_model_len if max_request_tokens is None else min(max_request_tokens, max_model_len)
    return longest + lookahead


def check_fits(weight_bytes: int, kv_bytes: int, processes: int, available_bytes: int, request_tokens: int) -> None:
    """Raise ValueError, with the numbers and what to change, when `processes` processes that each hold
    `weight_bytes` of weights and at least `kv_bytes` of KV cache exceed the available memory."""
    need = processes * (weight_bytes + kv_bytes)
    if need <= available_bytes:
        return
    each = f"{_size(weight_bytes)} of weights + {_size(kv_bytes)} of KV cache for one {request_tokens:,}-token request"
    who = f"{processes} processes x ({each})" if processes > 1 else each
    raise ValueError(f"this run needs at least {_size(need)} ({who}) but the host has {_size(available_bytes)} "
                     "available: lower max_model_len (--max-model-len) or kv_cache_memory_bytes (--kv-cache-memory), "
                     "use fewer processes (--tp/--pp/--dp), or a smaller dtype")


def _size(n: int) -> str:
    """Bytes in the largest binary unit that keeps a whole number in front: 1.50 GiB, 300.00 KiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"
