"""Sizing arithmetic for `toolkit info`: parameters, weight bytes, KV bytes, and what fits in a memory budget.

Per GPU under tensor parallelism of size tp: weights ~ 1/tp of the total (norms are replicated, a
rounding error), and the KV cache holds ceil(kv_heads / tp) kv heads per rank; when tp is larger
than the number of kv heads each head is replicated on tp / kv_heads ranks, as in vLLM.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from toolkit.attention.kv_cache import kv_cache_bytes_per_token, num_blocks_for_budget
from toolkit.config import ModelConfig
from toolkit.weights import IGNORED_SUFFIXES, checkpoint_files, open_checkpoint_file

DEFAULT_BUDGETS = ("16GiB", "24GiB", "80GiB", "141GiB")  # common GPU sizes: L4/A10-class, 4090, A100/H100, H200
WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CheckpointSize:
    parameters: int  # tensor elements in the safetensors (or GGUF) files, tied copies and recomputed buffers left out
    bytes: int  # the same tensors' bytes as stored
    dtypes: list[str]  # safetensors dtypes (F32, BF16, ...) or GGUF tensor types (F32, Q4_1, ...)
    tensors_per_dtype: dict[str, int]


def checkpoint_size(config: ModelConfig) -> CheckpointSize:
    """Read from the safetensors headers (or the GGUF tensor infos) only: no tensor data is loaded."""
    from toolkit.gguf_checkpoint import GGUFSlice

    parameters = nbytes = 0
    dtypes: dict[str, int] = {}
    for file in checkpoint_files(config.path):
        with open_checkpoint_file(file) as f:
            for name in f.keys():
                # A tied lm_head stored beside the embedding is the same parameter, counted once.
                if name.endswith(IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                sl = f.get_slice(name)
                count = math.prod(sl.get_shape())
                parameters += count
                # A quantized type packs blocks of elements with their scales: the file says its bytes.
                nbytes += sl.nbytes if isinstance(sl, GGUFSlice) else count * _itemsize(sl.get_dtype())
                dtypes[sl.get_dtype()] = dtypes.get(sl.get_dtype(), 0) + 1
    return CheckpointSize(parameters, nbytes, sorted(dtypes), dict(sorted(dtypes.items())))


def _itemsize(safetensors_dtype: str) -> int:
    return {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "U8": 1, "I8": 1,
            "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}.get(safetensors_dtype, 4)


def kv_heads_per_rank(config: ModelConfig, tp: int) -> int:
    return math.ceil(config.num_kv_heads / tp)


@dataclass
class CapacityRow:
    memory_bytes: int
    tp: int
    kv_heads_per_rank: int
    weight_bytes_per_rank: int
    kv_bytes_per_rank: int  # memory left for the KV cache on each rank (0 when the weights do not fit)
    kv_bytes_per_token_per_rank: int
    tokens: int  # whole KV blocks' worth of tokens per rank (every rank holds the same tokens)
    requests_at_max_model_len: int
    fits: bool

    def as_dict(self) -> dict:
        return asdict(self)


def capacity(config: ModelConfig, dtype: torch.dtype, memory_bytes: int, tp: int,
             block_size: int, max_model_len: int) -> CapacityRow:
    weights = math.ceil(config.num_parameters * dtype.itemsize / tp)
    heads = kv_heads_per_rank(config, tp)
    per_token = kv_cache_bytes_per_token(config.num_layers, heads, config.head_dim, dtype)
    left = max(0, memory_bytes - weights)
    blocks = num_blocks_for_budget(left, num_layers=config.num_layers, block_size=block_size,
                                   num_kv_heads=heads, head_dim=config.head_dim, dtype=dtype)
    # A request at max_model_len needs whole blocks, as the engine allocates them.
    requests = blocks // math.ceil(max_model_len / block_size)
    return CapacityRow(memory_bytes, tp, heads, weights, left, per_token, blocks * block_size, requests,
                       fits=memory_bytes > weights and blocks > 0)


def capacity_table(config: ModelConfig, dtype: torch.dtype, budgets: list[int], block_size: int,
                   max_model_len: int) -> list[CapacityRow]:
    """A row per budget and per tensor-parallel size the engine can split the model into (every one:
    a 9-head, 3-kv-head model runs at TP 3, not only at the powers of two)."""
    from toolkit.parallel.tensor_parallel import valid_tp_sizes

    return [capacity(config, dtype, memory, tp, block_size, max_model_len)
            for memory in budgets for tp in valid_tp_sizes(config)]
