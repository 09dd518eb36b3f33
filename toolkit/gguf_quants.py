"""De-quantizing GGUF's 32-value block types (Q4_0, Q4_1, Q8_0) with torch, for the loader.

gguf's own `gguf.quants.dequantize` is numpy on one core, and the default model's Q4_1 and Q8_0
tensors took most of its load there. These write each float32 value with the same operations in the
same order as gguf's (`d * q + m` as a product then a sum, never fused), so the result is bit for bit
gguf's; tests/toolkit/test_gguf.py holds them to that. Every other type goes to `gguf.quants`.
"""

import warnings

import numpy as np
import torch

# qtype name -> bytes at a block's start before its quants: the float16 scale, and Q4_1's float16 minimum
_HEADS = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}


def dequantize(raw: np.ndarray, qtype) -> torch.Tensor:
    """`raw`: uint8 [rows, bytes] holding whole blocks of `qtype` (a `gguf.GGMLQuantizationType`).
    Returns float32 [rows, values], owned (the file's mapping is read-only)."""
    rows = raw.shape[0]
    if qtype.name not in _HEADS:
        from gguf.quants import dequantize as numpy_dequantize

        values = numpy_dequantize(np.ascontiguousarray(raw), qtype)
        # F32 rows come back as views of the read-only mapping: a copy the model may own.
        return torch.from_numpy(np.require(values, np.float32, ["C", "W"]).reshape(rows, -1))
    from gguf import GGML_QUANT_SIZES

    size, block_bytes = GGML_QUANT_SIZES[qtype]
    head = _HEADS[qtype.name]
    with warnings.catch_warnings():  # a view of the read-only file mapping: it is only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        blocks = torch.from_numpy(np.ascontiguousarray(raw)).view(rows, -1, block_bytes)
    scales = blocks[..., :head].contiguous().view(torch.float16).float()  # [rows, blocks, 1 or 2]
    quants = blocks[..., head:]
    out = torch.empty(rows, blocks.shape[1], size, dtype=torch.float32)
    if qtype.name == "Q8_0":
        out.copy_(quants.contiguous().view(torch.int8))
    else:  # 4-bit: a byte's low nibble is value j of the block, its high nibble value j + 16
        halves = out.view(rows, -1, 2, size // 2)
        halves[:, :, 0].copy_(quants & 15)
        halves[:, :, 1].copy_(quants >> 4)
    if qtype.name == "Q4_0":
        out.sub_(8)
    out.mul_(scales[..., :1])
    if qtype.name == "Q4_1":
        out.add_(scales[..., 1:])
    return out.view(rows, -1)

