"""The CUDA backend: Triton attention, and CUDA graphs for decode-only steps.

A decode step of a small model is dominated by kernel launch overhead: one replay of a captured
graph launches everything at once. Each batch-size bucket is captured once, lazily, on its first
use; inputs are copied into static buffers before a replay. Padding rows are requests with no
query tokens (query_start_loc repeats its last value, seq_len 0, slot -1), which the Triton
kernels skip. Only the Triton attention backend is capture-safe: the torch reference reads
metadata on the host.

On a machine without CUDA this module imports, and no graph is ever captured.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from toolkit.attention import AttentionMetadata
from toolkit.backends import Backend

log = logging.getLogger("toolkit")


class CUDABackend(Backend):
    name = "cuda"

    def attention_backend(self) -> str:
        return self.config.attention_backend or "triton"

    def wrap_step(self, step):
        c = self.config
        if not (c.cuda_graphs and not c.enforce_eager and self.attention_backend() == "triton"
                and torch.cuda.is_available()):
            return step
        max_blocks = math.ceil(c.max_model_len / c.block_size)
        graphs = DecodeGraphs(step.forward, step.kv_caches, c.max_num_seqs, max_blocks, c.device,
                              self.attention_backend())
        return GraphedStep(step, graphs)


class GraphedStep:
    """Decode-only steps that fit a bucket replay a CUDA graph; every other step runs `step`."""

    def __init__(self, step, graphs: "DecodeGraphs"):
        self.step, self.graphs = step, graphs
        self.forward = step.forward

    def __call__(self, inputs, hidden=None):
        if inputs.decode_only and self.graphs.bucket_for(inputs.num_tokens):
            n = inputs.num_tokens
            return self.graphs.run(inputs.input_ids[:n], inputs.positions[:n], inputs.meta, inputs.logits_indices,
                                   None if hidden is None else hidden[:n])
        return self.step(inputs, hidden)


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({min(s, max_num_seqs) for s in sizes})


class DecodeGraphs:
    def __init__(self, forward, kv_caches, max_num_seqs: int, max_blocks: int, device: torch.device, backend: str):
        self.forward = forward
        self.kv_caches = kv_caches
        self.buckets = batch_buckets(max_num_seqs)
        self.max_blocks = max_blocks
        self.device = device
        self.backend = backend
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]] = {}
        self.pool = None

    def bucket_for(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def run(self, input_ids, positions, meta: AttentionMetadata, logits_indices, hidden=None) -> torch.Tensor:
        """Logits for a decode-only batch (one token per request, every request samples); a pipeline
        stage after the first is given the previous stage's `hidden`, one before the last returns its
        own. The result is a view of the graph's static output, which the next replay overwrites."""
        batch = input_ids.shape[0]
        bucket = self.bucket_for(batch)
        if bucket not in self.graphs:
            self._capture(bucket, hidden)
        graph, static, out = self.graphs[bucket]
        self._fill(static, input_ids, positions, meta, hidden)
        graph.replay()
        return out[:batch]

    def _fill(self, static: dict, input_ids, positions, meta: AttentionMetadata, hidden) -> None:
        b = input_ids.shape[0]
        if hidden is not None:
            static["hidden"][:b].copy_(hidden)
        static["input_ids"][:b].copy_(input_ids)
        static["positions"][:b].copy_(positions)
        static["slot_mapping"].fill_(-1)
        static["slot_mapping"][:b].copy_(meta.slot_mapping[:b])
        static["query_start_loc"].copy_(torch.clamp(torch.arange(static["query_start_loc"].shape[0], device=self.device), max=b))
        static["seq_lens"].zero_()
        static["seq_lens"][:b].copy_(meta.seq_lens[:b])  # rows past b are padding
        static["block_tables"].zero_()
        static["block_tables"][:b, : meta.block_tables.shape[1]].copy_(meta.block_tables[:b])

    def _capture(self, bucket: int, hidden_like) -> None:
        start = time.perf_counter()
        i32, i64 = torch.int32, torch.int64
        static = {
            "input_ids": torch.zeros(bucket, dtype=i64, device=self.device),
            "positions": torch.zeros(bucket, dtype=i64, device=self.device),
            "slot_mapping": torch.full((bucket,), -1, dtype=i64, device=self.device),
            "query_start_loc": torch.zeros(bucket + 1, dtype=i32, device=self.device),
            "seq_lens": torch.zeros(bucket, dtype=i32, device=self.device),
            "block_tables": torch.zeros(bucket, self.max_blocks, dtype=i32, device=self.device),
        }
        meta = AttentionMetadata(static["query_start_loc"], static["seq_lens"], static["block_tables"],
                                 static["slot_mapping"], backend=self.backend)
        if hidden_like is not None:  # a pipeline stage after the first
            static["hidden"] = torch.zeros(bucket, *hidden_like.shape[1:], dtype=hidden_like.dtype, device=self.device)
        indices = torch.arange(bucket, device=self.device)

        def call():
            return self.forward(static["input_ids"], static["positions"], self.kv_caches, meta, indices,
                                static.get("hidden"))

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()  # warm-up: compiles this shape and runs autotuning outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = call()
        self.pool = graph.pool()
        self.graphs[bucket] = (graph, static, out)
        log.info("captured CUDA graph for decode batch %d in %.1f s", bucket, time.perf_counter() - start)
